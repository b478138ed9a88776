"""Hostile clients against real ``paged-kv serve --role prefill|decode`` processes (no API
keys: every client is anyone): a client's ``kv_transfer_params`` never make an engine lease
pages or contact an endpoint it names, the secret never leaves an engine, forged pages
never land in a decode engine's prefix cache, and one bad hand-off never fails the others.

A recording ZMQ peer stands where an attacker would listen; an on-path relay stands where
an attacker would sit between the engines (it forwards the decode engine's messages to the
real prefill engine and rewrites what comes back).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import time
from collections.abc import Iterator

import numpy as np
import pytest

from ..server.test_server import httpx, make_prompt, metric, running_server
from .conftest import HANDOFF_SECRET, ZmqPeer, post_as_router, signed

zmq = pytest.importorskip("zmq")

from paged_kv.handoff.server import call  # noqa: E402
from paged_kv.handoff.trust import HEADER, HandoffTrust  # noqa: E402
from paged_kv.keys import block_keys, root_hash  # noqa: E402
from paged_kv.tiers import codec  # noqa: E402

MAX_TOKENS = 10


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """``(prefill, decode, both)`` URLs, without API keys."""
    logs = tmp_path_factory.mktemp("trust")
    secret = ("--handoff-secret", HANDOFF_SECRET)
    with running_server("--role", "prefill", *secret, log=logs / "prefill") as (_, prefill), \
            running_server("--role", "decode", *secret, log=logs / "decode") as (_, dec), \
            running_server(log=logs / "both") as (_, both):
        yield prefill, dec, both


class Listener(ZmqPeer):
    """A ZMQ ROUTER that records every message and answers ``ok`` (an attacker's);
    `answer` says what it sends back."""

    def __init__(self) -> None:
        self.frames: list[list[bytes]] = []
        super().__init__()

    def answer(self, frames: list[bytes]) -> list[bytes]:
        return [b"ok"]

    def _loop(self) -> None:
        while not self._stop.is_set():
            if self._sock.poll(20):
                frames = self._sock.recv_multipart()
                self.frames.append(frames[1:])
                self._sock.send_multipart([frames[0], *self.answer(frames[1:])])


@contextlib.contextmanager
def listener() -> Iterator[Listener]:
    peer = Listener()
    try:
        yield peer
    finally:
        peer.close()


def completion(prompt: list[int], **extra) -> dict:
    return {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True, **extra}


def tokens(reply: httpx.Response) -> list[int]:
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["token_ids"]


def forged_params(prompt: list[int], endpoint: str) -> dict:
    """What an attacker would send a decode engine: its own endpoint, the prompt's real
    block keys (anyone can compute them), a lease id of its choosing."""
    keys = block_keys(np.asarray(prompt), 16, root_hash(None))  # serve's default block
    return {"do_remote_prefill": True, "remote_engine": endpoint, "lease": "ab" * 16,
            "block_keys": [k.hex() for k in keys], "num_prompt_tokens": len(prompt)}


def prefill_params(url: str, prompt: list[int]) -> dict:
    reply = post_as_router(f"{url}/v1/completions", completion(
        prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
    assert reply.status_code == 200, reply.text
    return reply.json()["kv_transfer_params"]


def fallbacks(url: str, reason: str) -> float:
    return metric(url, "paged_kv_handoff_fallbacks_total", f'{{reason="{reason}"}}')


def test_a_client_cannot_send_a_decode_engine_anywhere(engines):
    """A client's ``kv_transfer_params`` naming its own endpoint: 403 without the router's
    signature (none, another secret's, a stale one), and the endpoint hears nothing."""
    _, dec, _ = engines
    prompt = make_prompt(50, seed=1)
    with listener() as peer:
        body = completion(prompt, kv_transfer_params=forged_params(prompt, peer.endpoint))
        url, content = f"{dec}/v1/completions", json.dumps(body).encode()
        stale = HandoffTrust(HANDOFF_SECRET).router_header(content, now=time.time() - 3600)
        replies = [httpx.post(url, json=body, timeout=60),
                   post_as_router(url, body, secret="not-the-secret"),
                   httpx.post(url, content=content, timeout=60,
                              headers={"content-type": "application/json", HEADER: stale})]
        for reply in replies:
            assert reply.status_code == 403, reply.text
            assert reply.json()["error"]["param"] == "kv_transfer_params"
        time.sleep(0.5)
        assert peer.frames == []


def test_a_client_cannot_make_a_prefill_engine_lease_pages(engines):
    prefill, _, _ = engines
    body = completion(make_prompt(40, seed=2), max_tokens=1,
                      kv_transfer_params={"do_remote_decode": True})
    reply = httpx.post(f"{prefill}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 403 and "kv_transfer_params" in reply.text
    assert metric(prefill, "paged_kv_handoffs_total", '{role="prefill"}') == 0
    assert metric(prefill, "paged_kv_handoff_leases", '{state="live"}') == 0


@pytest.mark.parametrize("signature", [None, "00" * 32, "other-secret"])
def test_parameters_the_secret_did_not_sign_are_never_pulled(engines, signature):
    """Even in a body the router signed, parameters without the prefill engine's
    signature (none, a made-up one, another secret's) fall back, counted, contacting
    nothing; the tokens are one engine's."""
    _, dec, both = engines
    prompt = make_prompt(45, seed=3)
    with listener() as peer:
        params = forged_params(prompt, peer.endpoint)
        if signature == "other-secret":
            params = signed(params, "other-secret")
        elif signature is not None:
            params["signature"] = signature
        before = fallbacks(dec, "unsigned")
        reply = post_as_router(f"{dec}/v1/completions",
                               completion(prompt, kv_transfer_params=params))
        assert tokens(reply) == tokens(httpx.post(f"{both}/v1/completions",
                                                  json=completion(prompt), timeout=60))
        assert fallbacks(dec, "unsigned") == before + 1
        time.sleep(0.3)
        assert peer.frames == []


class Relay(Listener):
    """An attacker on the path to the prefill engine's page server: forwards each message,
    then answers with every value's payload replaced by its own bytes under a well-formed
    header (fresh checksum), the MACs left as they came. Records every frame it sees."""

    def __init__(self, target: str) -> None:
        self.target = target
        super().__init__()

    def answer(self, frames: list[bytes]) -> list[bytes]:
        answer = call(self._context, self.target, frames, 5.0) or [b"expired"]
        if answer[0] == b"ok" and len(answer) > 2:
            answer = [*answer[:2], *(forge(v) for v in answer[2:])]
        return answer


def forge(value: bytes) -> bytes:
    """`value` with garbage for its payload and a header that verifies for it."""
    fields = list(codec.HEADER.unpack_from(value))
    garbage = bytes((i * 7 + 3) % 256 for i in range(len(value) - codec.HEADER.size))
    fields[2], fields[6] = codec.checksum(garbage)
    return codec.HEADER.pack(*fields) + garbage


def test_forged_pages_never_land_and_the_secret_never_travels(engines):
    """The relay's pages pass their own header and checksum but not their MACs: the
    hand-off falls back (verify_failed), nothing lands, and a later request of the same
    prompt without hand-off gets one engine's tokens; no frame carried the secret."""
    prefill, dec, both = engines
    prompt = make_prompt(70, seed=4)
    want = tokens(httpx.post(f"{both}/v1/completions", json=completion(prompt), timeout=60))
    params = prefill_params(prefill, prompt)
    relay = Relay(params["remote_engine"])
    try:
        before = fallbacks(dec, "verify_failed")
        moved = {**signed({**params, "remote_engine": relay.endpoint}),
                 "do_remote_prefill": True}
        reply = post_as_router(f"{dec}/v1/completions",
                               completion(prompt, kv_transfer_params=moved))
        assert tokens(reply) == want
        assert reply.json()["usage"]["prompt_tokens_details"].get(
            "cached_tokens_by_source", {}).get("peer", 0) == 0
        assert fallbacks(dec, "verify_failed") == before + 1
        assert any(f[0] == b"get" for f in relay.frames)
        secret = HANDOFF_SECRET.encode()
        assert all(secret not in frame for message in relay.frames for frame in message)
        assert all(len(message[1]) == 32 for message in relay.frames)  # a MAC in its place
    finally:
        relay.close()
    again = httpx.post(f"{dec}/v1/completions", json=completion(prompt), timeout=60)
    assert tokens(again) == want  # the prefix cache holds the engine's own blocks only


def test_one_bad_hand_off_fails_no_other_request(engines):
    """Seven requests in flight and one naming a malformed endpoint: that one is a 400
    naming ``kv_transfer_params.remote_engine``, the seven are served; then two signed
    hand-offs to endpoints nobody answers fall back one at a time (engine_gone), and the
    next good hand-off is served from the peer at once (no wedged socket)."""
    prefill, dec, _ = engines
    prompts = [make_prompt(30 + i, seed=10 + i) for i in range(7)]
    bad = completion(prompts[0], kv_transfer_params={
        **forged_params(prompts[0], "tcp://junkA")})
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        running = [pool.submit(httpx.post, f"{dec}/v1/completions", timeout=120,
                               json=completion(p, max_tokens=60, ignore_eos=True))
                   for p in prompts]
        rejected = post_as_router(f"{dec}/v1/completions", bad)
        assert all(f.result().status_code == 200 for f in running)
    assert rejected.status_code == 400
    assert rejected.json()["error"]["param"] == "kv_transfer_params.remote_engine" or \
        "kv_transfer_params.remote_engine" in rejected.text
    before = fallbacks(dec, "engine_gone")
    for i, port in enumerate((1, 9)):
        prompt = make_prompt(40, seed=20 + i)
        params = {**signed({**prefill_params(prefill, prompt),
                            "remote_engine": f"tcp://127.0.0.1:{port}"}),
                  "do_remote_prefill": True}
        reply = post_as_router(f"{dec}/v1/completions",
                               completion(prompt, kv_transfer_params=params))
        assert reply.status_code == 200
    assert fallbacks(dec, "engine_gone") == before + 2
    prompt = make_prompt(48, seed=30)
    params = {**prefill_params(prefill, prompt), "do_remote_prefill": True}
    start = time.monotonic()
    reply = post_as_router(f"{dec}/v1/completions", completion(prompt, kv_transfer_params=params))
    assert time.monotonic() - start < 10.0
    assert reply.json()["usage"]["prompt_tokens_details"]["cached_tokens_by_source"][
        "peer"] == 32
