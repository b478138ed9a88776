"""`BlockAllocator`: block ids, refcounts, the prefix-cache index and eviction order.

It never sees a tensor. Every block but the null block 0 is in exactly one state:

- *live*   refcount > 0, owned by one or more sequences;
- *cached* refcount 0 but holding a full, indexed block a later prefix can reuse (evictable);
- *free*   refcount 0, nothing worth keeping.

Free blocks are handed out first (a stack: O(1) pop and push); which cached block goes
when one must is the eviction policy's choice (`paged_kv.core.eviction`): by default the
least recently freed (`LruEviction`), under a tenant policy the tenant ledger's
(`paged_kv.tenants.eviction_for`). The allocator calls the policy's interface alone and
never asks which one it holds. A sequence's blocks are freed tail first, so its tail is
evicted before the prefix that other sequences are likelier to share.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Iterable

import numpy as np

from .._checks import read_only
from ..errors import OutOfBlocksError, ensure
from ..keys import BlockEvent, chain_pieces, hash_pieces, split_blocks
from .eviction import EvictionPolicy, GhostList, LruEviction
from .prefix_index import PrefixIndex, Tag

NULL_BLOCK = 0


class BlockAllocator:
    """Hands out block ids of a pool of `num_blocks` (block 0 reserved), counts owners.

    Parameters
    ----------
    num_blocks : int
        Blocks in the pool, the null block included.
    enable_prefix_caching : bool
        Keep freed full blocks indexed (cached) instead of freeing them.
    max_events : int
        Events kept until `take_events` drains them; older ones are dropped.
    eviction : EvictionPolicy, optional
        Owns the cached blocks and chooses which go (with the ghost list that names a
        miss's cause); None: `LruEviction`, one least-recently-freed order. A tenant
        policy's is `paged_kv.tenants.eviction_for(policy, num_blocks)`.

    Examples
    --------
    >>> allocator = BlockAllocator(8)
    >>> allocator.allocate(3).tolist()
    [1, 2, 3]
    >>> allocator.num_free_blocks  # 7 usable - 3
    4
    """

    def __init__(self, num_blocks: int, *, enable_prefix_caching: bool = True,
                 max_events: int = 65536, eviction: EvictionPolicy | None = None) -> None:
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self._refcount = np.zeros(num_blocks, dtype=np.int32)
        self._free: list[int] = list(range(num_blocks - 1, 0, -1))  # pop() gives 1, 2, ...
        # the cached blocks (``self._eviction.cached``, read here, changed by the policy
        # alone) and their eviction order
        self._eviction: EvictionPolicy = (LruEviction(num_blocks) if eviction is None
                                          else eviction)
        # the prefix index (key -> block, each block's key and tokens: `PrefixIndex`) and
        # its indexed flags, changed by the index alone
        self._prefix = PrefixIndex(num_blocks)
        self._indexed = self._prefix.indexed
        # shared or indexed: a write must copy it first (kept up to date by every mutator,
        # so a decode step tests its last blocks with one lookup)
        self._protected = np.zeros(num_blocks, dtype=bool)
        self._views = tuple(map(read_only, (self._refcount, self._indexed, self._protected)))
        self._prefix_tokens = [0, 0]  # prompt tokens looked up, and found cached (cumulative)
        # bounded, so a user who never drains events does not leak memory; each is kept as
        # the arguments of its BlockEvent (lists this class made and never changes again),
        # built when taken: most steps log three and a frozen dataclass costs ~1 us to make
        self._events: collections.deque[tuple] = collections.deque(maxlen=max_events)

    # -- queries --------------------------------------------------------------------------
    @property
    def refcount(self) -> np.ndarray:
        """Read-only view of the per-block owner counts ``[num_blocks]``."""
        return self._views[0]

    @property
    def indexed(self) -> np.ndarray:
        """Read-only ``[num_blocks]`` bool: the block is in the prefix index."""
        return self._views[1]

    @property
    def protected(self) -> np.ndarray:
        """Read-only ``[num_blocks]`` bool: shared (refcount > 1) or indexed, so writing into
        the block must copy it first."""
        return self._views[2]

    @property
    def num_free_blocks(self) -> int:
        """Free blocks (empty, handed out first)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Cached blocks: unowned but indexed, evictable in the eviction policy's order."""
        return len(self._eviction.cached)

    @property
    def num_obtainable_blocks(self) -> int:
        """Blocks `allocate` can hand out now to a step mixing tenants: `obtainable` with
        every reservation kept out."""
        return self.obtainable(None)

    def obtainable(self, root: bytes | None = None) -> int:
        """Blocks a request under salted root `root` can take now: free plus evictable
        cached, less the blocks the policy keeps from it (other tenants' reservations; its
        own counts for it). None: a step mixing tenants, kept from every reservation. The
        one place the capacity number is made (`allocate` checks against it)."""
        eviction = self._eviction
        return len(self._free) + len(eviction.cached) - eviction.held(root)

    @property
    def tenants(self) -> object | None:
        """The cached blocks by tenant (read it: `paged_kv.tenants.TenantEviction`), or
        None under a policy without tenants."""
        return self._eviction.tenants

    @property
    def ghost(self) -> GhostList:
        """Recently evicted keys and seen parents (the eviction policy's):
        `GhostList.miss` names a miss's cause."""
        return self._eviction.ghost

    @property
    def num_live_blocks(self) -> int:
        """Blocks with at least one owner."""
        return self.num_blocks - 1 - len(self._free) - len(self._eviction.cached)

    @property
    def prefix_query_tokens(self) -> int:
        """Prompt tokens whose prefix was looked up by a sequence that was then added."""
        return self._prefix_tokens[0]

    @property
    def prefix_hit_tokens(self) -> int:
        """Of those, tokens found cached."""
        return self._prefix_tokens[1]

    def count_prefix_lookup(self, num_tokens: int, num_hit: int) -> None:
        """Count one admitted prompt of `num_tokens`, `num_hit` of them found cached."""
        self._prefix_tokens[0] += num_tokens
        self._prefix_tokens[1] += num_hit

    def count_cached(self, block_ids: list[int]) -> int:
        """How many of `block_ids` are cached (unowned, evictable)."""
        return sum(map(self._eviction.cached.__contains__, block_ids))

    def can_allocate(self, num_blocks: int) -> bool:
        """Whether `allocate(num_blocks)` would succeed now."""
        return num_blocks <= self.num_obtainable_blocks

    def block_hash(self, block_id: int) -> bytes | None:
        """The prefix key `block_id` is indexed under, or None."""
        return self._prefix.block_hash(block_id)

    def is_indexed(self, key: bytes) -> bool:
        """Whether a block is indexed under `key` (cached or in use)."""
        return key in self._prefix

    def lookup(self, key: bytes, token_ids: bytes) -> int | None:
        """Block indexed under `key` whose tokens equal `token_ids`, else None."""
        return self._prefix.lookup(key, token_ids)

    def match(self, token_ids: bytes, num_blocks: int, keys: list[bytes], parent_key: bytes,
              ) -> tuple[list[int], list[bytes]]:
        """The cached blocks of the longest prefix of `token_ids`, and the keys known now
        (`PrefixIndex.match`, whose docstring says how keys given and keys hashed combine)."""
        return self._prefix.match(token_ids, num_blocks, keys, parent_key)

    # -- mutators -------------------------------------------------------------------------
    def allocate(self, num_blocks: int, requester: bytes | None = None) -> np.ndarray:
        """Take `num_blocks` blocks (refcount 1), free ones first, then cached ones the
        eviction policy gives up (for `requester`, the salted root of the tenant asking:
        None for a step that mixes tenants; a tenant policy decides whose blocks may go).

        Returns
        -------
        np.ndarray
            ``[num_blocks]`` int64 block ids.

        Raises
        ------
        OutOfBlocksError
            Fewer than `num_blocks` obtainable; nothing changed.
        """
        obtainable = self.obtainable(requester)
        if num_blocks > obtainable:
            raise OutOfBlocksError(num_blocks, obtainable, "allocate()")
        free = self._free
        start = max(len(free) - num_blocks, 0)
        taken = free[start:]
        taken.reverse()
        del free[start:]
        if len(taken) < num_blocks:
            taken += self._eviction.evict(num_blocks - len(taken), requester, self._unindex)
        ids = np.array(taken, dtype=np.int64)
        self._refcount[ids] = 1  # a free block is neither protected nor indexed already
        self._events.append(("allocated", taken))
        return ids

    def _unindex(self, evicted: list[int]) -> list[bytes]:
        """Take evicted blocks (the policy's, no longer cached) out of the index; returns
        their keys (the policy's ``forget``)."""
        ids = np.array(evicted, dtype=np.int64)  # converted once for both flag arrays
        gone = self._prefix.remove(evicted, ids)
        self._protected[ids] = False
        self._events.append(("evicted", evicted, gone))
        return gone

    def share(self, block_ids: Iterable[int] | np.ndarray) -> None:
        """Add one owner to each of `block_ids` (distinct, live or cached): fork and prefix hits."""
        ids = np.asarray(block_ids, dtype=np.int64)
        cached = self._eviction.cached  # a distinct live or cached block: cached iff unowned
        revived = list(filter(cached.__contains__, block_ids if type(block_ids) is list
                              else ids.tolist()))
        if revived:
            self._eviction.uncache(revived)
            self._events.append(("hit", revived))
        self._refcount[ids] += 1
        self._protected[ids] = True  # now shared, or a revived cached block (indexed)

    def free(self, block_ids: Iterable[int] | np.ndarray, *, unique: bool = False,
             priority: int | None = None, retention_seconds: float | None = None,
             root: bytes | None = None) -> None:
        """Drop one owner per entry of `block_ids` (a repeated id drops one owner per entry;
        ``unique=True`` promises there is none, which saves a slower scatter).

        Blocks left with no owner become cached when indexed, free otherwise; they are
        released tail first, so the tail is evicted first and the prefix outlives it. The
        eviction policy takes the newly cached ones: under a tenant policy, `priority` and
        `retention_seconds` (None: the tenant's defaults) retain their head, and a tenant
        past its quota loses its oldest cached blocks at once. `root` is the salted root
        every indexed block of `block_ids` chains from (one sequence's blocks: the policy
        need not look each one's tenant up), or None.
        """
        ids = np.asarray(block_ids, dtype=np.int64)
        if ids.size == 0:
            return
        owners = self._refcount[ids]
        # a block of one owner is in `block_ids` once, so when each has one the ids are
        # distinct without the caller's promise (a window's give-back of a decode step's
        # ~64 blocks: ~19 us against ~30 us)
        if not unique and not (owners == 1).all():
            np.subtract.at(self._refcount, ids, 1)
            left = self._refcount[ids]
        else:  # one gather and one scatter, not a read-modify-write per use
            unique, left = True, owners - 1
            self._refcount[ids] = left
        indexed = self._indexed[ids]
        if left.any():  # some blocks keep owners: only the unowned are released
            self._protected[ids] = (left > 1) | indexed
            gone = left == 0
            ids, indexed = ids[gone], indexed[gone]
        else:  # the sole owner of every block (a finished sequence, the common case)
            self._protected[ids] = indexed
        released, flags = ids[::-1].tolist(), indexed[::-1].tolist()
        if not unique:
            first = dict(zip(released, flags, strict=True))  # one entry per block
            released, flags = list(first), list(first.values())
        cached = list(itertools.compress(released, flags))
        freed = [b for b, flag in zip(released, flags, strict=True) if not flag]
        self._free.extend(freed)
        if cached:
            self._events.append(("cached", cached))
        if freed:
            self._events.append(("freed", freed))
        if cached:
            self._release(self._eviction.cache(cached, priority, retention_seconds,
                                               self._unindex, root))

    def _release(self, evicted: list[int]) -> None:
        """Free cached blocks the policy evicted (out of it and the index already)."""
        if evicted:
            self._free.extend(evicted)
            self._events.append(("freed", list(evicted)))

    def flush_tenant(self, root: bytes, *, retention_only: bool = False) -> int:
        """Evict every cached block of the tenant whose salted root is `root` (an admin
        flush; its live blocks stay), or with `retention_only` end the soft retention of
        the blocks it retains (they become its oldest ordinary ones); returns how many.
        A policy without tenants retains nothing and flushes nothing (0)."""
        if retention_only:
            return self._eviction.unretain(root)
        dropped = self._eviction.flush(root, self._unindex)
        self._release(dropped)
        return len(dropped)

    def register(self, block_id: int, key: bytes, token_ids: bytes,
                 parent_key: bytes = b"") -> bool:
        """Index a live, full block under `key` (chained from `parent_key`, which events
        report); False when that key is already indexed."""
        if not self.enable_prefix_caching or key in self._prefix:
            return False
        self._insert([key], [block_id], [token_ids], [parent_key], token_ids)
        return True

    def register_keyed(self, block_ids: list[int], keys: list[bytes], pieces: list[bytes],
                       parent_keys: list[bytes]) -> None:
        """`register` of several live, full blocks in one index update: ``block_ids[i]``
        holds ``pieces[i]`` (its token bytes) and is indexed under ``keys[i]``, chained
        from ``parent_keys[i]``. A key indexed already, or met earlier in the list, keeps
        its block, as calling `register` on each in order would; the blocks that join make
        one stored event, not one each.

        Another layer group mirrors a step's filled blocks under the leader's keys this
        way: one index update a step instead of ~5 us a block (~64 a step at 1,024 rows).
        """
        if self.enable_prefix_caching and keys:
            self._insert(keys, block_ids, pieces, parent_keys, b"".join(pieces))

    def register_blocks(self, block_ids: list[int], parent_keys: list[bytes],
                        token_ids: bytes, pieces: list[bytes] | None = None) -> list[bytes]:
        """Key and index full blocks whose parents' keys are known: ``block_ids[i]`` holds
        slice i of `token_ids` (equal slices, little-endian int32) and chains from
        ``parent_keys[i]``. Returns the keys; an already indexed key is left as it is.
        `pieces`: the slices, when the caller cut them already.

        One call per step: the hashes in one comprehension (`keys.hash_pieces`) and the
        index updated in bulk, so the per-block work is a hash and a few C-level dict
        stores.
        """
        if pieces is None:
            pieces = split_blocks(token_ids, len(block_ids))
        keys = hash_pieces(parent_keys, pieces)
        if self.enable_prefix_caching and keys:
            self._insert(keys, block_ids, pieces, parent_keys, token_ids)
        return keys

    def register_chain(self, block_ids: list[int], parent_key: bytes, token_ids: bytes,
                       known: list[bytes] = (), pieces: list[bytes] | None = None,
                       ) -> list[bytes]:
        """Key and index consecutive full blocks of one sequence: ``block_ids[0]`` chains
        from `parent_key`, each next one from the key before it; ``block_ids[i]`` holds
        slice i of `token_ids` (equal slices, little-endian int32). `known` are the keys of
        the first blocks when already hashed (the request's keys), `pieces` the slices when
        already cut (they are the blocks' bytes the index keeps). Returns the keys."""
        known = list(known[: len(block_ids)])
        if pieces is None:
            pieces = split_blocks(token_ids, len(block_ids))
        if len(known) == len(block_ids):  # every key known: nothing to hash
            keys = known
        else:
            keys = known + chain_pieces(known[-1] if known else parent_key,
                                        pieces[len(known):])
        if self.enable_prefix_caching and keys:
            self._insert(keys, block_ids, pieces, [parent_key, *keys[:-1]], token_ids,
                         self._eviction.tag_chain)
        return keys

    def _insert(self, keys: list[bytes], block_ids: list[int], pieces: list[bytes],
                parents: list[bytes], token_ids: bytes, tag: Tag | None = None) -> None:
        """Index blocks in bulk (``block_ids[i]`` holds ``pieces[i]``, the slices of
        `token_ids`, and chains from ``parents[i]``); a key indexed before (or twice here)
        keeps its first block. `tag`: the policy's for these blocks (its `tag_chain` for
        one chain; None: its `tag`)."""
        stored = self._prefix.insert(keys, block_ids, pieces, parents, token_ids,
                                     self._eviction.tag if tag is None else tag)
        if stored is not None:
            self._protected[stored[0]] = True  # the joined blocks' array: no list to convert
            self._events.append(("stored", *stored[1:]))

    def unregister(self, block_ids: Iterable[int] | np.ndarray) -> int:
        """Take `block_ids` out of the prefix index (those not indexed are skipped): their
        K/V was never written, so no later prefix may find them. A cached one becomes free.
        Returns how many left the index."""
        ids = [b for b in dict.fromkeys(np.asarray(block_ids, dtype=np.int64).tolist())
               if self._indexed[b]]
        keys = self._prefix.remove(ids)
        cached = list(filter(self._eviction.cached.__contains__, ids))
        if cached:  # unowned: free now
            self._eviction.uncache(cached)
            self._free.extend(cached)
        if ids:
            self._protected[ids] = self._refcount[ids] > 1
            self._events.append(("removed", ids, keys))
        return len(ids)

    def reset_prefix_cache(self) -> int:
        """Free every cached block and empty the index; returns how many blocks were dropped."""
        dropped = list(self._eviction.cached)
        self._eviction.clear()
        self._free.extend(reversed(dropped))
        self._prefix.clear()
        np.greater(self._refcount, 1, out=self._protected)
        if dropped:
            self._events.append(("freed", dropped))
        self._events.append(("cleared", ()))
        return len(dropped)

    def take_events(self) -> list[BlockEvent]:
        """Return and clear the events logged since the last call."""
        # rest: keys (a list or tuple), then a stored event's parents and token bytes
        events = [BlockEvent(kind, tuple(ids), *map(tuple, rest[:2]), *rest[2:])
                  for kind, ids, *rest in self._events]
        self._events.clear()
        return events

    # -- checking -------------------------------------------------------------------------
    def snapshot(self) -> tuple:
        """Comparable copy of the whole state (for tests of rejected calls)."""
        return (self._refcount.tobytes(), tuple(self._free), tuple(self._eviction.cached),
                *self._prefix.snapshot(), tuple(self._prefix_tokens), self._eviction.snapshot())

    def check_invariants(self, owners: np.ndarray | None = None) -> None:
        """Raise `InvariantError` if the block states do not partition the pool.

        Parameters
        ----------
        owners : np.ndarray, optional
            ``[num_blocks]`` count of page-table rows holding each block; compared with the
            refcounts when given.
        """
        free, cached = self._free, list(self._eviction.cached)
        live = np.flatnonzero(self._refcount > 0).tolist()
        everything = free + cached + live
        ensure(len(set(everything)) == len(everything), "a block is in two states")
        ensure(sorted(everything) == list(range(1, self.num_blocks)), "blocks leaked or invented")
        ensure(self._refcount.min() >= 0, "negative refcount")
        ensure(self._refcount[NULL_BLOCK] == 0, "the null block was handed out")
        self._prefix.check(free, cached)
        ensure(np.array_equal(self._protected, (self._refcount > 1) | self._indexed),
               "the write-protected flags disagree with refcounts and the index")
        self._eviction.check()
        if owners is not None:
            bad = np.flatnonzero(owners != self._refcount)
            ensure(bad.size == 0,
                   f"refcount differs from owners for blocks {bad[:8].tolist()}: "
                   f"{self._refcount[bad[:8]].tolist()} vs {owners[bad[:8]].tolist()}")

