"""The tiers' write path: which tier holds which block (`HeldKeys`), and the writer thread
that puts blocks into the tiers that lack them (`TierWriter`).

A block is known to be held by a tier once a write to that tier succeeded (never when the
write was only queued: a store that is down, flushed or refusing writes does not hold what
it was sent) or once a lookup found it there; it is known not to be after a lookup missed
it or its value failed verification. A block some tier is not known to hold is written to
that tier the next time the device stores it (computed again, or loaded from another
tier), so a Redis restarted empty is filled again by the blocks computed afterwards.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable

import torch

from . import codec
from .base import Store
from .shares import Eviction, TierShares, tenant_prefix

# medium, stored keys, removed keys (see `TierWriter.watch`)
TierChange = Callable[[str, list[bytes], list[bytes]], None]
# tier, its evictions (see `TierWriter`'s `on_evict`)
TierEvict = Callable[[str, list[Eviction]], None]

logger = logging.getLogger(__name__)

MAX_KNOWN_KEYS = 1 << 20  # bounds HeldKeys: ~150 B a key; a forgotten key is written again


class HeldKeys:
    """Which tiers hold which blocks, as far as this process has seen, and which blocks are
    queued for writing. Thread-safe: the engine's thread, the writer and the fetcher call.

    Parameters
    ----------
    tiers : list of str
        The stores' names, fastest first.
    """

    def __init__(self, tiers: list[str]) -> None:
        self._bits = {name: 1 << i for i, name in enumerate(tiers)}
        self._all = (1 << len(tiers)) - 1
        self._held: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self._queued: set[bytes] = set()
        self._lock = threading.Lock()

    def claim_missing(self, keys: list[bytes]) -> list[int]:
        """Indices of `keys` that some tier is not known to hold and that are not queued
        already; they count as queued from now on (`unqueue` when written or dropped)."""
        with self._lock:
            held, queued, every = self._held, self._queued, self._all
            new = [i for i, key in enumerate(keys)
                   if held.get(key, 0) != every and key not in queued]
            queued.update(keys[i] for i in new)
        return new

    def unqueue(self, keys: list[bytes]) -> None:
        with self._lock:
            self._queued.difference_update(keys)

    def lacking(self, tier: str, keys: list[bytes]) -> list[int]:
        """Indices of `keys` that `tier` is not known to hold."""
        bit = self._bits[tier]
        with self._lock:
            return [i for i, key in enumerate(keys) if not self._held.get(key, 0) & bit]

    def add(self, tier: str, keys: list[bytes]) -> None:
        """`tier` holds `keys` (a write succeeded, a lookup found them)."""
        bit, held = self._bits[tier], self._held
        with self._lock:
            for key in keys:
                held[key] = held.pop(key, 0) | bit
            while len(held) > MAX_KNOWN_KEYS:
                held.popitem(last=False)

    def discard(self, tier: str, keys: list[bytes]) -> None:
        """`tier` lacks `keys` (a lookup missed them, a value failed verification)."""
        bit, held = self._bits[tier], self._held
        with self._lock:
            for key in keys:
                left = held.get(key, 0) & ~bit
                if left:
                    held[key] = left
                else:
                    held.pop(key, None)

    def forget(self, keys: list[bytes]) -> None:
        """No tier is known to hold `keys` any more."""
        with self._lock:
            for key in keys:
                self._held.pop(key, None)

    def anywhere(self, key: bytes) -> bool:
        """Whether some tier is known to hold `key`."""
        with self._lock:
            return bool(self._held.get(key, 0))


class TierWriter:
    """One background thread that encodes queued blocks and puts each into every tier not
    known to hold it; a tier's failure costs only that tier the batch.

    Parameters
    ----------
    stores : list of Store
    held : HeldKeys
        Updated after each write that succeeded.
    namespace, digest : str, bytes
        The fingerprint's (`codec.Fingerprint`).
    queue_blocks : int
        Blocks waiting to be written before further batches are dropped.
    shares : dict of str to TierShares, optional
        Per tier, the per-tenant accounting that chooses the victims before a write (with a
        tenant policy; None: each store evicts by its own LRU, as without tenants).
    on_evict : callable, optional
        ``on_evict(tier, evictions)`` after each write that evicted blocks (the chosen
        victims, and what the store evicted by itself: pressure ``global``).
    """

    def __init__(self, stores: list[Store], held: HeldKeys, namespace: str, digest: bytes,
                 queue_blocks: int, shares: dict[str, TierShares] | None = None,
                 on_evict: TierEvict | None = None) -> None:
        self.stores, self.held = stores, held
        self.shares, self._on_evict = shares, on_evict
        self._namespace, self._digest = namespace, digest
        self.written_blocks: collections.Counter = collections.Counter()  # by store name
        self.dropped_writes = 0  # blocks not written: the queue was full
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, queue_blocks))
        self._on_change: TierChange | None = None
        if on_evict is not None:  # what a store evicts by itself is drained after each write
            self._track_removed()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="paged-kv-tier-writer",
                                        daemon=True)
        self._thread.start()

    def submit(self, keys: list[bytes], data: torch.Tensor,
               tenants: list[int] | None = None) -> bool:
        """Queue blocks (``data[i]`` holds ``keys[i]``, already claimed in `held`; of the
        ledger's tenant ``tenants[i]``, needed with `shares`); False, counted and unclaimed,
        when the queue is full."""
        try:
            self._queue.put_nowait((keys, data, tenants))
        except queue.Full:
            self.dropped_writes += len(keys)
            self.held.unqueue(keys)
            return False
        return True

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                keys, data, tenants = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            try:
                self._write(keys, data, tenants)
            except Exception:  # never end the writer
                logger.exception("paged_kv tiers: a write batch failed")
            finally:
                self.held.unqueue(keys)
                self._queue.task_done()

    def _write(self, keys: list[bytes], data: torch.Tensor,
               tenants: list[int] | None = None) -> None:
        rows = data.numpy()
        values = [(codec.store_key(self._namespace, key),
                   codec.encode(key, self._digest, rows[i].data)) for i, key in enumerate(keys)]
        for store in self.stores:
            wanted = self.held.lacking(store.name, keys)
            if not wanted:
                continue
            shares = self.shares.get(store.name) if self.shares and tenants else None
            try:
                victims = []
                if shares is not None:
                    wanted, victims = self._make_room(store, shares, keys, tenants, wanted)
                items = [values[i] for i in wanted]
                if shares is not None and store.tenant_keys:
                    items = [(self._prefix(shares, tenants[i]) + name, value)
                             for i, (name, value) in zip(wanted, items, strict=True)]
                written = store.put(items) if items else 0
            except Exception:
                logger.exception("paged_kv tiers: a write to %s failed", store.name)
                continue
            self.written_blocks[store.name] += written
            done = [keys[i] for i in wanted] if written == len(wanted) else []
            if shares is not None and written != len(wanted):  # keep the accounting true
                shares.forget(self._absent(store, [name for name, _ in items],
                                           [keys[i] for i in wanted]))
            self.held.add(store.name, done)  # only now: the store holds them
            self._report(store, done, victims)

    def _make_room(self, store: Store, shares: TierShares, keys: list[bytes],
                   tenants: list[int], wanted: list[int]) -> tuple[list[int], list[Eviction]]:
        """The per-tenant accounting's choice: which of `wanted` to write, and the
        victims, deleted here first (so the store's own LRU does not choose)."""
        keep, victims = shares.admit([keys[i] for i in wanted],
                                     [tenants[i] for i in wanted], store.usage()[0])
        if victims:
            prefixed = store.tenant_keys
            store.delete([(self._prefix(shares, owner) if prefixed else "")
                          + codec.store_key(self._namespace, key)
                          for key, _, _, owner in victims])
            self.held.discard(store.name, [victim[0] for victim in victims])
        return [wanted[i] for i in keep], victims

    @staticmethod
    def _prefix(shares: TierShares, tenant: int) -> str:
        return tenant_prefix(shares.names[tenant])

    @staticmethod
    def _absent(store: Store, names: list[str], keys: list[bytes]) -> list[bytes]:
        """Those of `keys` (stored as `names`) that `store` does not hold (after a write
        that failed)."""
        found = store.contains(names)
        return [key for key, held in zip(keys, found, strict=True) if not held]

    def watch(self, on_change: TierChange) -> None:
        """Call ``on_change(medium, stored keys, removed keys)`` on the writer thread after
        each write to a tier that names its medium (host "CPU", disk "DISK"; Redis is
        shared and evicts by itself, so it is not reported): KV events of the tiers."""
        self._on_change = on_change
        self._track_removed()

    def _track_removed(self) -> None:
        for store in self.stores:
            if store.medium and store.removed is None:
                store.removed = collections.deque(maxlen=1 << 16)

    def _report(self, store: Store, stored: list[bytes], victims: list[Eviction]) -> None:
        """Drain what `store` removed: its own evictions (those the accounting did not
        choose) to `on_evict` as ``global``, and all of it to `watch`'s callback."""
        removed = []
        while store.removed:
            hex_key = store.removed.popleft().rpartition(":")[2]
            if len(hex_key) == 64:  # a full key (test modes cut them: not reported)
                removed.append(bytes.fromhex(hex_key))
        if self._on_evict is not None:
            chosen = {victim[0] for victim in victims}
            own = [(key, "global", None, 0) for key in removed if key not in chosen]
            if self.shares and store.name in self.shares and own:
                self.shares[store.name].forget([victim[0] for victim in own])
            self.held.discard(store.name, [victim[0] for victim in own])
            if victims or own:
                self._on_evict(store.name, victims + own)
        if self._on_change is not None and store.medium and (stored or removed):
            self._on_change(store.medium, stored, removed)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every queued write reached the tiers; False on timeout."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def close(self) -> None:
        """Give queued writes a moment, then stop the thread."""
        self.flush(timeout=2.0)
        self._stop.set()
        self._thread.join(timeout=5.0)
