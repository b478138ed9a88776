"""`PagedKVCache`: the facade that composes the three owners.

    BlockAllocator  block ids, refcounts, prefix index, eviction   (ints, never tensors)
    PageTables      per-sequence rows of block ids and token counts (numpy rows)
    KVPool          the one preallocated K/V tensor and the host pool

Every public mutator validates everything first and only then changes state, so a rejected
call leaves allocator, tables and pool exactly as they were.
"""

from __future__ import annotations

import os
from collections.abc import Hashable, Mapping, Sequence

import numpy as np
import torch

from ._tensor_ops import TensorOps
from ._tokens import Step, parse_step, tokens_to_array
from .accounting import CacheStats, compute_stats
from .allocator import BlockAllocator, encode_tokens, root_hash
from .config import CacheConfig
from .errors import InvariantError, OutOfBlocksError, PagedKVError
from .kernels.quant import raw
from .page_table import PageTables, SeqId, StepBatch
from .pool import KVPool
from .prefix import index_filled_blocks, index_full_blocks, index_row_blocks, lookup_prefix

_NO_BLOCKS = np.empty(0, dtype=np.int64)


class PagedKVCache(TensorOps):
    """A paged KV cache for many sequences at once.

    Parameters
    ----------
    config : CacheConfig
        Pool shape, dtype, device, prefix caching, host pool size.

    Examples
    --------
    >>> cfg = CacheConfig(num_layers=1, num_kv_heads=2, head_dim=8, block_size=4,
    ...                   num_blocks=16, dtype=torch.float32)
    >>> cache = PagedKVCache(cfg)
    >>> cache.add_sequence("a", [1, 2, 3, 4, 5])
    0
    >>> batch = cache.prepare({"a": [1, 2, 3, 4, 5]})
    >>> batch.slot_mapping.tolist()  # block 1 holds tokens 0-3, block 2 token 4
    [4, 5, 6, 7, 8]
    >>> k = torch.randn(5, 2, 8)
    >>> cache.write(0, k, -k, batch)
    >>> keys, values = cache.gather(0, ["a"])
    >>> torch.equal(keys[0], k)
    True
    >>> cache.stats().num_live_blocks, cache.stats().num_empty_slots
    (2, 3)
    """

    def __init__(self, config: CacheConfig) -> None:
        if not isinstance(config, CacheConfig):
            raise TypeError(f"config: expected a CacheConfig, got {type(config).__name__}")
        self.config = config
        self._allocator = BlockAllocator(config.num_blocks,
                                         enable_prefix_caching=config.enable_prefix_caching)
        self._tables = PageTables(config.block_size, config.max_num_seqs)
        self._pool = KVPool(config)
        self._host_allocator = (BlockAllocator(config.num_host_blocks + 1,
                                               enable_prefix_caching=False)
                                if config.num_host_blocks else None)
        self._swapped_keys: dict[SeqId, list[bytes | None]] = {}
        self._roots: dict[SeqId, bytes] = {}  # each sequence's salted root key
        self._prefix_query_tokens = 0
        self._prefix_hit_tokens = 0
        self._num_preemptions = 0
        self._debug = os.environ.get("PAGED_KV_DEBUG") == "1"
        self._workspace = torch.empty(0, dtype=config.dtype, device=config.device)

    # -- read-only views of the owners ----------------------------------------------------
    @property
    def allocator(self) -> BlockAllocator:
        """The block-id owner (read it; mutate only through the cache)."""
        return self._allocator

    @property
    def tables(self) -> PageTables:
        """The per-sequence rows (read it; mutate only through the cache)."""
        return self._tables

    @property
    def pool(self) -> KVPool:
        """The K/V tensors."""
        return self._pool

    @property
    def seq_ids(self) -> tuple[SeqId, ...]:
        """Sequences in the cache, in insertion order."""
        return self._tables.seq_ids

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._tables

    def seq_len(self, seq_id: SeqId) -> int:
        """Tokens of `seq_id` written or reserved so far."""
        self._require_known("seq_len()", seq_id)
        return self._tables.num_tokens_of(seq_id)

    def can_allocate(self, num_blocks: int) -> bool:
        """Whether `num_blocks` blocks are obtainable now (free plus evictable cached)."""
        return self._allocator.can_allocate(num_blocks)

    def is_swapped(self, seq_id: SeqId) -> bool:
        """Whether `seq_id`'s blocks are in the host pool."""
        self._require_known("is_swapped()", seq_id)
        return bool(self._tables.swapped[self._tables.row_of[seq_id]])

    # -- sequence lifecycle ---------------------------------------------------------------
    def add_sequence(self, seq_id: SeqId, prompt_token_ids: Sequence[int] | None = None, *,
                     salt: str | None = None) -> int:
        """Register a sequence and map its longest cached prefix of full blocks.

        Parameters
        ----------
        seq_id : hashable
            New, unique id.
        prompt_token_ids : sequence of int, optional
            The prompt, only looked up here; its tokens arrive through `prepare`.
        salt : str, optional
            Isolates prefix reuse between tenants.

        Returns
        -------
        int
            Tokens already cached (a multiple of ``block_size``, always below the prompt's
            length so the last prompt token is computed); `seq_len` is now that number.
        """
        self._require_new("add_sequence()", seq_id)
        tokens = (None if prompt_token_ids is None
                  else tokens_to_array("prompt_token_ids", prompt_token_ids))
        chain, hits = self._lookup(tokens, salt)
        self._add(seq_id, tokens, salt, chain, hits)
        self._after_mutation()
        return len(hits) * self.config.block_size

    def admit(self, seq_id: SeqId, prompt_token_ids: Sequence[int], *,
              max_tokens: int | None = None, salt: str | None = None,
              ) -> tuple[int, StepBatch]:
        """`add_sequence` and the `prepare` of the prompt's next tokens, as one call: the
        prompt is converted and hashed once, and the admission is all or nothing.

        Parameters
        ----------
        seq_id : hashable
            New, unique id.
        prompt_token_ids : sequence of int
            The prompt (at least one token).
        max_tokens : int, optional
            Prepare at most this many tokens after the cached prefix (a prefill chunk);
            default: the rest of the prompt.
        salt : str, optional
            Isolates prefix reuse between tenants.

        Returns
        -------
        (int, StepBatch)
            Tokens found cached, and the step batch of the tokens prepared after them.

        Raises
        ------
        OutOfBlocksError
            Not enough blocks for the prepared tokens; the sequence was not added and
            nothing changed.

        Examples
        --------
        >>> cache = PagedKVCache(CacheConfig(num_layers=1, num_kv_heads=1, head_dim=4,
        ...                                  block_size=4, num_blocks=8))
        >>> hit, batch = cache.admit("a", [1, 2, 3, 4, 5])
        >>> hit, batch.slot_mapping.tolist()
        (0, [4, 5, 6, 7, 8])
        """
        self._require_new("admit()", seq_id)
        tokens = tokens_to_array("admit(): prompt_token_ids", prompt_token_ids)
        if not len(tokens):
            raise ValueError("admit(): empty prompt; give at least one token")
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(
                max_tokens, int) or max_tokens < 1):
            raise ValueError(f"admit(): max_tokens must be an int >= 1, got {max_tokens!r}")
        chain, hits = self._lookup(tokens, salt)
        block_size, allocator = self.config.block_size, self._allocator
        num_hit = len(hits) * block_size
        count = len(tokens) - num_hit
        if max_tokens is not None:
            count = min(count, max_tokens)
        requested = -(-(num_hit + count) // block_size) - len(hits)
        # cached hits leave the evictable set when this sequence takes them
        revived = int(np.count_nonzero(allocator.refcount[hits] == 0)) if hits else 0
        obtainable = allocator.num_obtainable_blocks - revived
        if requested > obtainable:
            raise OutOfBlocksError(requested, obtainable, "admit()")
        row = self._add(seq_id, tokens, salt, chain, hits)
        step = Step((seq_id,), np.array([row]), np.array([count]), np.ones(1, dtype=bool),
                    tokens[num_hit:num_hit + count])
        return num_hit, self._prepare_one(step)

    def _lookup(self, tokens: np.ndarray | None, salt: str | None) -> tuple[bytes | None,
                                                                            list[int]]:
        """The salted chain after the longest cached prefix of `tokens`, and its blocks."""
        chain = root_hash(salt)  # also the salt's check, with prefix caching off too
        if not self.config.enable_prefix_caching:
            return None, []
        if tokens is None or not len(tokens):
            return chain, []
        return lookup_prefix(self._allocator, chain, tokens, self.config.block_size)

    def _add(self, seq_id: SeqId, tokens: np.ndarray | None, salt: str | None,
             chain: bytes | None, hits: list[int]) -> int:
        """Commit a new sequence's row with its prefix hits; returns the row."""
        row = self._tables.add(seq_id, chain)
        if self.config.enable_prefix_caching:
            self._roots[seq_id] = root_hash(salt)
        num_hit = len(hits) * self.config.block_size
        if hits:
            self._allocator.share(hits)
            self._tables.extend_row(row, 0, num_hit, np.array(hits), tokens[:num_hit])
        if tokens is not None and chain is not None:
            self._prefix_query_tokens += len(tokens)
            self._prefix_hit_tokens += num_hit
        return row

    def match_prefix(self, prompt_token_ids: Sequence[int], *, salt: str | None = None) -> int:
        """Tokens `add_sequence` would find cached for this prompt now; changes nothing
        (no counters either), so a scheduler can size a request before admitting it."""
        tokens = tokens_to_array("prompt_token_ids", prompt_token_ids)
        if not self.config.enable_prefix_caching or not len(tokens):
            return 0
        hits = lookup_prefix(self._allocator, root_hash(salt), tokens, self.config.block_size)[1]
        return len(hits) * self.config.block_size

    def fork(self, parent: SeqId, child: SeqId) -> None:
        """Make `child` share all of `parent`'s blocks; the first write into a shared,
        partly filled block copies it (copy-on-write)."""
        self._require_resident("fork()", parent)
        self._require_new("fork()", child)
        self._tables.fork(parent, child)
        if parent in self._roots:
            self._roots[child] = self._roots[parent]
        self._allocator.share(self._tables.blocks(child))
        self._after_mutation()

    def truncate(self, seq_id: SeqId, num_tokens: int) -> None:
        """Keep only the first `num_tokens` tokens of a resident sequence (speculative
        decoding rollback, ``crop``); blocks past them are released, tail first.

        The sequence keeps extending its prefix-index chain only while its last kept full
        block is still indexed. A kept block that becomes partial but stays indexed is
        copied before it is written again (see `prepare`), so its cached prefix survives.
        """
        self._require_resident("truncate()", seq_id)
        current = self._tables.num_tokens_of(seq_id)
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int | np.integer):
            raise TypeError(f"truncate(): num_tokens must be an int, got {num_tokens!r}")
        if not 0 <= num_tokens <= current:
            raise ValueError(f"truncate(): num_tokens must be in [0, {current}] for "
                             f"{seq_id!r}, got {num_tokens}")
        num_full = num_tokens // self.config.block_size
        if self._tables.chain(self._tables.row_of[seq_id]) is None:
            chain = None  # ids unknown somewhere (or no prefix caching): never index again
        elif num_full == 0:
            chain = self._roots.get(seq_id)
        else:
            chain = self._allocator.block_hash(int(self._tables.blocks(seq_id)[num_full - 1]))
        self._allocator.free(self._tables.truncate(seq_id, int(num_tokens), chain), unique=True)
        self._after_mutation()

    def free(self, seq_id: SeqId) -> None:
        """Release `seq_id`: full indexed blocks become cached (evictable), the rest free."""
        if seq_id not in self._tables:
            raise KeyError(f"free(): unknown sequence {seq_id!r} (never added, or double free?)")
        self._roots.pop(seq_id, None)
        if self.is_swapped(seq_id):
            self._host_allocator.free(self._tables.remove(seq_id), unique=True)
            del self._swapped_keys[seq_id]
        else:
            self._allocator.free(self._tables.remove(seq_id), unique=True)
        self._after_mutation()

    def reset_prefix_cache(self) -> int:
        """Free every cached block and empty the prefix index; returns blocks dropped."""
        dropped = self._allocator.reset_prefix_cache()
        self._after_mutation()
        return dropped

    # -- a step ---------------------------------------------------------------------------
    def prepare(self, new_tokens: Mapping[SeqId, Sequence[int] | int]) -> StepBatch:
        """Reserve slots for each sequence's new tokens and build the step's `StepBatch`.

        Parameters
        ----------
        new_tokens : mapping of seq_id to token ids or a count
            At least one token each; a count means ids unknown (such blocks are never
            indexed for reuse). Rows and tokens follow the mapping's order.

        Returns
        -------
        StepBatch

        Raises
        ------
        OutOfBlocksError
            The step needs more blocks than obtainable; nothing changed.
        KeyError, TypeError, ValueError
            Unknown or swapped-out sequence, bad token ids or counts; nothing changed.
        """
        step = parse_step(new_tokens, self._tables)
        if step.is_decode:
            batch = self._prepare_decode(step.seq_ids, step.rows, step.token_ids)
            if batch is not None:
                return batch
        if step.rows.size == 1:
            return self._prepare_one(step)
        return self._prepare_general(step)

    def _prepare_one(self, step: Step) -> StepBatch:
        """`prepare` for a single sequence (an admission's prefill, a lone chunk) in scalar
        arithmetic: the general path's array bookkeeping costs more than it saves at B = 1."""
        tables, allocator, block_size = self._tables, self._allocator, self.config.block_size
        row, count = int(step.rows[0]), int(step.counts[0])
        old_len = int(tables.num_tokens[row])
        new_len = old_len + count
        have, need = int(tables.num_blocks[row]), -(-new_len // block_size)
        copy = old_len % block_size != 0 and bool(
            self._must_copy(tables.block_ids[row, have - 1]))
        requested = need - have + copy
        if requested > allocator.num_obtainable_blocks:
            raise OutOfBlocksError(requested, allocator.num_obtainable_blocks)
        # commit
        new_ids = allocator.allocate(requested) if requested else np.empty(0, np.int64)
        if copy:  # copy-on-write of the partly filled last block
            source = tables.block_ids[row, have - 1: have].astype(np.int64)
            self._pool.copy(source, new_ids[:1])
            tables.replace_blocks(np.array([row]), np.array([have - 1]), new_ids[:1])
            allocator.free(source, unique=True)
            new_ids = new_ids[1:]
        known = bool(step.has_ids[0])
        tables.extend_row(row, old_len, new_len, new_ids, step.token_ids if known else None)
        if not known:
            tables.set_chain(row, None)
        elif self.config.enable_prefix_caching:
            index_row_blocks(allocator, tables, row, old_len // block_size,
                             new_len // block_size, block_size)
        block_table = tables.block_ids[row: row + 1, :need].copy()
        first = old_len % block_size
        slots = (block_table[0, old_len // block_size:].astype(np.int64)[:, None] * block_size
                 + np.arange(block_size)).ravel()[first: first + count]
        batch = StepBatch.from_host(step.seq_ids, block_table, np.array([need]),
                                    np.array([new_len]), np.array([0, count]), slots, count,
                                    count, block_size, self.config.device)
        self._after_mutation()
        return batch

    def _prepare_general(self, step: Step) -> StepBatch:
        """`prepare` for any step: prefill chunks, counts, copy-on-write."""
        tables, allocator, block_size = self._tables, self._allocator, self.config.block_size
        rows = step.rows
        old_lens = tables.num_tokens[rows]
        new_lens = old_lens + step.counts
        num_new_blocks, (cow_rows, cow_columns, cow_src) = self._count_blocks(step)
        requested = int(num_new_blocks.sum()) + len(cow_rows)
        if requested > allocator.num_obtainable_blocks:
            raise OutOfBlocksError(requested, allocator.num_obtainable_blocks)

        new_ids = allocator.allocate(requested) if requested else np.empty(0, np.int64)
        if len(cow_rows):
            copies = new_ids[: len(cow_rows)]
            self._pool.copy(cow_src, copies)
            tables.replace_blocks(cow_rows, cow_columns, copies)
            allocator.free(cow_src)
        tables.append_blocks(rows, num_new_blocks, new_ids[len(cow_rows):])
        tables.set_num_tokens(rows, new_lens)
        if step.token_ids is not None:
            tables.set_token_ids(step.token_rows, step.token_positions(old_lens),
                                 step.token_ids)
        for row in step.rows_without_ids:
            tables.set_chain(int(row), None)
        if self.config.enable_prefix_caching:
            index_full_blocks(allocator, tables, rows, old_lens, new_lens, block_size)
        return self._finish_step(step, new_lens)

    def rows_of(self, seq_ids: Sequence[SeqId]) -> np.ndarray:
        """Row handles of resident sequences for `prepare_decode`, ``[B]`` int64, read-only.

        The same array comes back while no sequence is added, freed or swapped, so a
        running batch resolves its handles once and the decode step skips re-validating them.
        """
        seq_ids = tuple(seq_ids)
        try:
            rows = self._tables.rows_of(seq_ids)
        except KeyError as exc:
            raise KeyError(f"rows_of(): unknown sequence {exc.args[0]!r}") from None
        self._tables.resolve_rows("rows_of()", rows)
        return rows

    def prepare_decode(self, rows: np.ndarray, token_ids: np.ndarray | torch.Tensor | None,
                       ) -> StepBatch:
        """`prepare` for one new token per sequence, given as arrays: the decode step.

        Parameters
        ----------
        rows : np.ndarray
            ``[B]`` row handles from `rows_of` (each sequence once, resident).
        token_ids : np.ndarray or torch.Tensor or None
            ``[B]`` int, the new token of each row; None when the ids are unknown (as a
            count of 1 in `prepare`: those rows' blocks are never indexed for reuse).

        Returns
        -------
        StepBatch
            As `prepare` of ``{seq_id: [token]}`` in the order of `rows`, and the same
            state changes (copy-on-write, prefix indexing, all or nothing).

        Examples
        --------
        >>> cache = PagedKVCache(CacheConfig(num_layers=1, num_kv_heads=1, head_dim=4,
        ...                                  block_size=4, num_blocks=8))
        >>> for s in ("a", "b"):
        ...     _ = cache.add_sequence(s, [1, 2, 3])
        ...     _ = cache.prepare({s: [1, 2, 3]})
        >>> rows = cache.rows_of(["a", "b"])
        >>> cache.prepare_decode(rows, np.array([7, 8])).slot_mapping.tolist()
        [7, 11]
        """
        rows, seq_ids = self._tables.resolve_rows("prepare_decode()", rows)
        tokens = None
        if token_ids is not None:
            tokens = tokens_to_array("prepare_decode(): token_ids", token_ids)
            if tokens.shape != rows.shape:
                raise ValueError(f"prepare_decode(): token_ids: expected shape {rows.shape} "
                                 f"(one per row), got {tokens.shape}")
        batch = self._prepare_decode(seq_ids, rows, tokens)
        if batch is None:
            known = np.full(rows.size, tokens is not None)
            batch = self._prepare_general(Step(
                seq_ids, rows, np.ones(rows.size, dtype=np.int64), known,
                tokens if tokens is not None else np.empty(0, dtype=np.int32)))
        return batch

    def _prepare_decode(self, seq_ids: tuple[SeqId, ...], rows: np.ndarray,
                        token_ids: np.ndarray | None) -> StepBatch | None:
        """`prepare` for one known token per sequence, the steady state, in a few array ops.

        Returns None (the general path takes over) when a last block must be copied.
        """
        tables, allocator, block_size = self._tables, self._allocator, self.config.block_size
        requested = tables.plan_decode(rows, allocator.protected)
        if requested < 0:
            return None  # copy-on-write needed
        if requested > allocator.num_obtainable_blocks:
            raise OutOfBlocksError(requested, allocator.num_obtainable_blocks)
        # commit
        new_ids = allocator.allocate(requested) if requested else _NO_BLOCKS
        slots, num_blocks, seq_lens, filled = tables.commit_decode(rows, token_ids, new_ids)
        if token_ids is None:
            tables.set_chains(rows.tolist(), [None] * rows.size)  # ids unknown: never indexed
        elif self.config.enable_prefix_caching and filled.size:
            index_filled_blocks(allocator, tables, rows[filled], block_size)
        # slicing columns first makes the row gather a contiguous-row take (~1.5x faster)
        batch = StepBatch.from_host(
            seq_ids, tables.block_ids[:, : int(num_blocks.max())][rows], num_blocks,
            seq_lens, np.arange(rows.size + 1, dtype=np.int32), slots, rows.size, 1, block_size,
            self.config.device)
        self._after_mutation()
        return batch

    def _finish_step(self, step: Step, new_lens: np.ndarray) -> StepBatch:
        """The step's `StepBatch` from the committed rows (both prepare paths end here)."""
        num_blocks = self._tables.num_blocks[step.rows]
        block_tables = self._tables.block_ids[:, : int(num_blocks.max())][step.rows]
        batch = StepBatch.from_arrays(step.seq_ids, block_tables, num_blocks, new_lens,
                                      step.counts, self.config.block_size, self.config.device)
        self._after_mutation()
        return batch

    def num_blocks_needed(self, new_tokens: Mapping[SeqId, Sequence[int] | int], *,
                          per_sequence: bool = False) -> int | np.ndarray:
        """Blocks `prepare(new_tokens)` would take now (copy-on-write copies included),
        without changing anything: a scheduler's admission check.

        With ``per_sequence=True`` returns ``[B]`` int64, each sequence's share in the
        mapping's order (copies counted for the sequence that makes them).

        Examples
        --------
        >>> cache = PagedKVCache(CacheConfig(num_layers=1, num_kv_heads=1, head_dim=4,
        ...                                  block_size=4, num_blocks=8))
        >>> cache.add_sequence("a")
        0
        >>> cache.num_blocks_needed({"a": 9})  # ceil(9 / 4)
        3
        """
        step = parse_step(new_tokens, self._tables)
        num_new_blocks, (cow_rows, _, _) = self._count_blocks(step)
        if per_sequence:
            return num_new_blocks + np.isin(step.rows, cow_rows)
        return int(num_new_blocks.sum()) + len(cow_rows)

    def _count_blocks(self, step: Step) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
        """New blocks per row of `step`, and the copy-on-write plan."""
        rows, block_size = step.rows, self.config.block_size
        old_lens = self._tables.num_tokens[rows]
        old_num_blocks = self._tables.num_blocks[rows]
        num_new_blocks = -(-(old_lens + step.counts) // block_size) - old_num_blocks
        return num_new_blocks, self._plan_copy_on_write(rows, old_lens, old_num_blocks)

    def _plan_copy_on_write(self, rows: np.ndarray, old_lens: np.ndarray,
                            old_num_blocks: np.ndarray) -> tuple[np.ndarray, ...]:
        """Rows whose partly filled last block must not be written in place, and which block
        they copy.

        When every owner of a shared block writes in this step, the first keeps the
        original; an indexed block is always copied, so its cached prefix stays intact.
        """
        nothing = np.empty(0, np.int64)
        partial = (old_lens % self.config.block_size != 0).nonzero()[0]
        columns = old_num_blocks[partial] - 1
        last = self._tables.block_ids[rows[partial], columns].astype(np.int64)
        must_copy = self._must_copy(last)
        if not must_copy.any():
            return nothing, nothing, nothing
        partial, columns, last = (a[must_copy] for a in (partial, columns, last))
        refcount = self._allocator.refcount[last]
        _, first, writers = np.unique(last, return_index=True, return_counts=True)
        keep = first[(writers == refcount[first]) & ~self._allocator.indexed[last[first]]]
        copy = np.setdiff1d(np.arange(partial.size), keep, assume_unique=True)
        return rows[partial[copy]], columns[copy], last[copy]

    def _must_copy(self, last_blocks: np.ndarray) -> np.ndarray:
        """Which partly filled last blocks a write must copy first: shared ones, and indexed
        ones (a truncated sequence's kept block still serves the prefix cache)."""
        return self._allocator.protected[last_blocks]

    # -- swapping -------------------------------------------------------------------------
    def swap_out(self, seq_id: SeqId) -> None:
        """Move a sequence's blocks to the host pool and release its device blocks."""
        self._require_resident("swap_out()", seq_id)
        if self._host_allocator is None:
            raise PagedKVError("swap_out(): no host pool; set CacheConfig.num_host_blocks > 0")
        block_ids = self._tables.blocks(seq_id)
        if not self._host_allocator.can_allocate(block_ids.size):
            raise OutOfBlocksError(block_ids.size, self._host_allocator.num_obtainable_blocks,
                                   "swap_out() host pool")
        host_ids = self._host_allocator.allocate(block_ids.size)
        self._pool.swap_out(block_ids, host_ids)
        self._swapped_keys[seq_id] = [self._allocator.block_hash(b) for b in block_ids.tolist()]
        self._allocator.free(block_ids, unique=True)
        self._tables.set_swapped(seq_id, host_ids, True)
        self._num_preemptions += 1
        self._after_mutation()

    def swap_in(self, seq_id: SeqId) -> None:
        """Bring a swapped-out sequence back into fresh device blocks."""
        self._require_known("swap_in()", seq_id)
        if not self.is_swapped(seq_id):
            raise ValueError(f"swap_in(): sequence {seq_id!r} is not swapped out")
        host_ids = self._tables.blocks(seq_id)
        if not self._allocator.can_allocate(host_ids.size):
            raise OutOfBlocksError(host_ids.size, self._allocator.num_obtainable_blocks,
                                   "swap_in()")
        block_ids = self._allocator.allocate(host_ids.size)
        self._pool.swap_in(host_ids, block_ids)
        self._host_allocator.free(host_ids, unique=True)
        self._tables.set_swapped(seq_id, block_ids, False)
        token_ids = self._tables.token_ids[self._tables.row_of[seq_id]]
        block_size = self.config.block_size
        for j, key in enumerate(self._swapped_keys.pop(seq_id)):
            if key is not None:
                block_tokens = encode_tokens(token_ids[j * block_size:(j + 1) * block_size])
                self._allocator.register(int(block_ids[j]), key, block_tokens)
        self._after_mutation()

    # -- accounting and checking ----------------------------------------------------------
    def stats(self) -> CacheStats:
        """Where every block and byte is now (see `CacheStats`)."""
        return compute_stats(
            allocator=self._allocator, tables=self._tables, block_size=self.config.block_size,
            bytes_per_block=self.config.bytes_per_block, total_bytes=self._pool.nbytes,
            prefix_query_tokens=self._prefix_query_tokens,
            prefix_hit_tokens=self._prefix_hit_tokens, num_preemptions=self._num_preemptions)

    @property
    def num_preemptions(self) -> int:
        """Sequences swapped out so far."""
        return self._num_preemptions

    @property
    def prefix_counters(self) -> tuple[int, int]:
        """``(prefix_query_tokens, prefix_hit_tokens)`` so far."""
        return self._prefix_query_tokens, self._prefix_hit_tokens

    def take_events(self) -> list:
        """Drain the allocator's block events (allocated / freed / cached / evicted / hit)."""
        return self._allocator.take_events()

    def check(self) -> None:
        """Raise `InvariantError` if any invariant of allocator, tables or pool is broken."""
        self._tables.check()
        self._allocator.check_invariants(self._tables.owners(self.config.num_blocks))
        if self._host_allocator is not None:
            self._host_allocator.check_invariants(
                self._tables.owners(self._host_allocator.num_blocks, swapped=True))
        swapped = {s for s in self._tables.seq_ids if self._tables.swapped[self._tables.row_of[s]]}
        if swapped != set(self._swapped_keys):
            raise InvariantError("swapped sequences and their saved prefix keys disagree")

    def snapshot(self) -> tuple:
        """Comparable copy of the full state (tables, allocator, counters, pool bytes)."""
        pools = tuple(None if t is None else t.clone() for t in (
            raw(self._pool.kv), raw(self._pool.host) if self._pool.host is not None else None,
            self._pool.scales, self._pool.host_scales))
        host = None if self._host_allocator is None else self._host_allocator.snapshot()
        return (self._allocator.snapshot(), self._tables.snapshot(), host,
                tuple((k, tuple(v)) for k, v in self._swapped_keys.items()),
                tuple(self._roots.items()),
                self.prefix_counters, self._num_preemptions, pools)

    # -- validation helpers ---------------------------------------------------------------
    def _after_mutation(self) -> None:
        if self._debug:
            self.check()

    def _require_known(self, what: str, seq_id: SeqId) -> None:
        if seq_id not in self._tables:
            raise KeyError(f"{what}: unknown sequence {seq_id!r}")

    def _require_resident(self, what: str, seq_id: SeqId) -> None:
        self._require_known(what, seq_id)
        if self._tables.swapped[self._tables.row_of[seq_id]]:
            raise ValueError(f"{what}: sequence {seq_id!r} is swapped out; swap_in() it first")

    def _require_new(self, what: str, seq_id: SeqId) -> None:
        if not isinstance(seq_id, Hashable):
            raise TypeError(f"{what}: seq_id must be hashable, got {type(seq_id).__name__}")
        if seq_id in self._tables:
            raise ValueError(f"{what}: sequence {seq_id!r} already exists")


__all__ = ["InvariantError", "OutOfBlocksError", "PagedKVCache", "PagedKVError"]
