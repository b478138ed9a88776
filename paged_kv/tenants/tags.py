"""`TenantTags`: the tenant of each indexed block, found from its parent as it is indexed.

A block's parent is its tenant's salted root (the first block of a prompt) or the key of a
block indexed before it, of the same tenant: the salt is in the chain. That block may be
gone: a sequence whose copy of it was not indexed (another sequence had indexed the same
key first) goes on after the indexed one was evicted. So the tags also remember the tenant
of each key tagged (the newest half of `ghost.default_capacity` keys at least); a parent
older than that, found nowhere, counts as unnamed (tenant 0). That memory is asked only
when a parent is neither a root nor indexed, which is rare, so tagging appends its batch
(`LazyKeyMemory`) and the keys go into a map only when the memory is asked.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterable, Mapping, Sequence

from ..keys import root_hash
from .ghost import KeyMemory, default_capacity


class TenantTags:
    """Which tenant each block of a pool of `num_blocks` belongs to.

    Parameters
    ----------
    names : list of str or None
        The tenants, the unnamed (None) first: a tenant is its index here.
    num_blocks : int
        The pool's blocks, the null block included.

    Examples
    --------
    >>> tags = TenantTags([None, "a"], 8)
    >>> tags.tag([3, 4], [b"k3", b"k4"], [root_hash("a"), b"k3"], {b"k3": 3, b"k4": 4})
    >>> tags.of([3, 4]), tags.tenant_id(root_hash("a")), tags.tenant_id(root_hash("z"))
    ((1, 1), 1, 0)
    """

    def __init__(self, names: list[str | None], num_blocks: int) -> None:
        self.names = names
        self.ids = {root_hash(name): i for i, name in enumerate(names) if name}  # root -> tenant
        # per block, its tenant: set when it is indexed (stale elsewhere), read a run of
        # blocks at a time by one C call. A list, not a byte each: tagging stores one
        # tenant per block in a Python loop, and a list's store (the interpreter's
        # specialised list-int store) takes half the instructions of a bytearray's, which
        # converts each value to a byte; reads by `itemgetter` cost the same either way
        self._tenant: list[int] = [0] * num_blocks
        self._key_tenants = LazyKeyMemory(default_capacity(num_blocks), narrow=len(names) <= 256)
        # parents found nowhere (not a root, not indexed, forgotten): their blocks were
        # tagged unnamed though their chain's root may name a tenant; while none was, every
        # tag is the tenant of the root its chain starts from
        self.misses = 0

    def tenant_id(self, root: bytes | None) -> int:
        """The index of the tenant whose salted root is `root` (0: not named, or None)."""
        return self.ids.get(root, 0) if root is not None else 0

    def of(self, block_ids: list[int]) -> tuple[int, ...]:
        """The tenants of indexed `block_ids` (ints), in order."""
        if len(block_ids) > 1:  # one C call: twice as fast as a map
            return operator.itemgetter(*block_ids)(self._tenant)
        return tuple(map(self._tenant.__getitem__, block_ids))

    def first_of(self, tenant: int, order: Iterable[int], count: int, limit: int) -> list[int]:
        """The first `count` blocks of `order` (indexed blocks; an iterable read twice, in
        step) that are `tenant`'s, looking at its first `limit` only (fewer when those hold
        fewer). Lazily and in C (compress over the tags): it reads the order only as far as
        the `count`-th, not `limit` blocks and a tuple of their tags."""
        is_tenant = map(tenant.__eq__, map(self._tenant.__getitem__,
                                            itertools.islice(order, limit)))
        return list(itertools.islice(itertools.compress(itertools.islice(order, limit),
                                                        is_tenant), count))

    def tag(self, block_ids: list[int], keys: list[bytes], parents: list[bytes],
            index: Mapping[bytes, int]) -> None:
        """Record the tenant of `block_ids`, about to be indexed under `keys` (`index`
        holds none of them yet) and chaining from `parents`."""
        tenant_of = self._tenant
        if len(keys) == 1 or (parents[1] == keys[0] and parents[1:] == keys[:-1]):
            tenant = self._tenant_of_parent(parents[0], index)  # one chain: one tenant
            for block_id in block_ids:
                tenant_of[block_id] = tenant
            self._key_tenants.remember(keys, tenant)
            return
        try:  # a decode step's blocks: each chains from its sequence's block indexed before
            owners = operator.itemgetter(*parents)(index)  # a tuple: two parents or more
        except KeyError:  # a parent not indexed: not indexed yet (in this batch), or gone
            owners = None
        if owners is not None:
            tenants = self.of(owners)
            for block_id, tenant in zip(block_ids, tenants, strict=True):
                tenant_of[block_id] = tenant
            self._key_tenants.remember(keys, tenants)
            return
        batch: dict[bytes, int] = {}  # the tenants of this batch's keys, as they are found
        for block_id, key, parent in zip(block_ids, keys, parents, strict=True):
            tenant = batch.get(parent)
            if tenant is None:
                tenant = self._tenant_of_parent(parent, index)
            tenant_of[block_id] = batch[key] = tenant
        self._key_tenants.remember(list(batch), list(batch.values()))  # keys are distinct

    def _tenant_of_parent(self, parent: bytes, index: Mapping[bytes, int]) -> int:
        """The tenant of a block chaining from `parent`: a salted root's, an indexed
        block's, else a key's remembered by `tag` (0, the unnamed, when forgotten)."""
        tenant = self.ids.get(parent)
        if tenant is not None:
            return tenant
        owner = index.get(parent)
        if owner is not None:
            return self._tenant[owner]
        tenant = self._key_tenants.get(parent, -1)
        if tenant < 0:
            self.misses += 1
            return 0
        return tenant


class LazyKeyMemory:
    """`KeyMemory` of keys to tenants that takes a batch in O(1): batches wait in two flat
    arrays (at most `capacity` keys: the oldest half goes when they pass it; no object per
    batch, so nothing for the garbage collector to trace) and go into the map when it is
    asked, oldest first, so it remembers what a `KeyMemory` given every batch would.

    Parameters
    ----------
    capacity : int
        Keys remembered at most (0: none).
    narrow : bool
        Every tenant fits a byte (256 tenants at most): the waiting tenants are a
        bytearray, which takes a batch of one tenant as one C-level fill and drops its
        oldest half by moving its start, not a list of ints (a reference each).

    Examples
    --------
    >>> memory = LazyKeyMemory(4)
    >>> memory.remember([b"a", b"b"], 1)
    >>> memory.remember([b"c"], [2])
    >>> memory.get(b"a"), memory.get(b"c"), memory.get(b"z", 0)
    (1, 2, 0)
    """

    def __init__(self, capacity: int, *, narrow: bool = True) -> None:
        self.capacity = capacity
        self._memory = KeyMemory(capacity)
        self._keys: list[bytes] = []
        self._narrow = narrow
        self._tenants: bytearray | list[int] = bytearray() if narrow else []

    def remember(self, keys: list[bytes], tenants: int | Sequence[int]) -> None:
        """Remember `keys` as of `tenants` (one for all, or one each)."""
        if not self.capacity:
            return
        self._keys += keys
        if isinstance(tenants, int):
            self._tenants += (_FILLS[tenants] * len(keys) if self._narrow
                              else [tenants] * len(keys))
        else:
            self._tenants.extend(tenants)
        if len(self._keys) > self.capacity:  # the memory would have dropped these
            del self._keys[:len(self._keys) - self.capacity // 2]
            del self._tenants[:len(self._tenants) - self.capacity // 2]

    def get(self, key: bytes, default: int = 0) -> int:
        """The tenant remembered for `key`, else `default`."""
        if self._keys:
            self._memory.update(dict(zip(self._keys, self._tenants, strict=True)))
            self._keys, self._tenants = [], bytearray() if self._narrow else []
        return self._memory.get(key, default)


_FILLS = [bytes((tenant,)) for tenant in range(256)]  # a batch of one tenant: fill * n
