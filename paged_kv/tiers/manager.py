"""`TierManager`: writes stored blocks down the tiers and fetches a prompt's blocks back.

Two background threads, so a step never waits on a tier. The writer (`writer.TierWriter`)
takes batches of (key, bytes) that the engine's thread copied out of the pool right after
the step that wrote them, encodes them (`codec`) and puts them into every tier not known to
hold them (`writer.HeldKeys`); its queue is bounded and a batch that does not fit is dropped
and counted. The fetcher (`fetcher.TierFetcher`) takes one `Fetch` at a time: one lookup per
tier for the whole run of keys (one round trip on Redis), the longest contiguous run any
tier holds, whether fetching it beats recomputing (the engine's measured prefill rate
against the tier's measured fetch rate), then the values in batches, each verified; it
gives up at the fetch's deadline. The engine's thread polls a fetch and loads what arrived
(`PagedKVCache.load_cached`).

The manager is their coordinator, on the engine's thread: it opens the stores, copies
stored blocks out for the writer, starts fetches and lands them, keeps which tier holds
which block (`HeldKeys`) up to date with what a fetch saw, and adds up the counters.
A decode engine's hand-offs come through the same read path (`start_peer_fetch`): blocks
from elsewhere reach the pool one way only, verified.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import time

import numpy as np
import torch

from ..core.cache import PagedKVCache
from ..core.load_cached import stored_blocks
from ..keys import root_hash
from ..parts import EnginePart
from ..tenants.policy import TenantPolicy
from . import codec
from .base import Store, TierConfig
from .fetcher import Fetch, TierFetcher
from .identity import model_fingerprint
from .memory import HostStore
from .shares import TierGhosts, capacity_blocks, open_shares, tenant_prefix
from .writer import HeldKeys, TierChange, TierWriter

MIB = 1 << 20
MAX_TENANT_KEYS = 1 << 18  # bounds the key -> tenant map that names a fetch's tenant


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
    # blocks held now by tenant ("": salts the policy does not name, blocks of unknown
    # tenant, and every block without a tenant policy)
    tenant_blocks: dict[str, int] = dataclasses.field(default_factory=dict)


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


class TierManager(EnginePart):
    """The tiers behind one cache (one process, tensor parallelism refused by the engine);
    an engine's part (the step's written blocks copied out, `after_step`; the recompute
    rate, `observe_prefill`), and its scheduler's source of fetches.

    Parameters
    ----------
    config : TierConfig
    cache : PagedKVCache
        Whose pool the blocks are copied from and loaded into.
    fingerprint : codec.Fingerprint
        Of the cache's blocks (`identity.model_fingerprint`): the stores' namespace, and
        what every value's header must carry.
    tenants : TenantPolicy, optional
        Per-tenant accounting in every tier (`shares.TierShares`); default the policy of
        the cache's tenant ledger (``CacheConfig.tenants``), whose ``tenants_of`` names each
        stored block's tenant. None and no ledger: each store's own LRU, as ever.
    """

    wants_events = True

    def __init__(self, config: TierConfig, cache: PagedKVCache,
                 fingerprint: codec.Fingerprint, tenants: TenantPolicy | None = None) -> None:
        self.config, self.cache, self.fingerprint = config, cache, fingerprint
        self._digest, self._namespace = fingerprint.digest, fingerprint.namespace
        self._nbytes = cache.pool.block_nbytes
        value_bytes = codec.HEADER.size + self._nbytes
        self.stores: list[Store] = _open_stores(config, value_bytes)
        self._hit_tokens: collections.Counter = collections.Counter()  # by store name
        self._loaded_blocks = self._deadline_fallbacks = 0
        self._held = HeldKeys([s.name for s in self.stores])
        self._ledger = getattr(cache.allocator, "tenants", None)
        policy = tenants if tenants is not None else getattr(self._ledger, "policy", None)
        names = self._ledger.names if self._ledger is not None else [None]
        self.shares = None if policy is None else open_shares(
            self.stores, value_bytes, names, policy, cache.config.num_blocks)
        self._ghosts = TierGhosts({s.name: capacity_blocks(s, value_bytes)
                                   for s in self.stores})
        # a fetch's tenant, from its parent (a salted root, or a block stored here before):
        # its keys' prefix in a store that names tenants
        self._names = names
        self._roots = {root_hash(name): i for i, name in enumerate(names) if name}
        self._key_tenant: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self._writer = TierWriter(self.stores, self._held, self._namespace, self._digest,
                                  config.queue_blocks, self.shares, self._ghosts.evicted)
        self._fetcher = TierFetcher(self.stores, self._namespace, self._digest, self._nbytes,
                                    cache.config.block_size)

    # -- the write path (engine thread: copy out; writer thread: encode, put) ------------
    def after_step(self, events: list) -> None:
        """Copy the blocks `events` stored (and still indexed) that some tier is not known
        to hold out of the pool and queue them for the tiers; a batch that does not fit the
        queue is dropped and counted."""
        block_ids, keys = stored_blocks(self.cache.allocator, events)
        every = self._tenants(block_ids, keys)
        new = self._held.claim_missing(keys)
        if new:
            data = self.cache.pool.read_blocks(block_ids[new])  # before the slot is reused
            tenants = None if every is None else [every[i] for i in new]
            self._writer.submit([keys[i] for i in new], data, tenants)
        self._store_states(events)

    def _store_states(self, events: list) -> None:
        """Queue the state checkpoints `events` stored (a model with recurrent layers) as
        block-sized chunks (`paged_kv.core.groups.state_values`), where a tier lacks them;
        their tenant is the block's they follow (known when the block was stored)."""
        states = self.cache.state_group
        if states is None or not any(event.kind == "state_stored" for event in events):
            return
        keys, data = states.stored_values(events)
        new = self._held.claim_missing(keys)
        if not new:
            return
        tenants = None
        if self.shares is not None:
            tenants = [self._key_tenant.get(keys[i][:codec.CHAIN_BYTES], 0) for i in new]
        self._writer.submit([keys[i] for i in new], data[new], tenants)

    def _tenants(self, block_ids: np.ndarray, keys: list[bytes]) -> list[int] | None:
        """The ledger's tenant of each stored block (tagged when it was indexed), kept
        for the fetches that chain from them; None without per-tenant accounting."""
        if self.shares is None:
            return None
        tenants = ([0] * len(keys) if self._ledger is None
                   else self._ledger.tenants_of(block_ids.tolist()))
        known = self._key_tenant
        for key, tenant in zip(keys, tenants, strict=True):
            known[key] = tenant
            known.move_to_end(key)
        while len(known) > MAX_TENANT_KEYS:
            known.popitem(last=False)
        return tenants

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
        self._fetcher.observe_prefill(num_tokens, seconds)

    def recompute_seconds(self, num_tokens: int) -> float | None:
        """Estimated seconds to recompute `num_tokens` (None before any prefill was seen)."""
        return self._fetcher.recompute_seconds(num_tokens)

    def start_fetch(self, keys: list[bytes], token_ids: np.ndarray, parent: bytes,
                    ) -> Fetch | None:
        """Start fetching the blocks of `keys` (a prompt's missing full blocks, in order,
        the first chained from `parent`: the device's last hit, or the root); None when
        there is nothing to fetch."""
        if not keys or not any(s.available for s in self.stores):
            return None  # nothing to fetch, or every store is down: recompute at once
        deadline_s = self.config.fetch_deadline_s
        if deadline_s is None:
            estimate = self.recompute_seconds(len(token_ids))
            deadline_s = 1.0 if estimate is None else max(0.02, 0.75 * estimate)
        keys, checkpoints, num_lead = self._checkpoint_candidates(keys)
        fetch = Fetch(keys, token_ids, time.monotonic() + deadline_s, parent, checkpoints,
                      num_lead)
        if self.shares is not None:
            tenant = self._roots.get(parent, self._key_tenant.get(parent, 0))
            fetch.prefix = tenant_prefix(self._names[tenant])
        self._fetcher.submit(fetch)
        return fetch

    def _checkpoint_candidates(self, keys: list[bytes],
                               ) -> tuple[list[bytes], list[list[bytes]], int]:
        """A run that ends with a state checkpoint's chunks (`HybridAdmission.missing`): the
        run without them, the checkpoint after each of its leading blocks (chunk keys,
        deepest first: a tier may hold an earlier one, a previous turn's last), and the
        number of leading blocks; else the run as it is."""
        states = self.cache.state_group
        if states is None or not keys or not states.owns_value(keys[-1]):
            return keys, [], 0
        run = [key for key in keys if not states.owns_value(key)]
        lead = [key for key in run if len(key) == codec.CHAIN_BYTES]
        return run, [states.tier_keys(key) for key in reversed(lead)], len(lead)

    def start_peer_fetch(self, keys: list[bytes], token_ids: np.ndarray, parent: bytes,
                         peer: Store, deadline: float) -> Fetch:
        """Start fetching `keys` from a hand-off's `peer` alone (`start_fetch`'s arguments),
        whatever the rates say, until `deadline` (monotonic: its lease's end)."""
        fetch = Fetch(keys, token_ids, deadline, parent)
        fetch.peer = peer
        self._fetcher.submit(fetch)
        return fetch

    def land(self, fetch: Fetch, spare_blocks: int) -> int:
        """Load a finished fetch's blocks as cached device blocks (at most `spare_blocks`);
        returns how many, counted as hits of the tiers they came from."""
        loaded = 0
        if fetch.payload is not None and len(fetch.sources):
            n, blocks = self._within(fetch.keys[:len(fetch.sources)], max(0, spare_blocks))
            size = self.cache.config.block_size
            loaded = self.cache.load_cached(fetch.keys[:n], fetch.token_ids[:blocks * size],
                                            fetch.payload[:n], fetch.parent)
            for key, source in zip(fetch.keys[:loaded], fetch.sources[:loaded], strict=True):
                if len(key) == codec.CHAIN_BYTES:  # another layer group's block: same tokens
                    self._hit_tokens[source] += size
                    fetch.loaded[source] = fetch.loaded.get(source, 0) + 1
                if self.shares is not None and fetch.peer is None:
                    self.shares[source].touch([key])
            self._loaded_blocks += loaded
        if fetch.peer is not None:
            return loaded  # a hand-off's: the tiers saw nothing of it
        if self.shares is not None and fetch.failure is not None \
                and fetch.failure[0] == "verify_failed":  # deleted by the fetcher
            self.shares[fetch.failure[1]].forget(fetch.keys[len(fetch.sources):][:1])
        self._observed(fetch, loaded)
        return loaded

    def _within(self, keys: list[bytes], spare_blocks: int) -> tuple[int, int]:
        """How many of `keys` to load with `spare_blocks` blocks (up to the first block
        past them: a state checkpoint's chunks take no block), and how many of those are
        blocks (the tokens loaded are theirs)."""
        states, blocks = self.cache.state_group, 0
        for i, key in enumerate(keys):
            if states is None or not states.owns_value(key):
                if blocks == spare_blocks:
                    return i, blocks
                blocks += 1
        return len(keys), blocks

    def _observed(self, fetch: Fetch, loaded: int) -> None:
        """What a fetch saw of the tiers: its loaded blocks are held where the lookups
        found them (so they are written only to the tiers that lack them); the rest are
        known nowhere any more (missing, failed, or gone since the lookup: when computed
        they are written to every tier again)."""
        self._vanished(fetch)
        for store, found in zip(self.stores, fetch.found, strict=False):
            self._held.add(store.name, [key for key, held in zip(fetch.keys[:loaded], found,
                                                                 strict=False) if held])
            self._held.discard(store.name, [key for key, held in zip(
                fetch.keys[:loaded], found, strict=False) if not held])
        self._held.forget(fetch.keys[loaded:])

    def _vanished(self, fetch: Fetch) -> None:
        """Blocks a tier was known to hold and its lookup missed: the store evicted them
        by itself (Redis' LRU, another replica's flush), remembered as ``global``."""
        for store, found in zip(self.stores, fetch.found, strict=False):
            missed = [key for key, held in zip(fetch.keys, found, strict=False) if not held]
            lacking = set(self._held.lacking(store.name, missed))
            gone = [key for i, key in enumerate(missed) if i not in lacking]
            if self.shares is not None:
                gone = list(dict.fromkeys(gone + self.shares[store.name].forget(missed)))
            self._ghosts.evicted(store.name, [(key, "global", None, 0) for key in gone])

    def fell_back(self, fetch: Fetch) -> None:
        """The engine gave up waiting for `fetch` (its deadline passed): its report names
        the tier it was waiting on (``fetch.failure``)."""
        fetch.cancelled = True
        fetch.tier = fetch.tier or next((s.name for s in self.stores), None)
        fetch.timed_out()
        self._deadline_fallbacks += 1
        self._held.forget(fetch.keys)

    def evicted_entry(self, key: bytes) -> tuple[str, str, str | None] | None:
        """``(tier, pressure, by)`` for a block `key` that a tier evicted recently and no
        tier is known to hold now: the deepest tier that evicted it, whose pressure
        (``own``, ``tenant``, ``global``) and the tenant whose pressure did it (or None)."""
        if self._held.anywhere(key):
            return None
        return self._ghosts.entry(key)

    # -- observation and lifetime -------------------------------------------------------
    def stats(self) -> TiersStats:
        """Counters so far and each tier's contents now."""
        tiers, fetcher = [], self._fetcher
        for store in self.stores:
            blocks, nbytes = store.usage()
            name = store.name
            tiers.append(TierStats(name, blocks, nbytes, self._hit_tokens[name],
                                   fetcher.misses[name], fetcher.verify_failures[name],
                                   self._writer.written_blocks[name],
                                   self._tenant_blocks(name, blocks)))
        return TiersStats(tuple(tiers), self._writer.dropped_writes, self._deadline_fallbacks,
                          fetcher.skipped_fetches, self._loaded_blocks, fetcher.fetches,
                          tuple(fetcher.fetch_seconds))

    def _tenant_blocks(self, tier: str, blocks: int) -> dict[str, int]:
        """Blocks of `tier` by tenant; those the accounting does not know count as ""."""
        if self.shares is None:
            return {"": blocks}
        by_tenant = self.shares[tier].tenant_blocks()
        by_tenant[""] = by_tenant.get("", 0) + max(blocks - sum(by_tenant.values()), 0)
        return by_tenant

    def close(self) -> None:
        """Stop the threads (queued writes are given a moment) and close the stores."""
        self._writer.close()
        self._fetcher.close()
        for store in self.stores:
            with contextlib.suppress(Exception):
                store.close()


def open_tiers(config: TierConfig | None, cache: PagedKVCache,
               model: torch.nn.Module, always: bool = False) -> TierManager | None:
    """The tiers behind `cache`, or None when none is configured; blocks are namespaced by
    `model`'s fingerprint (`identity.model_fingerprint`: its config, and all its weights'
    bytes unless the config names the weights). With `always`, a manager without any store
    when none is configured: a decode engine's hand-offs come through its fetch path."""
    if config is None or not config.enabled:
        if not always:
            return None
        config = TierConfig()  # no store: a decode engine's hand-offs only
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

