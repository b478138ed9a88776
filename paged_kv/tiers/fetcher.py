"""The tiers' read path: one prompt's missing blocks being fetched (`Fetch`), and the fetcher
thread that looks them up and reads them back (`TierFetcher`).

The fetcher takes one `Fetch` at a time: one lookup per tier for the whole run of keys (one
round trip on Redis), the longest contiguous run any tier holds, whether fetching it beats
recomputing (the engine's measured prefill rate against the tier's measured fetch rate),
then the values in batches, each verified; it gives up at the fetch's deadline. The
engine's thread polls a fetch and loads what arrived (`TierManager.land`).

A hand-off's fetch (`Fetch.peer`, `paged_kv.handoff`) reads one source, the prefill
engine's lease, and is never skipped by the rates (a hand-off always pulls); its values
are verified as any tier's.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time

import numpy as np
import torch

from . import codec
from .base import Store

logger = logging.getLogger(__name__)

FETCH_BATCH = 64  # blocks per get: one round trip each


def ema(average: float | None, sample: float, weight: float = 0.2) -> float:
    """An exponential moving average: `sample` weighted by `weight` into `average` (the
    sample itself when there is no average yet, None or 0). A rate follows a tier or the
    model as they speed up or slow down, and one odd call moves it only a fifth of the way.

    >>> ema(None, 2.0), ema(4.0, 9.0)
    (2.0, 5.0)
    """
    return (1 - weight) * average + weight * sample if average else sample


class Fetch:
    """One prompt's missing blocks being fetched; the engine's thread polls `done`."""

    def __init__(self, keys: list[bytes], token_ids: np.ndarray, deadline: float,
                 parent: bytes, checkpoints: list[list[bytes]] | None = None,
                 num_lead: int = 0) -> None:
        self.keys, self.token_ids, self.deadline = keys, token_ids, deadline
        # a model with recurrent layers: the state checkpoint after each of the first
        # `num_lead` keys (the leading group's blocks), as chunk keys, deepest first; the
        # deepest one a tier holds within the fetched blocks joins the run
        self.checkpoints, self.num_lead = checkpoints or [], num_lead
        self.parent = parent  # the key the first block chains from (its BlockStored parent)
        self.started = time.monotonic()
        self.done = False  # set last, by the fetcher
        self.cancelled = False  # set by the engine's thread: the fetcher stops early
        self.payload: torch.Tensor | None = None  # [n, block_nbytes], the run fetched
        self.sources: list[str] = []  # the tier of each fetched block
        self.found: list[list[bool]] = []  # per store: whether its lookup found each key
        # the report, once landed or given up: blocks loaded per tier, and why the run
        # stopped short: ("tier_timeout", tier) past the deadline, ("verify_failed", tier)
        self.loaded: dict[str, int] = {}
        self.failure: tuple[str, str] | None = None
        self.tier: str | None = None  # the tier being asked now (a timeout names it)
        self.prefix = ""  # the tenant's key prefix in stores that name tenants (Redis)
        # a hand-off's source (`paged_kv.handoff.PeerSource`): the run is fetched from it
        # alone, and always (a hand-off pulls even where recomputing looks faster)
        self.peer: Store | None = None

    def timed_out(self) -> None:
        """Record that the fetch passed its deadline (at the tier being asked)."""
        if self.failure is None and self.tier is not None:
            self.failure = ("tier_timeout", self.tier)

    @property
    def expired(self) -> bool:
        return time.monotonic() > self.deadline


class TierFetcher:
    """One background thread that fetches queued `Fetch`es from the tiers, fastest tier
    first, and the measured rates that decide whether a fetch is worth it.

    Parameters
    ----------
    stores : list of Store
        Fastest first.
    namespace, digest : str, bytes
        The fingerprint's (`codec.Fingerprint`).
    block_nbytes : int
        Bytes of one block's payload.
    block_size : int
        Tokens per block.
    """

    def __init__(self, stores: list[Store], namespace: str, digest: bytes, block_nbytes: int,
                 block_size: int) -> None:
        self.stores = stores
        self._namespace, self._digest = namespace, digest
        self._nbytes, self._block_size = block_nbytes, block_size
        self.misses: collections.Counter = collections.Counter()  # by store name
        self.verify_failures: collections.Counter = collections.Counter()  # by store name
        self.fetches = 0  # finished fetches
        self.skipped_fetches = 0  # fetches not started or cut: recomputing was faster
        self.fetch_seconds: collections.deque[float] = collections.deque(maxlen=256)
        # measured rates: seconds per prefill token; per tier, seconds per call and per byte
        self._token_s: float | None = None
        self._call_s = {s.name: 0.0 for s in stores}
        self._byte_s = {s.name: 0.0 for s in stores}
        self._queue: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="paged-kv-tier-fetcher",
                                        daemon=True)
        self._thread.start()

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """One step's computed tokens and its model time: the recompute rate."""
        if num_tokens >= 32 and seconds > 0:  # decode-only steps say little per token
            self._token_s = ema(self._token_s, seconds / num_tokens)

    def recompute_seconds(self, num_tokens: int) -> float | None:
        """Estimated seconds to recompute `num_tokens` (None before any prefill was seen)."""
        return None if self._token_s is None else self._token_s * num_tokens

    def submit(self, fetch: Fetch) -> None:
        """Queue `fetch`; the thread sets ``fetch.done`` when it is through with it."""
        self._queue.put(fetch)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                fetch = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            try:
                if not (fetch.cancelled or fetch.expired):
                    self._fetch(fetch)
                elif fetch.expired:  # waited behind other fetches past its deadline
                    fetch.tier = fetch.tier or next((s.name for s in self.stores), None)
                    fetch.timed_out()
            except Exception:
                logger.exception("paged_kv tiers: a fetch failed; the request recomputes")
                fetch.payload, fetch.sources = None, []
            finally:
                self.fetch_seconds.append(time.monotonic() - fetch.started)
                self.fetches += 1
                fetch.done = True

    def _names(self, fetch: Fetch, stores: list[Store],
               keys: list[bytes] | None = None) -> list[list[str]]:
        """Each store's names of `keys` (default the fetch's; a store that names tenants:
        prefixed)."""
        plain = [codec.store_key(self._namespace, key) for key in
                 (fetch.keys if keys is None else keys)]
        prefixed = [fetch.prefix + name for name in plain] if fetch.prefix else plain
        return [prefixed if store.tenant_keys else plain for store in stores]

    def _fetch(self, fetch: Fetch) -> None:
        stores = self.stores if fetch.peer is None else [fetch.peer]
        names = self._names(fetch, stores)
        held = []
        # one lookup per tier for the whole run
        for store, store_names in zip(stores, names, strict=True):
            fetch.tier = store.name
            start = time.monotonic()
            found = store.contains(store_names)
            self._rate(store.name, time.monotonic() - start, 0)
            self.misses[store.name] += found.count(False)
            held.append(found)
        fetch.found = held
        sources = []
        for i in range(len(fetch.keys)):  # each block from the first tier that holds it
            tier = next((t for t, found in enumerate(held) if found[i]), None)
            if tier is None:
                break
            sources.append(tier)
        if not sources or (fetch.peer is None and not self._worth_it(sources)):
            self.skipped_fetches += bool(sources)
            return
        if fetch.checkpoints and self._add_checkpoint(fetch, stores, sources):
            names = self._names(fetch, stores)
        rows: list[torch.Tensor] = []
        for start in range(0, len(sources), FETCH_BATCH):
            if fetch.cancelled or fetch.expired:  # the tier asked last was the slow one
                if fetch.expired:
                    fetch.timed_out()
                break
            fetch.tier = stores[sources[start]].name
            got = self._get_batch(fetch, names, sources, start, stores)
            rows += got
            if len(got) < len(sources[start:start + FETCH_BATCH]):
                break
        if rows:
            fetch.payload = torch.stack(rows)
            fetch.sources = [stores[t].name for t in sources[:len(rows)]]

    def _add_checkpoint(self, fetch: Fetch, stores: list[Store], sources: list[int]) -> bool:
        """Append to the run the chunks of the deepest state checkpoint a tier holds after
        one of the run's fetched leading blocks (looked up by its first chunk, one call per
        tier), read from that tier; none: the blocks come alone (served from a checkpoint
        the device holds, or recomputed)."""
        usable = min(len(sources), fetch.num_lead)
        # candidates deepest first: the one after leading block i is at num_lead - 1 - i
        wanted = [(fetch.num_lead - 1 - j, chunks) for j, chunks in enumerate(fetch.checkpoints)
                  if fetch.num_lead - 1 - j < usable]
        if not wanted:
            return False
        firsts = self._names(fetch, stores, [chunks[0] for _, chunks in wanted])
        for tier, (store, names) in enumerate(zip(stores, firsts, strict=True)):
            found = store.contains(names)
            hit = next((k for k, held in enumerate(found) if held), None)
            if hit is None:
                continue
            chunks = wanted[hit][1]
            del fetch.keys[len(sources):]  # the run ends where its blocks did
            for held in fetch.found:
                del held[len(sources):]
            fetch.keys += chunks
            sources += [tier] * len(chunks)
            for t, held in enumerate(fetch.found):
                held += [t == tier] * len(chunks)
            return True
        return False

    def _get_batch(self, fetch: Fetch, names: list[list[str]], sources: list[int],
                   start: int, stores: list[Store]) -> list[torch.Tensor]:
        """Blocks ``start ..`` of the run (one get per tier involved; `names`: each
        tier's names of the run's keys), verified, up to the first that fails."""
        batch = range(start, min(start + FETCH_BATCH, len(sources)))
        values: dict[int, bytes | None] = {}
        for tier in sorted({sources[i] for i in batch}):
            store, wanted = stores[tier], [i for i in batch if sources[i] == tier]
            began = time.monotonic()
            got = store.get([names[tier][i] for i in wanted])
            for i, value in zip(wanted, got, strict=True):
                values[i] = value
            nbytes = len(wanted) * self._nbytes
            self._rate(store.name, time.monotonic() - began, nbytes)
        rows = []
        for i in batch:
            payload = codec.decode(values[i], fetch.keys[i], self._digest, self._nbytes)
            if payload is None:
                store = stores[sources[i]]
                if values[i] is not None:  # present but wrong: never served, never again
                    self.verify_failures[store.name] += 1
                    fetch.failure = ("verify_failed", store.name)
                    store.delete([names[sources[i]][i]])
                else:
                    self.misses[store.name] += 1
                break
            rows.append(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        return rows

    def _rate(self, tier: str, seconds: float, nbytes: int) -> None:
        """One call's time into the tier's rates: per byte for a get, per call for a
        lookup (whose bytes are negligible)."""
        if nbytes:
            self._byte_s[tier] = ema(self._byte_s.get(tier), seconds / nbytes)
        else:
            self._call_s[tier] = ema(self._call_s.get(tier), seconds)

    def _worth_it(self, sources: list[int]) -> bool:
        """Whether fetching the run beats recomputing its tokens (true until the engine
        has measured a prefill)."""
        recompute = self.recompute_seconds(len(sources) * self._block_size)
        if recompute is None:
            return True
        fetch = 0.0
        for tier in set(sources):
            name = self.stores[tier].name
            blocks = sources.count(tier)
            calls = -(-blocks // FETCH_BATCH)
            fetch += calls * self._call_s[name] + blocks * self._nbytes * self._byte_s[name]
        return fetch < recompute

    def close(self) -> None:
        """Stop the thread (a fetch in progress finishes its current call first)."""
        self._stop.set()
        self._thread.join(timeout=5.0)
