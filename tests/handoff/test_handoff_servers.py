"""Prefill on one ``paged-kv serve``, decode on another, driven by hand over loopback (no
router): the decode output equals a ``both`` server's, its usage counts the received prompt
tokens, and every failure falls back (or fails, with 502) counted by its reason; after each
test the prefill engine holds no lease and the decode pool no live block.

Each server is a real subprocess on a free 127.0.0.1 port, stopped by `running_server`.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time

import pytest

from paged_kv.handoff.trust import HEADER, HandoffTrust

from ..server.test_server import httpx, make_prompt, metric, running_server, sse_events
from .conftest import HANDOFF_SECRET, post_as_router, signed

zmq = pytest.importorskip("zmq")

SECRET = HANDOFF_SECRET
BLOCK = 16  # serve's default --block-size
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys"
    path.write_text("key-a alice\nkey-b bob\n")
    return str(path)


@pytest.fixture(scope="module")
def servers(tmp_path_factory, keys_file):
    """``(prefill, decode, both)`` URLs: one of each role, the same tenants."""
    logs = tmp_path_factory.mktemp("handoff")
    common = ("--api-keys", keys_file, "--handoff-secret", SECRET)
    with running_server("--role", "prefill", *common, log=logs / "prefill") as (_, prefill), \
            running_server("--role", "decode", *common, log=logs / "decode") as (_, decode), \
            running_server("--api-keys", keys_file, log=logs / "both") as (_, both):
        yield prefill, decode, both


def post(url: str, body: dict, key: str = "key-a") -> httpx.Response:
    """As the router sends it (signed: a hand-off is the router's to ask for)."""
    return post_as_router(f"{url}/v1/completions", body, {"Authorization": f"Bearer {key}"})


def prefill_params(url: str, prompt: list[int], key: str = "key-a") -> dict:
    """The prefill engine's ``kv_transfer_params`` for `prompt` (max_tokens 1)."""
    reply = post(url, {"prompt": prompt, "max_tokens": 1, "temperature": 0,
                       "kv_transfer_params": {"do_remote_decode": True}}, key)
    assert reply.status_code == 200, reply.text
    return reply.json()["kv_transfer_params"]


def decode(url: str, prompt: list[int], params: dict | None, key: str = "key-a",
           ) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True}
    if params is not None:
        body["kv_transfer_params"] = {**params, "do_remote_prefill": True}
    return post(url, body, key)


def tokens(reply: httpx.Response) -> list[int]:
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["token_ids"]


def fallbacks(url: str, reason: str) -> float:
    return metric(url, "paged_kv_handoff_fallbacks_total", f'{{reason="{reason}"}}')


def settled(prefill: str | None, decode: str, timeout: float = 15.0) -> bool:
    """Whether, within `timeout`, the prefill engine holds no lease and the decode pool no
    live block (bounded poll)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        leases = 0 if prefill is None else metric(prefill, "paged_kv_handoff_leases",
                                                  '{state="live"}')
        if leases == 0 and metric(decode, "paged_kv_blocks", '{state="live"}') == 0:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize(("length", "key"), [(5, "key-a"), (40, "key-a"), (97, "key-a"),
                                             (64, "key-b")])
def test_decode_output_equals_one_engine_and_counts_the_received_tokens(servers, length, key):
    prefill, dec, both = servers
    prompt = make_prompt(length, seed=length)
    before = metric(dec, "paged_kv_handoffs_total", '{role="decode"}')
    params = prefill_params(prefill, prompt, key)
    assert set(params) == {"remote_engine", "lease", "block_keys", "first_token",
                           "num_prompt_tokens", "lease_seconds", "signature"}
    assert params["remote_engine"].startswith("tcp://127.0.0.1:")
    # every full block but the one of the last token (the decode engine computes it)
    assert len(params["block_keys"]) == (length - 1) // BLOCK
    assert params["num_prompt_tokens"] == length
    reply = decode(dec, prompt, params, key)
    expected = tokens(post(both, {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                                  "return_token_ids": True}, key))
    assert tokens(reply) == expected and params["first_token"] == expected[0]
    details = reply.json()["usage"]["prompt_tokens_details"]
    received = (length - 1) // BLOCK * BLOCK  # the block of the last token is computed
    assert details["cached_tokens"] == received
    assert details["cached_tokens_by_source"].get("peer", 0) == received
    assert metric(dec, "paged_kv_handoffs_total", '{role="decode"}') == before + (received > 0)
    assert settled(prefill, dec)
    for reason in ("missing_params", "verify_failed", "transfer_failed", "engine_gone"):
        assert fallbacks(dec, reason) == 0


def test_missing_params_recompute_and_are_counted(servers):
    prefill, dec, both = servers
    prompt = make_prompt(50, seed=7)
    before = fallbacks(dec, "missing_params")
    expected = tokens(decode(both, prompt, None))
    assert tokens(decode(dec, prompt, None)) == expected  # no kv_transfer_params at all
    stripped = {"lease": "ab" * 16}  # do_remote_prefill, but the rest dropped by a proxy
    assert tokens(decode(dec, prompt, stripped)) == expected
    assert fallbacks(dec, "missing_params") == before + 2
    assert settled(prefill, dec)


def test_malformed_params_are_a_400_naming_the_field(servers):
    _, dec, _ = servers
    reply = post(dec, {"prompt": [1, 2, 3], "kv_transfer_params": {"block_keys": "nope"}})
    assert reply.status_code == 400
    assert "kv_transfer_params.block_keys" in reply.text


def test_another_tenants_keys_are_never_loaded(servers):
    prefill, dec, both = servers
    prompt = make_prompt(48, seed=3)
    params = prefill_params(prefill, prompt, "key-a")  # alice's keys
    before = fallbacks(dec, "tenant_mismatch")
    reply = decode(dec, prompt, params, "key-b")  # bob's request
    assert tokens(reply) == tokens(decode(both, prompt, None, "key-b"))
    assert reply.json()["usage"]["prompt_tokens_details"]["cached_tokens_by_source"].get(
        "peer", 0) == 0
    assert fallbacks(dec, "tenant_mismatch") == before + 1
    assert settled(prefill, dec)  # the lease was released all the same


def get_frames(params: dict, secret: str = SECRET, verb: bytes = b"get") -> list[bytes]:
    """A message about `params`' lease with `secret`'s MAC (a get: of all its keys)."""
    from paged_kv.handoff.trust import HandoffTrust

    lease = params["lease"].encode()
    keys = [bytes.fromhex(k) for k in params["block_keys"]] if verb == b"get" else []
    return [verb, HandoffTrust(secret).request_mac(verb, lease, keys), lease, *keys]


def test_a_pull_without_the_secrets_mac_is_refused(servers):
    prefill, dec, _ = servers
    prompt = make_prompt(40, seed=11)
    params = prefill_params(prefill, prompt)
    context = zmq.Context()
    try:
        def ask(frames: list[bytes]) -> list[bytes] | None:
            sock = context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(params["remote_engine"])
            sock.send_multipart(frames)
            answer = sock.recv_multipart() if sock.poll(5000) else None
            sock.close()
            return answer
        assert ask(get_frames(params, "wrong")) == [b"refused"]
        old = get_frames(params)
        assert ask([old[0], SECRET.encode(), *old[2:]]) == [b"refused"]  # the bare secret
        ok = ask(get_frames(params))
        assert ok[0] == b"ok" and len(ok) == 2 + len(params["block_keys"])
    finally:
        context.term()
    decode(dec, prompt, params)  # takes (and releases) the lease
    assert settled(prefill, dec)


@contextlib.contextmanager
def fake_prefill(values: list[bytes]):
    """A ROUTER that answers every ``get`` with `values` (the MACs' frame first; and
    counts releases)."""
    context = zmq.Context()
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    seen: list[bytes] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if sock.poll(50):
                frames = sock.recv_multipart()
                seen.append(frames[1])
                answer = [b"ok", *values[:len(frames) - 3]] if frames[1] == b"get" else [b"ok"]
                sock.send_multipart([frames[0], *answer])
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"tcp://127.0.0.1:{port}", seen
    finally:
        stop.set()
        thread.join(5)
        sock.close()
        context.term()


def test_a_tampered_page_is_never_served(servers):
    prefill, dec, both = servers
    prompt = make_prompt(70, seed=5)
    params = prefill_params(prefill, prompt)
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(params["remote_engine"])
    sock.send_multipart(get_frames(params))
    assert sock.poll(5000)
    macs, *values = sock.recv_multipart()[1:]
    sock.send_multipart(get_frames(params, verb=b"release"))
    sock.poll(5000)
    sock.close()
    context.term()
    tampered = bytearray(values[1])
    tampered[-1] ^= 0xFF  # the second block's last byte
    before = fallbacks(dec, "verify_failed")
    with fake_prefill([macs, values[0], bytes(tampered), *values[2:]]) as (endpoint, seen):
        reply = decode(dec, prompt, signed({**params, "remote_engine": endpoint}))
        assert tokens(reply) == tokens(decode(both, prompt, None))
        deadline = time.monotonic() + 5
        while b"release" not in seen and time.monotonic() < deadline:
            time.sleep(0.02)
        assert b"release" in seen
    sources = reply.json()["usage"]["prompt_tokens_details"]["cached_tokens_by_source"]
    assert sources.get("peer") == BLOCK  # the block before the tampered one only
    assert fallbacks(dec, "verify_failed") == before + 1
    assert settled(prefill, dec)


@pytest.fixture
def short_prefill(tmp_path, keys_file):
    """A prefill engine whose leases live half a second."""
    with running_server("--role", "prefill", "--api-keys", keys_file, "--handoff-secret",
                        SECRET, "--handoff-lease-s", "0.5", log=tmp_path / "prefill") as pair:
        yield pair


def test_an_expired_lease_falls_back_and_is_counted_on_both_sides(servers, short_prefill):
    _, dec, both = servers
    _, prefill = short_prefill
    prompt = make_prompt(60, seed=9)
    params = prefill_params(prefill, prompt)
    time.sleep(1.5)
    before = fallbacks(dec, "lease_expired")
    assert tokens(decode(dec, prompt, params)) == tokens(decode(both, prompt, None))
    assert fallbacks(dec, "lease_expired") == before + 1
    assert metric(prefill, "paged_kv_handoff_leases_expired_total") == 1
    assert settled(prefill, dec)


@pytest.fixture
def failing_decode(tmp_path, keys_file):
    """A decode engine whose failed hand-offs fail the request."""
    with running_server("--role", "decode", "--api-keys", keys_file, "--handoff-secret",
                        SECRET, "--handoff-failure", "fail", log=tmp_path / "decode") as pair:
        yield pair[1]


def test_a_gone_prefill_engine_recomputes_or_fails_with_502(servers, short_prefill,
                                                            failing_decode):
    _, dec, both = servers
    proc, prefill = short_prefill
    prompt = make_prompt(60, seed=13)
    params = signed({**prefill_params(prefill, prompt), "lease_seconds": 30.0})
    proc.terminate()
    proc.wait(timeout=30)
    before = fallbacks(dec, "engine_gone")
    assert tokens(decode(dec, prompt, params)) == tokens(decode(both, prompt, None))
    assert fallbacks(dec, "engine_gone") == before + 1
    failed = decode(failing_decode, prompt, params)
    assert failed.status_code == 502 and "engine_gone" in failed.json()["error"]["message"]
    assert fallbacks(failing_decode, "engine_gone") == 1
    missing = decode(failing_decode, prompt, None)
    assert missing.status_code == 502 and "missing_params" in missing.text
    assert settled(None, dec) and settled(None, failing_decode)


def test_chat_n2_and_a_stream_on_the_decode_engine_equal_one_engine(servers):
    prefill, dec, both = servers
    chat = {"messages": [{"role": "user", "content": "tell me about pages " * 4}],
            "max_tokens": 8, "temperature": 0, "n": 2}
    headers = {"Authorization": "Bearer key-a"}

    def ask(url: str, body: dict) -> httpx.Response:
        reply = post_as_router(f"{url}/v1/chat/completions", body, headers)
        assert reply.status_code == 200, reply.text
        return reply
    params = ask(prefill, {**chat, "max_tokens": 1, "n": 1,
                           "kv_transfer_params": {"do_remote_decode": True}}
                 ).json()["kv_transfer_params"]
    assert params["block_keys"]
    handed = ask(dec, {**chat, "kv_transfer_params": {**params, "do_remote_prefill": True}})
    expected = [c["message"]["content"] for c in ask(both, chat).json()["choices"]]
    assert [c["message"]["content"] for c in handed.json()["choices"]] == expected
    details = handed.json()["usage"]["prompt_tokens_details"]
    assert details["cached_tokens_by_source"]["peer"] == details["cached_tokens"] > 0
    prompt = make_prompt(45, seed=21)  # and a stream, on a completion
    params = prefill_params(prefill, prompt)
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "kv_transfer_params": {**params, "do_remote_prefill": True}}
    content = json.dumps(body).encode()
    with httpx.stream("POST", f"{dec}/v1/completions", content=content, timeout=60,
                      headers={**headers, "content-type": "application/json",
                               HEADER: HandoffTrust(SECRET).router_header(content)}) as reply:
        events = sse_events(reply.iter_lines())
    text = "".join(e["choices"][0]["text"] for e in events if e != "DONE" and e["choices"])
    assert text == post(both, {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
                        ).json()["choices"][0]["text"]
    assert settled(prefill, dec)
    assert fallbacks(dec, "transfer_failed") == 0
