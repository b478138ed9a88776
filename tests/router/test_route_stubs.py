"""The router against stub replicas that misbehave as real ones (and hostile clients) do:
many open streams, clients that leave, replicas that are busy, die after their headers or
announce nonsense at ``/kv_events``. Everything runs in-process, in one event loop."""

from __future__ import annotations

import asyncio
import logging
import re
import time

import httpx
import pytest

from paged_kv.router.replicas import EventsInfo

from .stubs import BOUND_S, StubReplica, completion, stub_cluster

STREAMS = 130  # more than httpx's default pool of 100 connections


def _client(**kwargs) -> httpx.AsyncClient:
    return httpx.AsyncClient(limits=httpx.Limits(max_connections=None), **kwargs)


async def _until(condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not reached in {timeout} s: {what}"
        await asyncio.sleep(0.02)


# -- bug 4: at most 100 requests in flight ---------------------------------------------------
def test_more_than_a_hundred_streams_are_open_through_the_router_at_once():
    """Two replicas hold every stream open after its first event: all of them must have
    started together (the router's pool used to stop at 100, and request 101 waited
    without end)."""
    replicas = [StubReplica(f"r{i}", "stream") for i in range(2)]
    started: list[int] = []

    async def stream(client: httpx.AsyncClient, url: str, i: int) -> bytes:
        async with client.stream("POST", f"{url}/v1/completions",
                                 json=completion(f"prompt {i}", stream=True)) as response:
            assert response.status_code == 200
            chunks = response.aiter_raw()
            first = await anext(chunks)
            started.append(i)
            return first + b"".join([chunk async for chunk in chunks])

    async def main() -> None:
        async with stub_cluster(*replicas) as (url, router), _client(timeout=BOUND_S) as client:
            tasks = [asyncio.create_task(stream(client, url, i)) for i in range(STREAMS)]
            try:
                await _until(lambda: len(started) == STREAMS,
                             f"{STREAMS} streams open (got {len(started)})")
                assert sum(r.in_flight for r in router.replicas.replicas) == STREAMS
            finally:
                for replica in replicas:
                    replica.release.set()
                answers = await asyncio.gather(*tasks, return_exceptions=True)
            assert all(isinstance(a, bytes) and a.endswith(b"[DONE]\n\n") for a in answers)
            assert sum(r.requests for r in replicas) == STREAMS

    asyncio.run(main())


def test_a_router_with_a_connection_cap_answers_503_once_it_waited_for_one():
    """With ``--max-connections 1`` and one stream open, the next request waits the pool
    timeout and gets a 503 with Retry-After; the replica is not taken for down."""
    replica = StubReplica("r", "stream")

    async def main() -> None:
        async with (stub_cluster(replica, max_connections=1, pool_timeout=0.3) as (url, router),
                    _client(timeout=BOUND_S) as client):
            async with client.stream("POST", f"{url}/v1/completions",
                                     json=completion(stream=True)) as first:
                chunks = first.aiter_raw()  # (kept: a dropped iterator closes the stream)
                await anext(chunks)
                waited = time.monotonic()
                second = await client.post(f"{url}/v1/completions", json=completion())
                waited = time.monotonic() - waited
                replica.release.set()
            assert second.status_code == 503 and second.headers["retry-after"] == "1"
            assert "--max-connections" in second.json()["error"]["message"]
            assert 0.3 <= waited < BOUND_S
            assert router.replicas.up() == router.replicas.replicas

    asyncio.run(main())


# -- bug 5: a client that leaves before the first byte --------------------------------------
def test_a_client_that_leaves_before_the_first_byte_cancels_the_replicas_request():
    """The replica has not answered yet when the client gives up: the router must close
    its request to the replica (which aborts the work), not wait for the answer."""
    replica = StubReplica("r", "hold")

    async def main() -> None:
        async with stub_cluster(replica) as (url, router):
            async with _client(timeout=BOUND_S) as client:
                with pytest.raises(httpx.ReadTimeout):
                    await client.post(f"{url}/v1/completions", json=completion(),
                                      timeout=httpx.Timeout(BOUND_S, read=0.5))
            gone = time.monotonic()
            await _until(lambda: replica.left_at is not None,
                         "the replica saw its request cancelled", timeout=15)
            assert replica.left_at - gone < 10
            await _until(lambda: router.replicas.replicas[0].in_flight == 0, "in flight 0")

    asyncio.run(main())


# -- bug 13: every replica busy ---------------------------------------------------------------
def test_when_every_replica_is_busy_the_router_answers_429_with_their_retry_after():
    replicas = [StubReplica("a", "busy", retry_after="3"),
                StubReplica("b", "busy", retry_after="7")]

    async def main() -> None:
        async with stub_cluster(*replicas) as (url, router), _client(timeout=BOUND_S) as client:
            answer = await client.post(f"{url}/v1/completions", json=completion())
            assert answer.status_code == 429, answer.text
            assert answer.headers["retry-after"] == "7"
            assert "busy" in answer.json()["error"]["message"]
            # typed as the replicas type theirs (OpenAI's clients read a rate limit from it)
            assert (answer.json()["error"]["type"], answer.json()["error"]["code"]) == (
                "rate_limit_exceeded", "rate_limit_exceeded")
            assert [r.requests for r in replicas] == [1, 1]
            assert router.replicas.up() == router.replicas.replicas, "busy is not down"
            replicas[0].retry_after = "soon"  # nonsense: the router's own default
            replicas[1].mode = "unavailable"
            answer = await client.post(f"{url}/v1/completions", json=completion())
            assert answer.status_code == 429 and answer.headers["retry-after"] == "1"

    asyncio.run(main())


# -- planted fault: headers, then death --------------------------------------------------------
@pytest.mark.parametrize("mode", ["die", "unavailable"])
def test_a_replica_that_fails_before_its_first_body_byte_is_retried_on_another(mode):
    """The first replica sends its 200 headers and dies (or answers 503): the client must
    get the second replica's whole answer, not a broken 200."""
    replicas = [StubReplica("bad", mode), StubReplica("good", "stream")]
    replicas[1].release.set()

    async def main() -> None:
        async with stub_cluster(*replicas, policy="round_robin") as (url, router), \
                _client(timeout=BOUND_S) as client:
            for i in range(3):
                answer = await client.post(f"{url}/v1/completions",
                                           json=completion(f"q{i}", stream=True))
                assert answer.status_code == 200
                assert answer.text == 'data: {"replica": "good"}\n\ndata: [DONE]\n\n'
            assert replicas[0].requests >= 1
            retries = sum(router.registry.get_sample_value(
                "paged_kv_router_retries_total", {"reason": reason}) or 0
                for reason in ("connection", "503"))
            assert retries == replicas[0].requests, "each of its failures was retried"

    asyncio.run(main())


def test_a_replica_that_dies_midway_is_not_relayed_as_a_complete_answer():
    """Past the first byte the router cannot retry: the client must see the answer broken
    off (an incomplete chunked body), never a clean end it would take for the whole."""
    replica = StubReplica("r", "die_midway")

    async def main() -> None:
        async with stub_cluster(replica) as (url, router), _client(timeout=BOUND_S) as client:
            with pytest.raises(httpx.RemoteProtocolError):
                await client.post(f"{url}/v1/completions", json=completion(stream=True))
            await _until(lambda: router.replicas.replicas[0].in_flight == 0, "in flight 0")

    asyncio.run(main())


# -- bug 9: what replicas announce at /kv_events ---------------------------------------------
GOOD_EVENTS = {"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://0.0.0.0:5558",
               "block_size": 16, "num_blocks": 100}


def test_announced_events_are_checked_field_by_field():
    parsed = EventsInfo.parse(GOOD_EVENTS, "10.0.0.2")
    assert parsed == ("tcp://10.0.0.2:5557", "tcp://10.0.0.2:5558", 16, 100)
    for field, bad in [("block_size", "sixteen"), ("block_size", 0), ("block_size", True),
                       ("block_size", 16.0), ("block_size", None), ("num_blocks", -1),
                       ("num_blocks", "many"), ("endpoint", 5557), ("endpoint", "nonsense"),
                       ("replay_endpoint", "tcp://host"), ("hash", "md5(tokens)")]:
        with pytest.raises(ValueError, match=f"^{field}: .*{re.escape(repr(bad))}"):
            EventsInfo.parse({**GOOD_EVENTS, field: bad}, "10.0.0.2")


@pytest.mark.parametrize("block_size", ["sixteen", 0, -16])
def test_a_replica_announcing_a_bad_block_size_is_routed_without_events(block_size, caplog):
    """``"sixteen"`` stopped the router at start, 0 made every request a 500: the replica
    must be served, with the default block size, and a warning naming the field."""
    replica = StubReplica("r", events={**GOOD_EVENTS, "endpoint": "tcp://127.0.0.1:9",
                                       "block_size": block_size})

    async def main() -> None:
        async with stub_cluster(replica) as (url, router), _client(timeout=BOUND_S) as client:
            for i in range(3):
                answer = await client.post(f"{url}/v1/completions", json=completion(f"{i}" * 40))
                assert answer.status_code == 200, answer.text
            state = router.replicas.replicas[0]
            assert (state.up, state.block_size, state.subscriber) == (True, 16, None)

    with caplog.at_level(logging.WARNING, logger="paged_kv.router"):
        asyncio.run(main())
    assert any("block_size" in r.getMessage() and "without" in r.getMessage()
               for r in caplog.records), caplog.text


# -- bug 8: bodies the router must refuse itself ----------------------------------------------
def test_a_body_json_cannot_read_is_a_400_from_the_router():
    """A 5000-digit integer literal is valid JSON that ``json.loads`` refuses with a
    ValueError (not a JSONDecodeError): the router answers 400, the replica never sees it."""
    replica = StubReplica("r")

    async def main() -> None:
        async with stub_cluster(replica) as (url, _), _client(timeout=BOUND_S) as client:
            for body in (b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}",
                         b'{"prompt": "hi", "max_tokens": 4', b"[" * 100_000):
                answer = await client.post(f"{url}/v1/completions", content=body,
                                           headers={"content-type": "application/json"})
                assert answer.status_code == 400, answer.text
                error = answer.json()["error"]
                assert error["type"] == "invalid_request_error"
                assert error["message"].startswith("body: not valid JSON")
            assert replica.requests == 0

    asyncio.run(main())


def _refusing_tokenizer(path):
    """A character-level HF tokenizer whose chat template refuses a system message, as
    many real ones do (``raise_exception``: a jinja2 TemplateError)."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = {t: i for i, t in enumerate(["<unk>", *map(chr, range(32, 127)), "\n"])}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex("."),
                                                            behavior="isolated")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    fast.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                          "{{ raise_exception('System role not supported') }}{% endif %}"
                          "{{ m['content'] }}\n{% endfor %}")
    fast.save_pretrained(path)
    from paged_kv.server import HFTokenizer

    return HFTokenizer(path)


def test_a_chat_template_that_refuses_the_messages_is_a_400_naming_them(tmp_path):
    replica = StubReplica("r")
    tokenizer = _refusing_tokenizer(tmp_path)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]

    async def main() -> None:
        async with (stub_cluster(replica, tokenizer=tokenizer) as (url, _),
                    _client(timeout=BOUND_S) as client):
            answer = await client.post(f"{url}/v1/chat/completions",
                                       json={"model": "stub", "messages": messages})
            assert answer.status_code == 400, answer.text
            error = answer.json()["error"]
            assert (error["type"], error["param"]) == ("invalid_request_error", "messages")
            assert "System role not supported" in error["message"]
            assert replica.requests == 0
            answer = await client.post(f"{url}/v1/chat/completions",
                                       json={"model": "stub", "messages": messages[1:]})
            assert answer.status_code == 200 and replica.requests == 1

    asyncio.run(main())
