"""The router's proxy without processes: replicas of different block sizes, and the
in-flight count of an answer whose client leaves before it starts."""

from __future__ import annotations

import asyncio

import pytest
from starlette.requests import ClientDisconnect

from paged_kv.router import PrefixIndex, prompt_keys
from paged_kv.router.proxy import Router
from paged_kv.router.relay import RelayEnd, RelayResponse
from paged_kv.router.replicas import ReplicaSet
from paged_kv.server.http.tokenizer import ByteTokenizer


def make_router(sizes: dict[str, int]) -> Router:
    replicas = ReplicaSet(list(sizes), PrefixIndex(), lambda *a: None, subscribe=False)
    for replica in replicas.replicas:
        replica.up, replica.block_size, replica.capacity = True, sizes[replica.url], 1000
    return Router(replicas, ByteTokenizer())


def test_each_replica_is_matched_with_keys_of_its_own_block_size():
    """A replica indexing 16-token blocks holds the prompt; one of 4-token blocks holds
    nothing. The router must hash the prompt per block size: with the first replica's size
    only, the holder's blocks would never match."""
    router = make_router({"http://small": 4, "http://large": 16})
    tokens = list(range(100, 164))  # 64 tokens: 4 blocks of 16, 16 blocks of 4
    held = prompt_keys(tokens, 16, None)
    router.replicas.index.apply("http://large", [["BlockStored", held, None, [], 16, None,
                                                  "GPU"]])
    for _ in range(3):  # whatever the rotation
        replica, choice, keys = router.pick(tokens, None, set())
        assert (replica.url, choice.reason, choice.hit_blocks) == ("http://large", "cache", 4)
        assert keys == held
    router.replicas.index.apply("http://small", [["BlockStored", prompt_keys(tokens, 4, None),
                                                  None, [], 4, None, "GPU"]])
    router.replicas.index.apply("http://large", [["AllBlocksCleared"]])
    replica, choice, keys = router.pick(tokens, None, set())
    assert (replica.url, choice.hit_blocks, len(keys)) == ("http://small", 16, 16)


class _Upstream:
    closed = 0

    async def aclose(self) -> None:
        self.closed += 1


async def _chunks():
    yield b"rest"


def test_an_answer_never_started_still_leaves_the_in_flight_count():
    """The client is gone before the first byte is sent (its send raises): the relay's
    generator never starts, and the response itself must give the count back, once."""
    router = make_router({"http://a": 16})
    replica, upstream = router.replicas.replicas[0], _Upstream()
    replica.in_flight = 1
    response = RelayResponse(b"first", _chunks(), RelayEnd(replica, upstream), status_code=200)

    async def gone(message) -> None:
        raise OSError("client disconnected")

    async def receive():
        await asyncio.sleep(10)
        return {"type": "http.disconnect"}

    with pytest.raises(ClientDisconnect):
        asyncio.run(response({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, gone))
    assert (replica.in_flight, upstream.closed) == (0, 1)


def test_a_relayed_answer_gives_its_count_back_once():
    router = make_router({"http://a": 16})
    replica, upstream = router.replicas.replicas[0], _Upstream()
    replica.in_flight = 1
    response = RelayResponse(b"first", _chunks(), RelayEnd(replica, upstream), status_code=200)
    sent: list[bytes] = []

    async def send(message) -> None:
        sent.append(message.get("body", b""))

    async def receive():
        await asyncio.sleep(10)
        return {"type": "http.disconnect"}

    asyncio.run(response({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send))
    assert b"".join(sent) == b"firstrest"
    assert (replica.in_flight, upstream.closed) == (0, 1)
