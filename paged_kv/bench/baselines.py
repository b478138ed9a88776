"""Same-run baselines: the designs small engines and the seeds use.

- `SimpleBlockManager`: block bookkeeping with Python objects (nano-vllm's design): a `Block`
  object per block with its refcount and hash, a deque free list, a Python list block table
  per sequence, and a Python loop over tokens building slot mapping and block tables each
  step. Same prefix-caching rules as `PagedKVCache` (full blocks, sha256-chained keys, the
  last prompt token always recomputed), so both replay a trace with the same hits.
- `ListKVCache`: per layer, one K and one V tensor appended per token; every decode step
  concatenates the list into contiguous K/V.
- `ContiguousKVCache`: per layer, one contiguous buffer re-copied whole to append a token,
  exported zero-padded to a power-of-two bucket.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from collections.abc import Hashable, Mapping, Sequence

import numpy as np
import torch

from ..errors import OutOfBlocksError
from ..keys import root_hash


class Block:
    """One block: id, owners, and the key and tokens it is indexed under (if full)."""

    __slots__ = ("block_id", "hash", "refcount", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.refcount = 0
        self.hash: bytes | None = None
        self.token_ids: list[int] = []


class _SimpleSeq:
    __slots__ = ("block_table", "last_hash", "num_tokens", "token_ids")

    def __init__(self) -> None:
        self.block_table: list[int] = []
        self.token_ids: list[int] = []
        self.num_tokens = 0
        self.last_hash = root_hash()


@dataclasses.dataclass(frozen=True, slots=True)
class SimpleBatch:
    """What `SimpleBlockManager.prepare` builds: ``slot_mapping [num_tokens]`` int64,
    ``block_tables [B, max_blocks]`` int32, ``seq_lens [B]`` and ``query_start_loc [B + 1]``."""

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor


class SimpleBlockManager:
    """Per-sequence Python objects: the straightforward block manager, as a baseline.

    Parameters
    ----------
    num_blocks : int
        Blocks in the pool; block 0 is the padding block, as in `PagedKVCache`.
    block_size : int

    Examples
    --------
    >>> manager = SimpleBlockManager(num_blocks=8, block_size=4)
    >>> manager.add_sequence("a", [1, 2, 3, 4, 5])
    0
    >>> manager.prepare({"a": [1, 2, 3, 4, 5]}).slot_mapping.tolist()
    [4, 5, 6, 7, 8]
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: collections.deque[int] = collections.deque(range(1, num_blocks))
        self.hash_to_block_id: dict[bytes, int] = {}
        self.seqs: dict[Hashable, _SimpleSeq] = {}
        self.num_block_ops = 0  # blocks allocated (or revived from the free list) and freed

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self.free_block_ids)

    def _hash(self, parent: bytes, token_ids: Sequence[int]) -> bytes:
        return hashlib.sha256(parent + np.array(token_ids, dtype="<i4").tobytes()).digest()

    def _allocate_block(self) -> int:
        block = self.blocks[self.free_block_ids.popleft()]
        if block.hash is not None and self.hash_to_block_id.get(block.hash) == block.block_id:
            del self.hash_to_block_id[block.hash]
        block.hash, block.token_ids, block.refcount = None, [], 1
        self.num_block_ops += 1
        return block.block_id

    def add_sequence(self, seq_id: Hashable, prompt_token_ids: Sequence[int]) -> int:
        """Register a sequence, sharing its longest cached prefix of full blocks; returns the
        tokens found cached (never the last prompt token)."""
        seq, size = _SimpleSeq(), self.block_size
        for start in range(0, (len(prompt_token_ids) - 1) // size * size, size):
            tokens = list(prompt_token_ids[start:start + size])
            key = self._hash(seq.last_hash, tokens)
            block_id = self.hash_to_block_id.get(key)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            block = self.blocks[block_id]
            if block.refcount == 0:
                self.free_block_ids.remove(block_id)  # O(n), as in nano-vllm
                self.num_block_ops += 1
            block.refcount += 1
            seq.block_table.append(block_id)
            seq.token_ids += tokens
            seq.num_tokens += size
            seq.last_hash = key
        self.seqs[seq_id] = seq
        return seq.num_tokens

    def prepare(self, new_tokens: Mapping[Hashable, Sequence[int]]) -> SimpleBatch:
        """Reserve slots for each sequence's new tokens; build the step's tensors.

        Raises
        ------
        OutOfBlocksError
            Not enough free blocks; nothing changed.
        """
        size = self.block_size
        needed = sum(-(-(self.seqs[s].num_tokens + len(t)) // size)
                     - len(self.seqs[s].block_table) for s, t in new_tokens.items())
        if needed > len(self.free_block_ids):
            raise OutOfBlocksError(needed, len(self.free_block_ids), "SimpleBlockManager")
        slot_mapping, seq_lens, query_start_loc, tables = [], [], [0], []
        for seq_id, tokens in new_tokens.items():
            seq = self.seqs[seq_id]
            for token in tokens:
                if seq.num_tokens % size == 0:
                    seq.block_table.append(self._allocate_block())
                slot_mapping.append(seq.block_table[-1] * size + seq.num_tokens % size)
                seq.token_ids.append(token)
                seq.num_tokens += 1
                if seq.num_tokens % size == 0:
                    self._index_last_block(seq)
            seq_lens.append(seq.num_tokens)
            query_start_loc.append(query_start_loc[-1] + len(tokens))
            tables.append(seq.block_table)
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        return SimpleBatch(torch.tensor(slot_mapping, dtype=torch.int64),
                           torch.tensor(padded, dtype=torch.int32),
                           torch.tensor(seq_lens, dtype=torch.int32),
                           torch.tensor(query_start_loc, dtype=torch.int32))

    def _index_last_block(self, seq: _SimpleSeq) -> None:
        tokens = seq.token_ids[-self.block_size:]
        seq.last_hash = self._hash(seq.last_hash, tokens)
        block = self.blocks[seq.block_table[-1]]
        if seq.last_hash not in self.hash_to_block_id:
            block.hash, block.token_ids = seq.last_hash, tokens
            self.hash_to_block_id[seq.last_hash] = block.block_id

    def free(self, seq_id: Hashable) -> None:
        """Release a sequence's blocks, tail first; indexed ones stay reusable until taken."""
        for block_id in reversed(self.seqs.pop(seq_id).block_table):
            block = self.blocks[block_id]
            block.refcount -= 1
            if block.refcount == 0:
                self.free_block_ids.append(block_id)
                self.num_block_ops += 1


class ListKVCache:
    """Seed cache (a): per layer a list of per-token K and V tensors, stacked every step.

    Examples
    --------
    >>> cache = ListKVCache(num_layers=1)
    >>> cache.append(0, torch.ones(2, 1, 4), torch.ones(2, 1, 4))
    >>> tuple(cache.kv(0)[0].shape)  # [B, T, H, D]
    (2, 1, 1, 4)
    """

    def __init__(self, num_layers: int) -> None:
        self._keys: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
        self._values: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]

    def extend(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append ``[B, T, H, D]`` K/V as T per-token tensors (a prefill)."""
        self._keys[layer] += [k.clone() for k in keys.unbind(1)]
        self._values[layer] += [v.clone() for v in values.unbind(1)]

    def append(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Append one token's ``[B, H, D]`` K and V."""
        self._keys[layer].append(key)
        self._values[layer].append(value)

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous ``[B, T, H, D]`` K and V, rebuilt from the whole list."""
        return torch.stack(self._keys[layer], 1), torch.stack(self._values[layer], 1)


class ContiguousKVCache:
    """Seed cache (b): one contiguous buffer per layer, re-copied whole to append a token and
    exported zero-padded to a power-of-two bucket.

    Examples
    --------
    >>> cache = ContiguousKVCache(num_layers=1)
    >>> for _ in range(3):
    ...     cache.append(0, torch.ones(2, 1, 4), torch.ones(2, 1, 4))
    >>> tuple(cache.kv(0)[0].shape)  # 3 tokens padded to the bucket of 4
    (2, 4, 1, 4)
    """

    def __init__(self, num_layers: int) -> None:
        self._keys: list[torch.Tensor | None] = [None] * num_layers
        self._values: list[torch.Tensor | None] = [None] * num_layers

    def extend(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append ``[B, T, H, D]`` K/V (a prefill)."""
        self._keys[layer] = _concat(self._keys[layer], keys)
        self._values[layer] = _concat(self._values[layer], values)

    def append(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Append one token's ``[B, H, D]`` K and V: history length x kv_dim copied."""
        self.extend(layer, key[:, None], value[:, None])

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, bucket, H, D]`` K and V, ``bucket`` the next power of two, zeros past T."""
        return _pad_to_bucket(self._keys[layer]), _pad_to_bucket(self._values[layer])


def _concat(old: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    return new.clone() if old is None else torch.cat([old, new], 1)


def _pad_to_bucket(tensor: torch.Tensor) -> torch.Tensor:
    length = tensor.shape[1]
    bucket = 1 << max(length - 1, 0).bit_length()
    out = tensor.new_zeros(tensor.shape[0], bucket, *tensor.shape[2:])
    out[:, :length] = tensor
    return out
