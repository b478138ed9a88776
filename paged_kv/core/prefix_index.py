"""`PrefixIndex`: the prefix-cache index of a block pool, the map from a block's prefix key
to the block and each indexed block's key and token bytes.

`BlockAllocator` owns one and delegates its lookups (`lookup`, `match`, `block_hash`) and the
index part of registering, unregistering, evicting, resetting and checking to it; block
states, refcounts, write protection, events and the eviction policy stay the allocator's.
It never sees a tensor either.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping

import numpy as np

from ..errors import ensure

# called with (block_ids, keys, parents, index) before the index holds them: the eviction
# policy's ``tag`` (block_ids an int64 array)
Tag = Callable[[np.ndarray, list[bytes], list[bytes], Mapping[bytes, int]], None]


class PrefixIndex:
    """The key -> block map of a pool of `num_blocks`, and each indexed block's key and tokens.

    Attributes
    ----------
    indexed : np.ndarray
        ``[num_blocks]`` bool: the block is in the index (the allocator hands out a
        read-only view; only this class changes it).

    Examples
    --------
    >>> index = PrefixIndex(4)
    >>> index.insert([b"k"], [2], [b"tok"], [b""], b"tok", lambda *args: None)[1:]
    ((2,), (b'k',), (b'',), b'tok')
    >>> index.lookup(b"k", b"tok"), index.block_hash(2), index.block_hash(3)
    (2, b'k', None)
    """

    def __init__(self, num_blocks: int) -> None:
        # per block, its key and its token bytes (valid where indexed; stale entries stay):
        # dicts of the bytes the hashing made anyway, so storing a step's blocks is one
        # C-level update and evicting or comparing one a dict access, never a numpy call
        self._key_of: dict[int, bytes] = {}
        self._tokens_of: dict[int, bytes] = {}
        self.indexed = np.zeros(num_blocks, dtype=bool)
        self._index: dict[bytes, int] = {}

    def __len__(self) -> int:
        """Indexed blocks."""
        return len(self._index)

    def __contains__(self, key: bytes) -> bool:
        """Whether `key` is indexed."""
        return key in self._index

    def block_hash(self, block_id: int) -> bytes | None:
        """The prefix key `block_id` is indexed under, or None."""
        return self._key_of[block_id] if self.indexed[block_id] else None

    def lookup(self, key: bytes, token_ids: bytes) -> int | None:
        """Block indexed under `key` whose tokens equal `token_ids`, else None."""
        block_id = self._index.get(key)
        if block_id is None or self._tokens_of[block_id] != token_ids:
            return None
        return block_id

    def match(self, token_ids: bytes, num_blocks: int, keys: list[bytes], parent_key: bytes,
              ) -> tuple[list[int], list[bytes]]:
        """The indexed blocks of the longest prefix of `token_ids` (`num_blocks` equal
        slices, consecutive full blocks), in one pass.

        `keys` are the keys of the first blocks when known (the request carries them); the
        others are hashed as the lookup reaches them (the first chained from `parent_key`),
        and only those: it stops at the first miss.

        Returns
        -------
        hits : list of int
            Their block ids, in order.
        keys : list of bytes
            The keys known now: those given, then those hashed on the way.
        """
        hits: list[int] = []
        keys = list(keys)
        if not num_blocks:
            return hits, keys
        get, tokens_of = self._index.get, self._tokens_of
        width = len(token_ids) // num_blocks
        known = range(0, min(len(keys), num_blocks) * width, width)
        for start, key in zip(known, keys, strict=False):  # given keys: nothing to hash
            block_id = get(key)
            if block_id is None or tokens_of[block_id] != token_ids[start:start + width]:
                return hits, keys
            hits.append(block_id)
        parent_key, sha256 = keys[-1] if keys else parent_key, hashlib.sha256
        for start in range(len(keys) * width, num_blocks * width, width):  # lazily
            piece = token_ids[start:start + width]
            parent_key = sha256(parent_key + piece).digest()  # keys.hash_block, inlined
            keys.append(parent_key)
            block_id = get(parent_key)
            if block_id is None or tokens_of[block_id] != piece:
                break
            hits.append(block_id)
        return hits, keys

    def insert(self, keys: list[bytes], block_ids: list[int], pieces: list[bytes],
               parents: list[bytes], token_ids: bytes, tag: Tag,
               ) -> tuple[tuple, tuple, tuple, bytes] | None:
        """Index blocks in bulk (``block_ids[i]`` holds ``pieces[i]``, the slices of
        `token_ids`, and chains from ``parents[i]``); a key indexed before (or twice here)
        keeps its first block. `tag` is told the blocks that join (an int64 array), before
        the index holds them.

        Returns
        -------
        tuple or None
            The blocks that joined (``[n]`` int64), then a stored event's fields: the same
            blocks, their keys and their parents (tuples) and their token bytes; None when
            none joined.
        """
        index = self._index
        if not index.keys().isdisjoint(keys) or len(set(keys)) < len(keys):
            first: dict[bytes, int] = {}
            for i, key in enumerate(keys):
                if key not in index:
                    first.setdefault(key, i)
            chosen = list(first.values())
            keys = [keys[i] for i in chosen]
            block_ids = [block_ids[i] for i in chosen]
            parents = [parents[i] for i in chosen]
            pieces = [pieces[i] for i in chosen]
            token_ids = b"".join(pieces)
            if not keys:
                return None
        ids = np.array(block_ids, dtype=np.int64)
        tag(ids, keys, parents, index)  # before the index holds them
        index.update(zip(keys, block_ids, strict=True))
        self._key_of.update(zip(block_ids, keys, strict=True))
        self._tokens_of.update(zip(block_ids, pieces, strict=True))
        self.indexed[ids] = True
        return ids, tuple(block_ids), tuple(keys), tuple(parents), token_ids

    def remove(self, block_ids: list[int], ids: np.ndarray | None = None) -> list[bytes]:
        """Take indexed `block_ids` (distinct) out of the index; returns their keys.
        `ids`: the same ids as an int64 array, when the caller has one."""
        gone = list(map(self._key_of.__getitem__, block_ids))
        index = self._index
        for key in gone:
            del index[key]
        self.indexed[np.array(block_ids, dtype=np.int64) if ids is None else ids] = False
        return gone

    def clear(self) -> None:
        """Empty the index."""
        self._index.clear()
        self.indexed[:] = False

    def snapshot(self) -> tuple:
        """Comparable copy: the index's entries, then the indexed blocks' tokens."""
        return (tuple(sorted(self._index.items())),
                tuple(self._tokens_of[b] for b in np.flatnonzero(self.indexed).tolist()))

    def check(self, free: list[int], cached: list[int]) -> None:
        """Raise `InvariantError` if `free` blocks are indexed, `cached` ones are not, or
        the map and the flags disagree."""
        ensure(not self.indexed[free].any(), "a free block is still indexed")
        ensure(self.indexed[cached].all(), "a cached block is not indexed")
        for key, block_id in self._index.items():
            ensure(bool(self.indexed[block_id]) and self._key_of[block_id] == key,
                   f"index entry of {block_id} is stale")
        ensure(len(self._index) == int(np.count_nonzero(self.indexed)),
               "the indexed flags disagree with the index")
