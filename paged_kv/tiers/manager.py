"""`TierManager`: writes stored blocks down the tiers and fetches a prompt's blocks back.

Two background threads, so a step never waits on a tier. The writer (`writer.TierWriter`)
takes batches of (key, bytes) that the engine's thread copied out of the pool right after
the step that wrote them, encodes them (`codec`) and puts them into every tier not known to
hold them (`writer.HeldKeys`); its queue is bounded and a batch that does not fit is dropped
and counted. The fetcher takes one `Fetch` at a time:
one lookup per tier for the whole run of keys (one round trip on Redis), the longest
contiguous run any tier holds, whether fetching it beats recomputing (the engine's
measured prefill rate against the tier's measured fetch rate), then the values in
batches, each verified; it gives up at the fetch's deadline. The engine's thread polls a
fetch and loads what arrived (`PagedKVCache.load_cached`).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import queue
import threading
import time

import numpy as np
import torch

from ..cache import PagedKVCache
from ..offload import stored_blocks
from . import codec
from .base import Store, TierConfig
from .identity import model_fingerprint
from .memory import HostStore
from .writer import HeldKeys, TierChange, TierWriter

logger = logging.getLogger(__name__)

FETCH_BATCH = 64  # blocks per get: one round trip each
MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class TierStats:
    """One tier's counters (cumulative) and contents (now)."""

    tier: str
    blocks: int
    bytes: int
    hit_tokens: int  # prompt tokens whose K/V came from this tier
    misses: int  # blocks looked up here and not held
    verify_failures: int  # values that failed verification: deleted, never served
    written_blocks: int


@dataclasses.dataclass(frozen=True)
class TiersStats:
    """The tiers together: per-tier stats and the manager's own counters."""

    tiers: tuple[TierStats, ...]
    dropped_writes: int  # blocks not written: the write queue was full
    deadline_fallbacks: int  # fetches past their deadline: the request recomputed
    skipped_fetches: int  # fetches not started or cut: recomputing was faster
    loaded_blocks: int
    fetches: int  # finished fetches
    recent_fetch_seconds: tuple[float, ...]  # the last (up to 256) fetches' durations


class Fetch:
    """One prompt's missing blocks being fetched; the engine's thread polls `done`."""

    def __init__(self, keys: list[bytes], token_ids: np.ndarray, deadline: float,
                 parent: bytes) -> None:
        self.keys, self.token_ids, self.deadline = keys, token_ids, deadline
        self.parent = parent  # the key the first block chains from (its BlockStored parent)
        self.started = time.monotonic()
        self.done = False  # set last, by the fetcher
        self.cancelled = False  # set by the engine's thread: the fetcher stops early
        self.payload: torch.Tensor | None = None  # [n, block_nbytes], the run fetched
        self.sources: list[str] = []  # the tier of each fetched block
        self.found: list[list[bool]] = []  # per store: whether its lookup found each key

    @property
    def expired(self) -> bool:
        return time.monotonic() > self.deadline


class TierManager:
    """The tiers behind one cache (one process, tensor parallelism refused by the engine).

    Parameters
    ----------
    config : TierConfig
    cache : PagedKVCache
        Whose pool the blocks are copied from and loaded into.
    fingerprint : codec.Fingerprint
        Of the cache's blocks (`identity.model_fingerprint`): the stores' namespace, and
        what every value's header must carry.
    """

    def __init__(self, config: TierConfig, cache: PagedKVCache,
                 fingerprint: codec.Fingerprint) -> None:
        self.config, self.cache, self.fingerprint = config, cache, fingerprint
        self._digest, self._namespace = fingerprint.digest, fingerprint.namespace
        self._nbytes = cache.pool.block_nbytes
        self.stores: list[Store] = _open_stores(config, codec.HEADER.size + self._nbytes)
        self._counts = {s.name: collections.Counter() for s in self.stores}
        self._totals: collections.Counter = collections.Counter()
        self._fetch_seconds: collections.deque[float] = collections.deque(maxlen=256)
        self._held = HeldKeys([s.name for s in self.stores])
        # measured rates: seconds per prefill token; per tier, seconds per call and per byte
        self._token_s: float | None = None
        self._call_s = {s.name: 0.0 for s in self.stores}
        self._byte_s = {s.name: 0.0 for s in self.stores}
        self._fetches: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._writer = TierWriter(self.stores, self._held, self._namespace, self._digest,
                                  config.queue_blocks)
        self._fetcher = threading.Thread(target=self._fetch_loop, name="paged-kv-tier-fetcher",
                                         daemon=True)
        self._fetcher.start()

    # -- the write path (engine thread: copy out; writer thread: encode, put) ------------
    def after_step(self, events: list) -> None:
        """Copy the blocks `events` stored (and still indexed) that some tier is not known
        to hold out of the pool and queue them for the tiers; a batch that does not fit the
        queue is dropped and counted."""
        block_ids, keys = stored_blocks(self.cache.allocator, events)
        new = self._held.claim_missing(keys)
        if not new:
            return
        data = self.cache.pool.read_blocks(block_ids[new])  # before the slot can be reused
        self._writer.submit([keys[i] for i in new], data)

    def watch(self, on_change: TierChange) -> None:
        """Call ``on_change(medium, stored keys, removed keys)`` on the writer thread after
        each write to a tier that names its medium (host "CPU", disk "DISK"; Redis is
        shared and evicts by itself, so it is not reported): KV events of the tiers."""
        self._writer.watch(on_change)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every queued write reached the tiers; False on timeout."""
        return self._writer.flush(timeout)

    # -- the read path ------------------------------------------------------------------
    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """One step's computed tokens and its model time: the recompute rate."""
        if num_tokens >= 32 and seconds > 0:  # decode-only steps say little per token
            rate = seconds / num_tokens
            self._token_s = rate if self._token_s is None else 0.8 * self._token_s + 0.2 * rate

    def recompute_seconds(self, num_tokens: int) -> float | None:
        """Estimated seconds to recompute `num_tokens` (None before any prefill was seen)."""
        return None if self._token_s is None else self._token_s * num_tokens

    def start_fetch(self, keys: list[bytes], token_ids: np.ndarray, parent: bytes,
                    ) -> Fetch | None:
        """Start fetching the blocks of `keys` (a prompt's missing full blocks, in order,
        the first chained from `parent`: the device's last hit, or the root); None when
        there is nothing to fetch."""
        if not keys or not any(getattr(s, "available", True) for s in self.stores):
            return None  # nothing to fetch, or every store is down: recompute at once
        deadline_s = self.config.fetch_deadline_s
        if deadline_s is None:
            estimate = self.recompute_seconds(len(token_ids))
            deadline_s = 1.0 if estimate is None else max(0.02, 0.75 * estimate)
        fetch = Fetch(keys, token_ids, time.monotonic() + deadline_s, parent)
        self._fetches.put(fetch)
        return fetch

    def land(self, fetch: Fetch, spare_blocks: int) -> int:
        """Load a finished fetch's blocks as cached device blocks (at most `spare_blocks`);
        returns how many, counted as hits of the tiers they came from."""
        loaded = 0
        if fetch.payload is not None and len(fetch.sources):
            n = min(len(fetch.sources), max(0, spare_blocks))
            size = self.cache.config.block_size
            loaded = self.cache.load_cached(fetch.keys[:n], fetch.token_ids[:n * size],
                                            fetch.payload[:n], fetch.parent)
            for source in fetch.sources[:loaded]:
                self._counts[source]["hit_tokens"] += size
            self._totals["loaded_blocks"] += loaded
        self._observed(fetch, loaded)
        return loaded

    def _observed(self, fetch: Fetch, loaded: int) -> None:
        """What a fetch saw of the tiers: its loaded blocks are held where the lookups
        found them (so they are written only to the tiers that lack them); the rest are
        known nowhere any more (missing, failed, or gone since the lookup: when computed
        they are written to every tier again)."""
        for store, found in zip(self.stores, fetch.found, strict=False):
            self._held.add(store.name, [key for key, held in zip(fetch.keys[:loaded], found,
                                                                 strict=False) if held])
            self._held.discard(store.name, [key for key, held in zip(
                fetch.keys[:loaded], found, strict=False) if not held])
        self._held.forget(fetch.keys[loaded:])

    def fell_back(self, fetch: Fetch) -> None:
        """The engine gave up waiting for `fetch` (its deadline passed)."""
        fetch.cancelled = True
        self._totals["deadline_fallbacks"] += 1
        self._held.forget(fetch.keys)

    def _fetch_loop(self) -> None:
        while not self._stop.is_set():
            try:
                fetch = self._fetches.get(timeout=0.1)
            except queue.Empty:
                continue
            try:
                if not (fetch.cancelled or fetch.expired):
                    self._fetch(fetch)
            except Exception:
                logger.exception("paged_kv tiers: a fetch failed; the request recomputes")
                fetch.payload, fetch.sources = None, []
            finally:
                self._fetch_seconds.append(time.monotonic() - fetch.started)
                self._totals["fetches"] += 1
                fetch.done = True

    def _fetch(self, fetch: Fetch) -> None:
        names = [codec.store_key(self._namespace, key) for key in fetch.keys]
        held = []
        for store in self.stores:  # one lookup per tier for the whole run
            start = time.monotonic()
            found = store.contains(names)
            self._rate(store.name, time.monotonic() - start, 0)
            self._counts[store.name]["misses"] += found.count(False)
            held.append(found)
        fetch.found = held
        sources = []
        for i in range(len(names)):  # each block from the first tier that holds it
            tier = next((t for t, found in enumerate(held) if found[i]), None)
            if tier is None:
                break
            sources.append(tier)
        if not sources or not self._worth_it(sources):
            self._totals["skipped_fetches"] += bool(sources)
            return
        rows: list[torch.Tensor] = []
        for start in range(0, len(sources), FETCH_BATCH):
            if fetch.cancelled or fetch.expired:
                break
            got = self._get_batch(fetch, names, sources, start)
            rows += got
            if len(got) < len(sources[start:start + FETCH_BATCH]):
                break
        if rows:
            fetch.payload = torch.stack(rows)
            fetch.sources = [self.stores[t].name for t in sources[:len(rows)]]

    def _get_batch(self, fetch: Fetch, names: list[str], sources: list[int],
                   start: int) -> list[torch.Tensor]:
        """Blocks ``start ..`` of the run (one get per tier involved), verified, up to the
        first that fails."""
        batch = range(start, min(start + FETCH_BATCH, len(sources)))
        values: dict[int, bytes | None] = {}
        for tier in sorted({sources[i] for i in batch}):
            store, wanted = self.stores[tier], [i for i in batch if sources[i] == tier]
            began = time.monotonic()
            for i, value in zip(wanted, store.get([names[i] for i in wanted]), strict=True):
                values[i] = value
            nbytes = len(wanted) * self._nbytes
            self._rate(store.name, time.monotonic() - began, nbytes)
        rows = []
        for i in batch:
            payload = codec.decode(values[i], fetch.keys[i], self._digest, self._nbytes)
            if payload is None:
                store = self.stores[sources[i]]
                if values[i] is not None:  # present but wrong: never served, never again
                    self._counts[store.name]["verify_failures"] += 1
                    store.delete([names[i]])
                else:
                    self._counts[store.name]["misses"] += 1
                break
            rows.append(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        return rows

    def _rate(self, tier: str, seconds: float, nbytes: int) -> None:
        if nbytes:
            per_byte = seconds / nbytes
            self._byte_s[tier] = 0.8 * self._byte_s[tier] + 0.2 * per_byte \
                if self._byte_s[tier] else per_byte
        else:
            self._call_s[tier] = 0.8 * self._call_s[tier] + 0.2 * seconds \
                if self._call_s[tier] else seconds

    def _worth_it(self, sources: list[int]) -> bool:
        """Whether fetching the run beats recomputing its tokens (true until the engine
        has measured a prefill)."""
        recompute = self.recompute_seconds(len(sources) * self.cache.config.block_size)
        if recompute is None:
            return True
        fetch = 0.0
        for tier in set(sources):
            name = self.stores[tier].name
            blocks = sources.count(tier)
            calls = -(-blocks // FETCH_BATCH)
            fetch += calls * self._call_s[name] + blocks * self._nbytes * self._byte_s[name]
        return fetch < recompute

    # -- observation and lifetime -------------------------------------------------------
    def stats(self) -> TiersStats:
        """Counters so far and each tier's contents now."""
        tiers = []
        for store in self.stores:
            blocks, nbytes = store.usage()
            counts = self._counts[store.name]
            tiers.append(TierStats(store.name, blocks, nbytes, counts["hit_tokens"],
                                   counts["misses"], counts["verify_failures"],
                                   self._writer.written_blocks[store.name]))
        totals = self._totals
        return TiersStats(tuple(tiers), self._writer.dropped_writes,
                          totals["deadline_fallbacks"],
                          totals["skipped_fetches"], totals["loaded_blocks"],
                          totals["fetches"], tuple(self._fetch_seconds))

    def close(self) -> None:
        """Stop the threads (queued writes are given a moment) and close the stores."""
        self._writer.close()
        self._stop.set()
        self._fetcher.join(timeout=5.0)
        for store in self.stores:
            with contextlib.suppress(Exception):
                store.close()


def open_tiers(config: TierConfig | None, cache: PagedKVCache,
               model: torch.nn.Module) -> TierManager | None:
    """The tiers behind `cache`, or None when none is configured; blocks are namespaced by
    `model`'s fingerprint (`identity.model_fingerprint`: its config, and all its weights'
    bytes unless the config names the weights)."""
    if config is None or not config.enabled:
        return None
    return TierManager(config, cache, model_fingerprint(model, cache.config, config.model_id))


def _open_stores(config: TierConfig, value_bytes: int) -> list[Store]:
    """The configured tiers, fastest first."""
    stores: list[Store] = []
    if config.host_mib:
        stores.append(HostStore(int(config.host_mib * MIB)))
    if config.disk_dir is not None:
        from .disk import DiskStore

        stores.append(DiskStore(config.disk_dir, int(config.disk_mib * MIB)))
    if config.remote_url is not None:
        from .remote import RedisStore

        stores.append(RedisStore(config.remote_url, value_bytes=value_bytes))
    return stores

