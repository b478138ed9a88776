"""The replicas behind the router: health, load, and where their KV events come from."""

from __future__ import annotations

import asyncio
import logging
import urllib.parse
from collections.abc import Callable

import httpx

from .index import PrefixIndex

logger = logging.getLogger("paged_kv.router")

DEFAULT_BLOCK_SIZE = 16  # a replica without events: `paged-kv serve`'s default


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
        """One round of probes (and discoveries for replicas that came up)."""
        await asyncio.gather(*(self._probe(r) for r in self.replicas))
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
        """Subscribe to the replica's events (found at its ``/kv_events``)."""
        await self._unsubscribe(replica)
        self.index.clear(replica.url)  # whatever it held before it went down is gone
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
            replica.events = None
            return
        from ..events.subscriber import EventSubscriber

        replica.events, replica.block_size = info, int(info.get("block_size", 16))
        replica.capacity = int(info.get("num_blocks", 0))
        replay = info.get("replay_endpoint")
        replica.subscriber = EventSubscriber(
            reachable_endpoint(info["endpoint"], replica.host),
            replay_endpoint=None if replay is None else reachable_endpoint(replay, replica.host),
            on_batch=lambda stamp, events: self._on_batch(replica, stamp, events),
            on_reset=lambda: self.index.clear(replica.url))
        logger.info("replica %s: following KV events at %s", replica.url, info["endpoint"])

    async def _unsubscribe(self, replica: Replica) -> None:
        subscriber, replica.subscriber = replica.subscriber, None
        if subscriber is not None:
            await asyncio.get_running_loop().run_in_executor(None, subscriber.close)

