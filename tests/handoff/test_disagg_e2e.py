"""End to end: ``paged-kv route --prefill P --decode D`` over real ``paged-kv serve``
processes (issue 30's CI tests).

- 200 mixed requests (greedy, seeded sampling, n = 2, stop strings, logprobs; completions
  and chat; some streamed) through the router equal the same requests on one ``both``
  engine that holds each prompt's pages (as the decode engine does once they landed), for
  float and 8-bit pages; no fallback, every hand-off counted, the received prompt tokens
  counted as cached.
- Faults: the prefill engine killed between the phases, the decode engine killed during
  the transfer, a transfer slowed past the lease, the parameters stripped by a proxy, a
  tampered page: every request completes (recompute) or fails with a 502 naming the
  reason (fail), the fallback counter says why, and no page or lease is left behind.
- 500 requests aborted at random moments: both pools go back to idle within a lease.

The misbehaving parts (an HTTP proxy in front of the prefill replica, a ZMQ proxy in
front of its page server) are in `conftest`.
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("zmq")
pytest.importorskip("fastapi")

from paged_kv.handoff.config import REASONS  # noqa: E402
from paged_kv.router.disagg import decode_body, prefill_body  # noqa: E402

from .conftest import PrefillProxy, Processes, peer_proxy, post_as_router, route  # noqa: E402

BLOCK = 16  # serve's default --block-size
LEASE_S = 2.0  # short: a lease nobody claims is gone within a test
VOCAB = 2048  # the embedded TinyLlama's
SECRET = ("--handoff-secret", "s3cret")


def serve(role: str, *flags: str) -> list[str]:
    return ["serve", "--role", role, *(SECRET if role != "both" else ()), *flags]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """Float (P, D, B, R) and 8-bit (P8, D8, B8, R8) prefill, decode, both and router
    processes; F, a decode engine failing what it cannot load; RX and RF, routers from a
    `PrefillProxy` (``proxy``) in front of P to D and to F; ``engine``, P's page server.

    Every engine steps on one thread: a step's thread count follows the load of the other
    processes, and the matmuls round a row by how their rows split among threads: with
    8-bit pages one engine at 1 and at 2 threads differed by over 1e-5 in 4 of 150 prompts
    (up to 1.2e-4), which would leave nothing exact to compare."""
    with (pytest.MonkeyPatch.context() as env,
          Processes(tmp_path_factory.mktemp("e2e")) as procs):
        env.setenv("OMP_NUM_THREADS", "1")  # inherited by every process started below
        lease = ("--handoff-lease-s", str(LEASE_S))
        int8 = ("--kv-cache-dtype", "int8")
        found = procs.start(P=serve("prefill", *lease), D=serve("decode"), B=serve("both"),
                            P8=serve("prefill", *lease, *int8), D8=serve("decode", *int8),
                            B8=serve("both", *int8),
                            F=serve("decode", "--handoff-failure", "fail"))
        found["proxy"] = proxy = PrefillProxy(found["P"].url)
        procs.callback(proxy.close)
        found.update(procs.start(R=route(found["P"].url, found["D"].url),
                                 R8=route(found["P8"].url, found["D8"].url),
                                 RX=route(proxy.url, found["D"].url),
                                 RF=route(proxy.url, found["F"].url)))
        data = {"prompt": tokens(20, 0), "max_tokens": 2, "temperature": 0}
        params = post(found["P"].url, prefill_body(data)).json()["kv_transfer_params"]
        found["engine"] = params["remote_engine"]
        assert post(found["D"].url, decode_body(data, params)).status_code == 200
        yield found


# -- helpers ---------------------------------------------------------------------------------
def tokens(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(length)]


def post(url: str, body: dict, path: str = "/v1/completions") -> httpx.Response:
    """As the router sends it: signed (an engine takes a hand-off from no one else)."""
    return post_as_router(url + path, body)


def fallbacks(proc, reason: str) -> float:
    return proc.metric("paged_kv_handoff_fallbacks_total", f'{{reason="{reason}"}}')


def outcome(router, name: str) -> float:
    return router.metric("paged_kv_router_handoffs_total", f'{{outcome="{name}"}}')


def idle(*engines, timeout: float = LEASE_S + 5) -> bool:
    """Whether, within `timeout` (bounded poll), every engine has no live block and no
    live lease (a decode engine exports no lease gauge: 0)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(e.metric("paged_kv_blocks", '{state="live"}') == 0 and _leases(e) == 0
               for e in engines):
            return True
        time.sleep(0.05)
    return False


def _leases(engine) -> float:
    text = httpx.get(f"{engine.url}/metrics", timeout=30).text
    if 'paged_kv_handoff_leases{state="live"}' not in text:
        return 0.0
    return engine.metric("paged_kv_handoff_leases", '{state="live"}')


def normalize(answer: dict) -> dict:
    """What must be equal: per choice its text, token ids, logprobs, finish reason; the
    token counts."""
    choices = sorted((c["index"], c.get("text", (c.get("message") or {}).get("content")),
                      c.get("token_ids"), c.get("logprobs"), c["finish_reason"])
                     for c in answer["choices"])
    return {"choices": choices, "usage": answer["usage"]}


def same(a, b, tolerance: float = 1e-4) -> bool:
    """Equal, but floats (log-probabilities) within `tolerance`; tokens and text exactly.

    The default is for a comparison with a cold one engine, which computes a prompt's last
    block inside one matmul over the whole prompt, the decode engine over that block alone:
    float sums in another order differ in their last bits (below 1e-5 in a
    log-probability with float pages; with 8-bit pages see the 200-request test)."""
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= tolerance
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k], tolerance) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y, tolerance) for x, y in zip(a, b, strict=True))
    return a == b


def from_stream(lines: list[str]) -> dict:
    """A stream's events folded into `normalize`'s shape."""
    text, ids, finish, usage = {}, {}, {}, None
    for line in lines:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        usage = event.get("usage") or usage
        for c in event.get("choices") or ():
            i = c["index"]
            text[i] = text.get(i, "") + (c.get("text") or (c.get("delta") or {}).get(
                "content") or "")
            ids[i] = ids.get(i, []) + (c.get("token_ids") or [])
            finish[i] = c.get("finish_reason") or finish.get(i)
    return {"choices": sorted((i, text[i], ids[i] or None, None, finish[i]) for i in text),
            "usage": usage}


async def fetch(client: httpx.AsyncClient, url: str, path: str, body: dict) -> dict:
    if body.get("stream"):
        async with client.stream("POST", url + path, json=body) as answer:
            assert answer.status_code == 200, await answer.aread()
            return from_stream([line async for line in answer.aiter_lines()])
    answer = await client.post(url + path, json=body)
    assert answer.status_code == 200, answer.text
    return normalize(answer.json())


async def send_all(url: str, requests: list[tuple[str, dict]], concurrency: int = 12,
                   primed: bool = False) -> list[dict]:
    """Every request's normalized answer, `concurrency` in flight; `primed`: each right
    after its prompt ran alone for one token, as the router's prefill runs it (the body
    the router sends a prefill replica, less the hand-off), so that it is served from a
    prefix hit and computes its last block only, as a decode engine does."""
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=120) as client:
        async def one(path: str, body: dict) -> dict:
            async with gate:
                if primed:
                    alone = {k: v for k, v in prefill_body(body).items()
                             if k != "kv_transfer_params"}
                    answer = await client.post(url + path, json=alone)
                    assert answer.status_code == 200, answer.text
                return await fetch(client, url, path, body)
        return await asyncio.gather(*(one(p, b) for p, b in requests))


def workload(count: int, seed: int) -> list[tuple[str, dict]]:
    """`count` requests of eight kinds in turn; prompts of 3 to 100 tokens, all distinct."""
    rng = random.Random(seed)
    requests = []
    for i in range(count):
        length = rng.choice((rng.randint(3, 15), rng.randint(17, 48), rng.randint(49, 100)))
        common = {"max_tokens": rng.randint(1, 8), "temperature": 0}
        sampled = {"temperature": 0.9, "top_p": 0.95, "seed": rng.randrange(2**31)}
        chat = {"messages": [{"role": "user", "content": " ".join(
            f"w{rng.randrange(10**4)}" for _ in range(length // 5 + 1))}], **common}
        prompt = {"prompt": tokens(length, seed * 10**6 + i), "return_token_ids": True,
                  **common}
        kind = i % 8
        body = [{**prompt, "logprobs": 2}, {**prompt, **sampled, "logprobs": 1},
                {**prompt, **sampled, "n": 2}, {**prompt, "stop": ["?"]},  # set later
                {**chat, "logprobs": True, "top_logprobs": 2}, {**chat, **sampled, "n": 2},
                {**prompt, "stream": True, "stream_options": {"include_usage": True}},
                {**chat, **sampled, "stream": True,
                 "stream_options": {"include_usage": True}}][kind]
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        requests.append((path, body))
    return requests


def with_stops(requests: list[tuple[str, dict]], both: str) -> None:
    """Give the stop-string requests a stop string their greedy output contains (from
    the one engine), so that some stop early."""
    for path, body in requests:
        if "stop" in body:
            body["max_tokens"] = 8
            text = post(both, {**body, "stop": None}, path).json()["choices"][0]["text"]
            body["stop"] = [text[3:5] or "?"] if len(text) > 4 else ["?"]


# -- byte-identical output ---------------------------------------------------------------------
@pytest.mark.parametrize("pages", ["float", "int8"])
def test_200_requests_through_the_router_equal_one_engine(stack, pages):
    """One request at a time on each side (the two sides at once), the one engine's after
    its prompt ran alone for one token (`send_all`'s ``primed``).

    The engine is not batch-invariant: its matmuls round a row by how many rows the step
    has (and how they split among threads), so the same requests batched otherwise differ
    in their logprobs' last bits, and now and then in a sampled token, on one engine alone
    (75 and 1 of these 200, measured). A cold one engine computes a prompt's last block
    inside a step of the whole prompt, the decode engine in a step of that block alone
    (the rest arrived as pages): their K/V differ in the last bits, and with 8-bit pages
    now and then by a whole code step where a value sat on a rounding boundary, which
    moves a log-probability by 2e-5 to 7e-3 (measured; issue 38: 1.06e-4 in request 64 on
    an Intel Xeon; here, one engine cold vs from a prefix hit, a code flipped in 9 of 300
    prompts one to three tokens past a block, moving one by up to 1.9e-4). Neither is the
    hand-off's to fix, and no tolerance that covers a code step would still tell 8-bit
    pages from float ones (they differ by 9e-3 to 5e-2). So the one engine computes what
    the decode engine computes: it serves each prompt from a prefix hit, and the two
    agree to the bit (tolerance 0), as `test_handoff_int8` also checks in one process."""
    suffix = "8" if pages == "int8" else ""
    router, pre, dec, both = (stack[n + suffix] for n in ("R", "P", "D", "B"))
    requests = workload(200, seed=3 if suffix else 2)
    with_stops(requests, both.url)
    handoffs = dec.metric("paged_kv_handoffs_total", '{role="decode"}')
    ok = outcome(router, "ok")

    async def both_ways() -> tuple[list[dict], list[dict]]:
        return await asyncio.gather(send_all(router.url, requests, 1),
                                    send_all(both.url, requests, 1, primed=True))
    routed, direct = asyncio.run(both_ways())
    peer = 0
    for (_, body), got, expected in zip(requests, routed, direct, strict=True):
        assert same(got["choices"], expected["choices"], tolerance=0.0), (body, got, expected)
        usage = got["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (
            expected["usage"]["prompt_tokens"], expected["usage"]["completion_tokens"])
        details = usage["prompt_tokens_details"]
        assert details["cached_tokens"] >= (usage["prompt_tokens"] - 1) // BLOCK * BLOCK, body
        peer += details.get("cached_tokens_by_source", {}).get("peer", 0) > 0
    stopped = [e for (_, b), e in zip(requests, direct, strict=True) if "stop" in b]
    assert any(c[4] == "stop" for e in stopped for c in e["choices"]), "no stop string hit"
    assert peer > 100  # most prompts are longer than a block
    assert dec.metric("paged_kv_handoffs_total", '{role="decode"}') == handoffs + peer
    assert outcome(router, "ok") == ok + len(requests)
    for reason in REASONS:
        assert fallbacks(dec, reason) == 0, reason
    assert idle(pre, dec)


def test_a_hybrid_model_through_the_router_equals_one_engine(tmp_path):
    """A Gemma 2 checkpoint (window and full layers): 24 mixed requests through router +
    prefill + decode equal one ``both`` engine, every prompt past a block handed over with
    its groups' starts, no fallback, both pools idle after."""
    from .test_handoff_hybrid import gemma2_checkpoint

    model = ("--model", str(gemma2_checkpoint(tmp_path / "ckpt")), "--block-size", "4",
             "--memory-mib", "2")
    rng = random.Random(26)
    requests = []
    for i in range(24):
        body = {"prompt": [rng.randrange(1, 96) for _ in range(rng.randint(6, 60))],
                "max_tokens": rng.randint(1, 8), "temperature": 0, "return_token_ids": True}
        body |= ({}, {"logprobs": 2}, {"temperature": 0.9, "seed": i, "n": 2},
                 {"stream": True, "stream_options": {"include_usage": True}})[i % 4]
        requests.append(("/v1/completions", body))
    with Processes(tmp_path) as procs:
        engines = procs.start(P=serve("prefill", *model), D=serve("decode", *model),
                              B=serve("both", *model))
        router = procs.start(R=route(engines["P"].url, engines["D"].url))["R"]

        async def both_ways() -> tuple[list[dict], list[dict]]:
            return await asyncio.gather(send_all(router.url, requests, 1),
                                        send_all(engines["B"].url, requests, 1))
        routed, direct = asyncio.run(both_ways())
        for (_, body), got, expected in zip(requests, routed, direct, strict=True):
            assert same(got["choices"], expected["choices"]), (body, got, expected)
        loaded = engines["D"].metric("paged_kv_handoffs_total", '{role="decode"}')
        assert loaded == sum(len(b["prompt"]) > 4 for _, b in requests)
        for reason in REASONS:
            assert fallbacks(engines["D"], reason) == 0, reason
        assert idle(engines["P"], engines["D"], timeout=35)


# -- faults ------------------------------------------------------------------------------------
def greedy(length: int, seed: int) -> dict:
    return {"prompt": tokens(length, seed), "max_tokens": 8, "temperature": 0,
            "return_token_ids": True}


def token_ids(answer: httpx.Response) -> list[int]:
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["token_ids"]


def failed_for(answer: httpx.Response, reason: str) -> bool:
    """A clean failure: 502, the reason in the error's message."""
    return answer.status_code == 502 and reason in answer.json()["error"]["message"]


def test_prefill_engine_killed_between_the_phases(stack, tmp_path):
    """The phases driven by hand with the router's bodies; the prefill engine is killed
    once its parameters are out: decode recomputes (or fails), counting engine_gone."""
    dec, fail, both = stack["D"], stack["F"], stack["B"]
    data = greedy(70, 101)
    with Processes(tmp_path) as procs:
        doomed = procs.start(PK=serve("prefill"))["PK"]  # a 30 s lease: it is the engine
        answer = post(doomed.url, prefill_body(data))
        params = answer.json()["kv_transfer_params"]
        assert len(params["block_keys"]) == 4
        doomed.kill()
    before = fallbacks(dec, "engine_gone"), fallbacks(fail, "engine_gone")
    assert token_ids(post(dec.url, decode_body(data, params))) == token_ids(post(both.url,
                                                                                 data))
    assert failed_for(post(fail.url, decode_body(data, params)), "engine_gone")
    assert (fallbacks(dec, "engine_gone"), fallbacks(fail, "engine_gone")) == (
        before[0] + 1, before[1] + 1)
    assert idle(dec, fail)


def test_decode_engine_killed_during_the_transfer(stack, tmp_path):
    """The decode engine dies while its pull waits (held by a proxy): the client gets an
    error from the router, and the prefill engine drops the lease when it expires."""
    pre, proxy = stack["P"], stack["proxy"]
    expired = pre.metric("paged_kv_handoff_leases_expired_total")
    with Processes(tmp_path) as procs, peer_proxy(proxy, stack["engine"], "hold") as peer:
        doomed = procs.start(DK=serve("decode"))["DK"]
        router = procs.start(RK=route(proxy.url, doomed.url))["RK"]

        async def kill_mid_transfer() -> httpx.Response:
            async with httpx.AsyncClient(timeout=60) as client:
                call = asyncio.create_task(client.post(f"{router.url}/v1/completions",
                                                       json=greedy(60, 102)))
                for _ in range(600):  # until the pull reached the proxy (bounded)
                    if peer.gets.is_set() or call.done():
                        break
                    await asyncio.sleep(0.05)
                assert peer.gets.is_set(), "the decode engine never pulled"
                doomed.kill()
                return await call
        answer = asyncio.run(kill_mid_transfer())
        assert answer.status_code >= 500 and answer.json()["error"]["message"]
    assert idle(pre)  # its lease expired (nobody released it)
    assert pre.metric("paged_kv_handoff_leases_expired_total") == expired + 1


def test_a_transfer_slowed_past_the_lease(stack):
    """A proxy holds each pull longer than the lease: lease_expired, recomputed on D,
    a 502 on F; the lease released (or expired) on the prefill engine."""
    pre, dec, fail, both = stack["P"], stack["D"], stack["F"], stack["B"]
    before = fallbacks(dec, "lease_expired"), fallbacks(fail, "lease_expired")
    with peer_proxy(stack["proxy"], stack["engine"], "delay", LEASE_S + 1) as peer:
        data = greedy(55, 103)
        assert token_ids(post(stack["RX"].url, data)) == token_ids(post(both.url, data))
        assert failed_for(post(stack["RF"].url, greedy(55, 104)), "lease_expired")
        assert b"get" in peer.verbs
    assert (fallbacks(dec, "lease_expired"), fallbacks(fail, "lease_expired")) == (
        before[0] + 1, before[1] + 1)
    assert idle(pre, dec, fail)


def test_parameters_stripped_by_a_proxy(stack):
    """A proxy drops kv_transfer_params: the router counts prefill_no_params, D counts
    missing_params and recomputes, F fails with a 502; the unclaimed lease expires."""
    pre, dec, fail, both = stack["P"], stack["D"], stack["F"], stack["B"]
    before = fallbacks(dec, "missing_params"), fallbacks(fail, "missing_params")
    stack["proxy"].mode = "strip"
    try:
        data = greedy(40, 105)
        assert token_ids(post(stack["RX"].url, data)) == token_ids(post(both.url, data))
        assert failed_for(post(stack["RF"].url, greedy(40, 106)), "missing_params")
        health = httpx.get(f"{stack['RF'].url}/health", timeout=30).json()
        assert health["decode_up"] == 1, "a failed hand-off is no failed replica"
    finally:
        stack["proxy"].mode = "pass"
    assert outcome(stack["RX"], "prefill_no_params") == 1
    assert (fallbacks(dec, "missing_params"), fallbacks(fail, "missing_params")) == (
        before[0] + 1, before[1] + 1)
    assert idle(pre, dec, fail)


def test_a_tampered_page_through_the_router(stack):
    """A proxy flips a byte of the second page: D loads the first block only, counts
    verify_failed, and computes the rest; the lease is released."""
    pre, dec, both = stack["P"], stack["D"], stack["B"]
    before = fallbacks(dec, "verify_failed")
    data = greedy(70, 107)
    with peer_proxy(stack["proxy"], stack["engine"], "tamper"):
        answer = post(stack["RX"].url, data)
    assert token_ids(answer) == token_ids(post(both.url, data))
    sources = answer.json()["usage"]["prompt_tokens_details"]["cached_tokens_by_source"]
    assert sources.get("peer") == BLOCK
    assert fallbacks(dec, "verify_failed") == before + 1
    assert idle(pre, dec)


# -- random aborts -----------------------------------------------------------------------------
async def leave_at_random(client: httpx.AsyncClient, url: str, body: dict, how: str,
                          when: float) -> str:
    """One request that the client leaves (``left``) after `when` seconds (``timeout``)
    or `when` SSE events (``read``), or reads to its end (``done``)."""
    async def whole() -> None:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as answer:
            assert answer.status_code == 200, await answer.aread()
            events = 0
            async for line in answer.aiter_lines():
                events += line.startswith("data: ")
                if how == "read" and events >= when:
                    return "left"  # leaving the block closes the connection
        return "done"
    if how != "timeout":
        return await whole()
    try:
        return await asyncio.wait_for(whole(), when)
    except asyncio.TimeoutError:
        return "left"


def test_500_random_aborts_leave_both_pools_idle(stack):
    """Clients leave before the prefill ends, between the phases, during the transfer
    (half the pulls slowed by 50 ms) and during the decode; afterwards both pools hold
    no live block and the prefill engine no lease within a lease, and a request works."""
    pre, dec, both = stack["P"], stack["D"], stack["B"]
    rng = random.Random(500)
    plan = []
    for i in range(500):
        how = ("timeout", "timeout", "read", "done")[i % 4]
        when = rng.uniform(0, 0.6) if how == "timeout" else rng.randint(1, 6)
        body = {"prompt": tokens(rng.randint(3, 120), 7 * 10**6 + i),
                "stream": how == "read" or i % 3 > 0, "max_tokens": rng.randint(1, 32),
                "ignore_eos": True, "temperature": 0}
        plan.append((stack["RX" if i % 2 else "R"].url, body, how, when))

    async def run_all() -> list[str]:
        gate = asyncio.Semaphore(16)
        async with httpx.AsyncClient(timeout=60) as client:
            async def one(*args) -> str:
                async with gate:
                    return await leave_at_random(client, *args)
            return await asyncio.gather(*(one(*p) for p in plan))
    with peer_proxy(stack["proxy"], stack["engine"], "delay", 0.05):
        results = asyncio.run(run_all())
        assert results.count("left") > 100 and results.count("done") > 100, results
        assert idle(pre, dec, timeout=LEASE_S + 3), (
            pre.metric("paged_kv_handoff_leases", '{state="live"}'),
            pre.metric("paged_kv_blocks", '{state="live"}'),
            dec.metric("paged_kv_blocks", '{state="live"}'))
    assert dec.metric("paged_kv_running_requests") == 0
    data = greedy(50, 108)
    assert token_ids(post(stack["R"].url, data)) == token_ids(post(both.url, data))
