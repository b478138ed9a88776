"""``paged-kv route --prefill ... --decode ...`` against stub replicas that record what they
get: the prefill replica one unstreamed token marked ``do_remote_decode``, the decode replica
the client's body with the prefill's parameters; failures, refusals and clients that leave.
Everything runs in-process, in one event loop (see `stubs`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from paged_kv.bench.netdelay import free_port
from paged_kv.cli import main
from paged_kv.handoff.trust import HEADER, HandoffTrust
from paged_kv.router import PrefixIndex
from paged_kv.router.app import create_router_app
from paged_kv.router.disagg import DisaggRouter, decode_body, prefill_body
from paged_kv.router.replicas import ReplicaSet
from paged_kv.server.http.tokenizer import ByteTokenizer

from .stubs import BOUND_S, serving

AUTH = {"Authorization": "Bearer key-one"}
SECRET = "router-secret"


def _params(name: str) -> dict:
    """What a prefill replica named `name` answers as its hand-off parameters."""
    return {"remote_engine": f"tcp://127.0.0.1:5{len(name)}00", "lease": f"lease-{name}",
            "block_keys": ["aa" * 32], "first_token": 42, "num_prompt_tokens": 5,
            "lease_seconds": 30.0}


class Stub:
    """A replica that records each request (body, headers) and answers by `mode`:

    - ``prefill``: a completion with `_params` (its name) as ``kv_transfer_params``;
    - ``both``: a completion without them (a replica not serving ``--role prefill``);
    - ``unavailable``: `status` (503 unless told); ``refuse``: 400 (the client's request at
      fault);
    - ``hold``: waits for the caller to leave, noting when in `left_at`;
    - ``decode``: the JSON ``{"decoded_by": name}``, or with ``stream: true`` three SSE
      events, the last once `release` is set (noting in `left_at` a caller that leaves).
    """

    def __init__(self, name: str, mode: str, status: int = 503) -> None:
        self.name, self.mode, self.status = name, mode, status
        self.bodies: list[dict] = []
        self.raw: list[bytes] = []
        self.headers: list[dict] = []
        self.release = asyncio.Event()
        self.left_at: float | None = None
        self.app = Starlette(routes=[Route("/health", self._health),
                                     Route("/v1/completions", self._answer, methods=["POST"]),
                                     Route("/v1/chat/completions", self._answer,
                                           methods=["POST"])])

    async def _health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def _answer(self, request: Request) -> Response:
        raw = await request.body()
        body = json.loads(raw)
        self.bodies.append(body)
        self.raw.append(raw)
        self.headers.append(dict(request.headers))
        if self.mode == "unavailable":
            return JSONResponse({"error": {"message": "draining"}}, status_code=self.status)
        if self.mode == "refuse":
            return JSONResponse({"error": {"message": "prompt: too long", "param": "prompt"}},
                                status_code=400)
        if self.mode == "hold":
            return await self._hold(request)
        if self.mode == "decode":
            if body.get("stream"):
                return StreamingResponse(self._stream(request), media_type="text/event-stream")
            return JSONResponse({"decoded_by": self.name})
        answer = {"object": "text_completion", "choices": [{"text": "x"}]}
        if self.mode == "prefill":
            answer["kv_transfer_params"] = _params(self.name)
        return JSONResponse(answer)

    async def _hold(self, request: Request) -> Response:
        async def gone() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            self.left_at = time.monotonic()

        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(gone(), BOUND_S)
        return JSONResponse({})

    async def _stream(self, request: Request) -> AsyncIterator[bytes]:
        try:
            yield f'data: {{"decoded_by": "{self.name}", "i": 0}}\n\n'.encode()
            yield b'data: {"i": 1}\n\n'
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.release.wait(), BOUND_S)
            yield b"data: [DONE]\n\n"
        except asyncio.CancelledError:  # starlette cancels the stream when the caller leaves
            self.left_at = time.monotonic()
            raise


@contextlib.asynccontextmanager
async def cluster(prefill: list[Stub], decode: list[Stub], *, dead_prefill: int = 0,
                  first_prefill: str | None = None,
                  ) -> AsyncIterator[tuple[str, DisaggRouter]]:
    """The stubs served, `dead_prefill` prefill URLs where nothing listens (and
    `first_prefill`, a URL served elsewhere, first), and a `DisaggRouter` over them: yields
    its URL and the router."""
    async with contextlib.AsyncExitStack() as stack:
        prefill_urls = [first_prefill] if first_prefill else []
        prefill_urls += [await stack.enter_async_context(serving(s.app)) for s in prefill]
        prefill_urls += [_dead_url() for _ in range(dead_prefill)]
        decode_urls = [await stack.enter_async_context(serving(s.app)) for s in decode]
        router = DisaggRouter(
            ReplicaSet(prefill_urls, PrefixIndex(), lambda *a: router.on_batch(*a),
                       interval=0.2),
            ReplicaSet(decode_urls, PrefixIndex(), lambda *a: None, interval=0.2,
                       subscribe=False),
            ByteTokenizer(), secret=SECRET)
        yield await stack.enter_async_context(serving(create_router_app(router))), router


def _dead_url() -> str:
    with socket.socket() as sock:  # a port just free: nothing listens there
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def _client() -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=BOUND_S)


def _handoffs(router: DisaggRouter, outcome: str) -> float:
    return router.registry.get_sample_value("paged_kv_router_handoffs_total",
                                            {"outcome": outcome})


def _body(**extra) -> dict:
    return {"model": "stub", "prompt": "hello there", "max_tokens": 8, "temperature": 0.0,
            **extra}


async def _until(condition, what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not reached in {timeout} s: {what}"
        await asyncio.sleep(0.02)


# -- the two calls -------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_prefill_gets_one_token_marked_for_decode_and_decode_gets_the_body_and_params(path):
    prefill, decode = Stub("p", "prefill"), Stub("d", "decode")
    sent = _body() if path == "/v1/completions" else {
        "model": "stub", "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 8, "logprobs": True}

    async def main_() -> None:
        async with cluster([prefill], [decode]) as (url, router), _client() as client:
            answer = await client.post(url + path, json=sent, headers=AUTH)
            assert answer.status_code == 200, answer.text
            assert answer.json() == {"decoded_by": "d"}
            assert _handoffs(router, "ok") == 1
            for phase in ("prefill", "decode_first_byte"):
                assert router.registry.get_sample_value(
                    "paged_kv_router_handoff_phase_seconds_count", {"phase": phase}) == 1

    asyncio.run(main_())
    [to_prefill], [to_decode] = prefill.bodies, decode.bodies
    assert to_prefill["max_tokens"] == 1 and to_prefill["stream"] is False
    assert to_prefill["kv_transfer_params"] == {"do_remote_decode": True}
    assert "max_completion_tokens" not in to_prefill  # it would outrank max_tokens 1
    assert {k: v for k, v in to_prefill.items()
            if k not in ("max_tokens", "stream", "kv_transfer_params")} == \
        {k: v for k, v in sent.items() if k not in ("max_tokens", "max_completion_tokens")}
    assert prefill.headers[0]["authorization"] == AUTH["Authorization"]
    assert to_decode == {**sent, "kv_transfer_params": {**_params("p"),
                                                        "do_remote_prefill": True}}
    assert decode.headers[0]["authorization"] == AUTH["Authorization"]


def test_the_decode_replicas_stream_reaches_the_client_unchanged():
    prefill, decode = Stub("p", "prefill"), Stub("d", "decode")
    decode.release.set()

    async def main_() -> bytes:
        sent = _body(stream=True, stream_options={"include_usage": True})
        async with cluster([prefill], [decode]) as (url, _), _client() as client, \
                client.stream("POST", f"{url}/v1/completions", headers=AUTH,
                              json=sent) as answer:
            assert answer.status_code == 200
            assert answer.headers["content-type"].startswith("text/event-stream")
            return b"".join([chunk async for chunk in answer.aiter_raw()])

    streamed = asyncio.run(main_())
    assert streamed == (b'data: {"decoded_by": "d", "i": 0}\n\n'
                        b'data: {"i": 1}\n\ndata: [DONE]\n\n')
    assert "stream_options" not in prefill.bodies[0]  # refused without a stream
    assert decode.bodies[0]["stream"] is True
    assert decode.bodies[0]["stream_options"] == {"include_usage": True}


def test_each_request_goes_to_the_least_loaded_decode_replica():
    """Two streams held open: the second goes to the idle decode replica."""
    decode = [Stub("d0", "decode"), Stub("d1", "decode")]

    async def main_() -> None:
        async with cluster([Stub("p", "prefill")], decode) as (url, router), \
                _client() as client, contextlib.AsyncExitStack() as streams:
            chunks = []  # (kept: a dropped iterator closes its stream)
            for _ in range(2):
                answer = await streams.enter_async_context(client.stream(
                    "POST", f"{url}/v1/completions", json=_body(stream=True)))
                chunks.append(answer.aiter_raw())
                await anext(chunks[-1])
            assert [len(d.bodies) for d in decode] == [1, 1]
            assert [r.in_flight for r in router.decode.replicas] == [1, 1]
            for stub in decode:
                stub.release.set()

    asyncio.run(main_())


# -- failures --------------------------------------------------------------------------------
@pytest.mark.parametrize("status", [503, 500, 429])
def test_a_prefill_replica_answering_5xx_or_429_is_replaced_by_the_other_once(status):
    """A fresh router's first choice among equal replicas is the first given: the failing
    one. Only 502-504 take it out of routing (as `Router` does); 500 and 429 do not."""
    bad, good = Stub("bad", "unavailable", status), Stub("good", "prefill")
    decode = Stub("d", "decode")

    async def main_() -> None:
        async with cluster([bad, good], [decode]) as (url, router), _client() as client:
            answer = await client.post(f"{url}/v1/completions", json=_body())
            assert answer.status_code == 200, answer.text
            assert _handoffs(router, "ok") == 1
            assert router.registry.get_sample_value("paged_kv_router_retries_total",
                                                    {"reason": str(status)}) == 1
            assert router.replicas.replicas[0].up is (status != 503)

    asyncio.run(main_())
    assert (len(bad.bodies), len(good.bodies)) == (1, 1)
    assert decode.bodies[0]["kv_transfer_params"]["lease"] == "lease-good"


def test_a_prefill_replica_gone_since_its_last_probe_is_replaced_by_the_other():
    """The first prefill replica stops after the router saw it up: the connection is
    refused, it is marked down, and the other one prefills."""
    gone, good, decode = Stub("gone", "prefill"), Stub("good", "prefill"), Stub("d", "decode")

    async def main_() -> None:
        async with contextlib.AsyncExitStack() as first:
            gone_url = await first.enter_async_context(serving(gone.app))
            async with cluster([good], [decode], first_prefill=gone_url) as (url, router), \
                    _client() as client:
                assert len(router.replicas.up()) == 2
                await first.aclose()  # stopped before the probes notice
                answer = await client.post(f"{url}/v1/completions", json=_body())
                assert answer.status_code == 200, answer.text
                assert _handoffs(router, "ok") == 1
                assert router.registry.get_sample_value(
                    "paged_kv_router_retries_total", {"reason": "connection"}) == 1
                assert gone_url not in [r.url for r in router.replicas.up()], "marked down"

    asyncio.run(main_())
    assert gone.bodies == [] and len(good.bodies) == 1
    assert decode.bodies[0]["kv_transfer_params"]["lease"] == "lease-good"


def test_with_every_prefill_replica_failing_the_decode_replica_gets_no_parameters():
    """Two 503s: the decode replica prefills itself (it counts missing_params), and a
    client's own kv_transfer_params never reach it: the field is the router's."""
    prefill = [Stub("a", "unavailable"), Stub("b", "unavailable"), Stub("c", "unavailable")]
    decode = Stub("d", "decode")
    sent = _body(kv_transfer_params={"do_remote_prefill": True, "remote_engine": "tcp://x:1"})

    async def main_() -> None:
        async with cluster(prefill, [decode]) as (url, router), _client() as client:
            answer = await client.post(f"{url}/v1/completions", json=sent)
            assert answer.status_code == 200 and answer.json() == {"decoded_by": "d"}
            assert _handoffs(router, "prefill_failed") == 1
            assert _handoffs(router, "ok") == 0

    asyncio.run(main_())
    assert sorted(len(p.bodies) for p in prefill) == [0, 1, 1], "one retry, not more"
    assert decode.bodies == [_body()]


def test_with_no_prefill_replica_up_the_decode_replica_gets_no_parameters():
    decode = Stub("d", "decode")

    async def main_() -> None:
        async with cluster([], [decode], dead_prefill=2) as (url, router), \
                _client() as client:
            answer = await client.post(f"{url}/v1/completions", json=_body())
            assert answer.status_code == 200
            assert _handoffs(router, "no_prefill") == 1
            health = (await client.get(f"{url}/health")).json()
            assert (health["prefill_up"], health["decode_up"]) == (0, 1)

    asyncio.run(main_())
    assert decode.bodies == [_body()]


def test_a_prefill_answer_without_parameters_is_counted_and_decoded_without_them():
    decode = Stub("d", "decode")

    async def main_() -> None:
        async with cluster([Stub("both", "both")], [decode]) as (url, router), \
                _client() as client:
            assert (await client.post(f"{url}/v1/completions", json=_body())).status_code \
                == 200
            assert _handoffs(router, "prefill_no_params") == 1

    asyncio.run(main_())
    assert "kv_transfer_params" not in decode.bodies[0]


def test_a_4xx_from_the_prefill_replica_is_the_clients_answer():
    prefill, decode = Stub("p", "refuse"), Stub("d", "decode")

    async def main_() -> None:
        async with cluster([prefill], [decode]) as (url, router), _client() as client:
            answer = await client.post(f"{url}/v1/completions", json=_body())
            assert answer.status_code == 400
            assert answer.json()["error"] == {"message": "prompt: too long",
                                              "param": "prompt"}
            assert _handoffs(router, "prefill_refused") == 1
            assert router.replicas.up() == router.replicas.replicas, "refusal is not down"

    asyncio.run(main_())
    assert len(prefill.bodies) == 1 and decode.bodies == []


def test_without_a_decode_replica_up_the_router_is_unhealthy_and_answers_503():
    async def main_() -> None:
        async with cluster([Stub("p", "prefill")], []) as (url, router), _client() as client:
            health = await client.get(f"{url}/health")
            assert health.status_code == 503
            assert "no decode replica" in health.json()["error"]["message"]
            answer = await client.post(f"{url}/v1/completions", json=_body())
            assert answer.status_code == 503
            assert _handoffs(router, "decode_failed") == 1

    asyncio.run(main_())


# -- clients that leave ----------------------------------------------------------------------
def test_a_client_that_leaves_mid_stream_cancels_the_decode_call():
    prefill, decode = Stub("p", "prefill"), Stub("d", "decode")

    async def main_() -> None:
        async with cluster([prefill], [decode]) as (url, router):
            async with _client() as client, client.stream(
                    "POST", f"{url}/v1/completions", json=_body(stream=True)) as answer:
                first = await anext(answer.aiter_raw())
                assert first.startswith(b'data: {"decoded_by": "d"')
            gone = time.monotonic()  # the client's connection is closed
            await _until(lambda: decode.left_at is not None,
                         "the decode replica saw the router leave")
            assert decode.left_at - gone < 10
            await _until(lambda: router.decode.replicas[0].in_flight == 0, "in flight 0")

    asyncio.run(main_())


def test_a_client_that_leaves_during_the_prefill_cancels_it_and_never_reaches_decode():
    prefill, decode = Stub("p", "hold"), Stub("d", "decode")

    async def main_() -> None:
        async with cluster([prefill], [decode]) as (url, router):
            async with _client() as client:
                with pytest.raises(httpx.ReadTimeout):
                    await client.post(f"{url}/v1/completions", json=_body(),
                                      timeout=httpx.Timeout(BOUND_S, read=0.5))
            await _until(lambda: prefill.left_at is not None,
                         "the prefill replica saw the router leave")
            await _until(lambda: _handoffs(router, "client_gone") == 1, "counted")
            assert router.replicas.replicas[0].in_flight == 0

    asyncio.run(main_())
    assert decode.bodies == []


# -- the bodies ------------------------------------------------------------------------------
def test_the_router_owns_kv_transfer_params_in_both_bodies():
    sent = _body(stream=True, kv_transfer_params={"lease": "forged"})
    assert prefill_body(sent)["kv_transfer_params"] == {"do_remote_decode": True}
    assert "kv_transfer_params" not in decode_body(sent, None)
    assert decode_body(sent, {"lease": "x"})["kv_transfer_params"] == {
        "lease": "x", "do_remote_prefill": True}
    assert sent["kv_transfer_params"] == {"lease": "forged"}, "the client's body untouched"


# -- flags -------------------------------------------------------------------------------------
@pytest.mark.parametrize(("argv", "named"), [
    (["--prefill", "http://127.0.0.1:1"], "argument --decode: needed with --prefill"),
    (["--decode", "http://127.0.0.1:1"], "argument --prefill: needed with --decode"),
    (["--replica", "http://127.0.0.1:1", "--prefill", "http://127.0.0.1:2",
      "--decode", "http://127.0.0.1:3"], "argument --prefill: not allowed with --replica"),
    (["--replica", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:3"],
     "argument --decode: not allowed with --replica"),
    ([], "argument --replica: a replica is needed"),
    (["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:1"],
     "argument --prefill: the replica http://127.0.0.1:1 given twice"),
    (["--replica", "http://127.0.0.1:1", "--replica", "http://127.0.0.1:1"],
     "argument --replica: the replica http://127.0.0.1:1 given twice"),
    (["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2",
      "--handoff-secret", ""], "argument --handoff-secret: needed with --prefill"),
    (["--prefill", "nonsense", "--decode", "http://127.0.0.1:1"], "argument --prefill"),
])
def test_replica_flags_that_do_not_fit_together_exit_2_naming_the_flag(argv, named, capsys):
    try:
        code = main(["route", *argv])
    except SystemExit as exc:  # argparse's own refusals (a bad URL)
        code = exc.code
    assert code == 2
    assert named in capsys.readouterr().err


# -- the command -------------------------------------------------------------------------------
def test_paged_kv_route_with_prefill_and_decode_flags_hands_requests_over(tmp_path):
    """The command line's wiring: a ``paged-kv route`` process over the stubs, stopped by
    SIGTERM (exit 0)."""
    prefill, decode = Stub("p", "prefill"), Stub("d", "decode")
    port = free_port()

    async def main_() -> int:
        async with serving(prefill.app) as p_url, serving(decode.app) as d_url, \
                _client() as client:
            with open(tmp_path / "route.log", "wb") as log:
                process = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "paged_kv.cli", "route", "--port", str(port),
                    "--prefill", p_url, "--decode", d_url, "--probe-interval", "0.2",
                    "--handoff-secret", SECRET,
                    stdout=log, stderr=subprocess.STDOUT)
            try:
                url = f"http://127.0.0.1:{port}"
                deadline = time.monotonic() + BOUND_S
                while not await _healthy(client, url):
                    assert process.returncode is None, (tmp_path / "route.log").read_text()
                    assert time.monotonic() < deadline, "the router did not start"
                    await asyncio.sleep(0.1)
                answer = await client.post(f"{url}/v1/completions", json=_body())
                assert answer.json() == {"decoded_by": "d"}
                metrics = (await client.get(f"{url}/metrics")).text
                assert 'paged_kv_router_handoffs_total{outcome="ok"} 1.0' in metrics
            finally:
                if process.returncode is None:
                    process.send_signal(signal.SIGTERM)
                code = await asyncio.wait_for(process.wait(), BOUND_S)
        return code

    assert asyncio.run(main_()) == 0, (tmp_path / "route.log").read_text()
    assert decode.bodies[0]["kv_transfer_params"]["do_remote_prefill"] is True


async def _healthy(client: httpx.AsyncClient, url: str) -> bool:
    try:
        return (await client.get(f"{url}/health")).status_code == 200
    except httpx.HTTPError:
        return False


def test_the_router_signs_every_body_it_sends_and_replaces_a_clients_signature():
    """Both calls carry the router's signature of their exact bytes (the engines take a
    hand-off from no one else); a client's own header never reaches them."""
    prefill, decode = Stub("p", "prefill"), Stub("d", "decode")
    trust = HandoffTrust(SECRET)

    async def main_() -> None:
        async with cluster([prefill], [decode]) as (url, _), _client() as client:
            forged = {**AUTH, HEADER: trust.router_header(b"{}")}
            answer = await client.post(url + "/v1/completions", json=_body(), headers=forged)
            assert answer.status_code == 200, answer.text

    asyncio.run(main_())
    for stub in (prefill, decode):
        [raw], [headers] = stub.raw, stub.headers
        assert trust.router_error(headers.get(HEADER), raw) is None
        assert headers[HEADER] != trust.router_header(b"{}")
        assert HandoffTrust("another").router_error(headers[HEADER], raw) is not None
