"""The replicas behind the router: health, load, and where their KV events come from."""

from __future__ import annotations

import asyncio
import logging
import re
import urllib.parse
from collections.abc import Callable
from typing import NamedTuple

import httpx

from ..keys import HASH_SCHEME
from .index import PrefixIndex

logger = logging.getLogger("paged_kv.router")

DEFAULT_BLOCK_SIZE = 16  # a replica without events: `paged-kv serve`'s default
_ENDPOINT = re.compile(r"tcp://\S+:\d+|ipc://\S+")


class Replica:
    """One ``paged-kv serve`` (or any OpenAI-compatible server answering ``/health``)."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.in_flight = 0
        self.up = False
        self.failures = 0
        self.block_size = DEFAULT_BLOCK_SIZE
        self.capacity = 0  # its pool's blocks, from /kv_events (0: unknown)
        self.events: dict | None = None  # its /kv_events answer; None: none (yet)
        self.subscriber = None  # an EventSubscriber while up and publishing

    @property
    def host(self) -> str:
        return urllib.parse.urlsplit(self.url).hostname or "127.0.0.1"


def reachable_endpoint(endpoint: str, host: str) -> str:
    """A bound endpoint as another machine connects to it: a wildcard host (``*``,
    ``0.0.0.0``, ``::``) becomes the replica's own host."""
    scheme, _, rest = endpoint.partition("://")
    bound, _, port = rest.rpartition(":")
    if bound.strip("[]") in ("*", "0.0.0.0", "::", ""):
        bound = f"[{host}]" if ":" in host else host
    return f"{scheme}://{bound}:{port}"


class EventsInfo(NamedTuple):
    """What a replica's ``/kv_events`` announces, checked: where to subscribe (reachable
    from here), its block size and pool size."""

    endpoint: str
    replay_endpoint: str | None
    block_size: int
    num_blocks: int

    @classmethod
    def parse(cls, info: dict, host: str) -> EventsInfo:
        """Check a ``/kv_events`` answer of a replica on `host`.

        Raises
        ------
        ValueError
            Naming the field: a block size that is not a positive integer, a pool size
            that is not a non-negative one, an endpoint that is not a ZMQ ``tcp://`` /
            ``ipc://`` address, or keys hashed another way than this router hashes them.
        """
        block_size = info.get("block_size", DEFAULT_BLOCK_SIZE)
        num_blocks = info.get("num_blocks", 0)
        if type(block_size) is not int or block_size <= 0:
            raise ValueError(f"block_size: expected a positive integer, got {block_size!r}")
        if type(num_blocks) is not int or num_blocks < 0:
            raise ValueError(f"num_blocks: expected a non-negative integer, got "
                             f"{num_blocks!r}")
        if info.get("hash", HASH_SCHEME) != HASH_SCHEME:
            raise ValueError(f"hash: keys made as {info['hash']!r}, this router makes them "
                             f"as {HASH_SCHEME!r}")
        replay = info.get("replay_endpoint")
        return cls(_endpoint("endpoint", info["endpoint"], host),
                   None if replay is None else _endpoint("replay_endpoint", replay, host),
                   block_size, num_blocks)


def _endpoint(field: str, value: object, host: str) -> str:
    if not isinstance(value, str) or not _ENDPOINT.fullmatch(value):
        raise ValueError(f"{field}: expected tcp://HOST:PORT or ipc://PATH, got {value!r}")
    return reachable_endpoint(value, host) if value.startswith("tcp://") else value


def _subscriber(announced: EventsInfo, replica: Replica,
                on_batch: Callable[[Replica, float, list[list]], None], index: PrefixIndex):
    """An `EventSubscriber` feeding `on_batch` (ValueError: ZMQ refused the endpoint)."""
    import zmq

    from ..events.subscriber import EventSubscriber

    try:
        return EventSubscriber(
            announced.endpoint, replay_endpoint=announced.replay_endpoint,
            on_batch=lambda stamp, events: on_batch(replica, stamp, events),
            on_reset=lambda: index.clear(replica.url))
    except zmq.ZMQError as exc:
        raise ValueError(f"endpoint: {exc}") from None


class ReplicaSet:
    """Probes each replica's ``/health`` every `interval` s; a replica that fails twice in a
    row is down: its index entries are dropped and its events unsubscribed until it is
    back (then its history is replayed). ``on_batch(replica, timestamp, events)`` gets each
    batch of events, on the subscribers' threads.
    """

    def __init__(self, urls: list[str], index: PrefixIndex,
                 on_batch: Callable[[Replica, float, list[list]], None], *,
                 interval: float = 1.0, subscribe: bool = True) -> None:
        self.replicas = [Replica(url) for url in urls]
        self.index, self._on_batch = index, on_batch
        self.interval, self._subscribe = interval, subscribe
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(2.0))
        self._task: asyncio.Task | None = None

    def up(self) -> list[Replica]:
        """The replicas that answer now, in the order given."""
        return [r for r in self.replicas if r.up]

    async def start(self) -> None:
        """Probe everyone once, then keep probing in the background."""
        await self.refresh()
        self._task = asyncio.create_task(self._watch())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for replica in self.replicas:
            await self._unsubscribe(replica)
        await self._client.aclose()

    async def refresh(self) -> None:
        """One round of probes (and discoveries for replicas that came up); one replica's
        failure is logged and never stops the others' probes (or the router's start)."""
        outcomes = await asyncio.gather(*(self._probe(r) for r in self.replicas),
                                        return_exceptions=True)
        for replica, outcome in zip(self.replicas, outcomes, strict=True):
            if isinstance(outcome, Exception):
                logger.error("replica %s: probe failed", replica.url, exc_info=outcome)
        self.index.expire()

    def mark_down(self, replica: Replica, why: str) -> None:
        """Take `replica` out of routing now (a request to it failed); the probes bring it
        back when it answers again."""
        if replica.up:
            logger.warning("replica %s down: %s", replica.url, why)
        replica.up, replica.failures = False, max(replica.failures, 2)
        self.index.clear(replica.url)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.refresh()
            except Exception:  # a probe round must never end the watching
                logger.exception("replica probes failed")

    async def _probe(self, replica: Replica) -> None:
        try:
            ok = (await self._client.get(f"{replica.url}/health")).status_code == 200
        except httpx.HTTPError:
            ok = False
        if ok:
            replica.failures = 0
            if not replica.up:
                logger.info("replica %s up", replica.url)
                replica.up = True
                await self._discover(replica)
            return
        replica.failures += 1
        if replica.failures >= 2 and replica.up:
            self.mark_down(replica, "no answer to /health")
        if not replica.up and replica.subscriber is not None:
            await self._unsubscribe(replica)

    async def _discover(self, replica: Replica) -> None:
        """Subscribe to the replica's events (found at its ``/kv_events``); a replica
        without them, or announcing what this router cannot follow, is routed by the
        router's own history of it."""
        await self._unsubscribe(replica)
        self.index.clear(replica.url)  # whatever it held before it went down is gone
        replica.events, replica.block_size, replica.capacity = None, DEFAULT_BLOCK_SIZE, 0
        if not self._subscribe:
            return
        try:
            answer = await self._client.get(f"{replica.url}/kv_events")
            info = answer.json() if answer.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            info = None
        if not isinstance(info, dict) or "endpoint" not in info:
            logger.warning("replica %s publishes no KV events: routed by this router's own "
                           "history of it", replica.url)
            return
        try:
            announced = EventsInfo.parse(info, replica.host)
            subscriber = _subscriber(announced, replica, self._on_batch, self.index)
        except ValueError as exc:
            logger.warning("replica %s announces KV events this router cannot follow (%s): "
                           "routed without them, by this router's own history of it",
                           replica.url, exc)
            return
        replica.events, replica.subscriber = info, subscriber
        replica.block_size, replica.capacity = announced.block_size, announced.num_blocks
        logger.info("replica %s: following KV events at %s", replica.url, announced.endpoint)

    async def _unsubscribe(self, replica: Replica) -> None:
        subscriber, replica.subscriber = replica.subscriber, None
        if subscriber is not None:
            await asyncio.get_running_loop().run_in_executor(None, subscriber.close)

