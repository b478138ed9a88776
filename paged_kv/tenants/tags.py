"""`TenantTags`: the tenant of each indexed block, found from its parent as it is indexed.

A block's parent is its tenant's salted root (the first block of a prompt) or the key of a
block indexed before it, of the same tenant: the salt is in the chain. That block may be
gone: a sequence whose copy of it was not indexed (another sequence had indexed the same
key first) goes on after the indexed one was evicted. So a tenant policy's ghost list
(`GhostList.owner`) remembers the tenant that owned each key it evicted, the newest half of
`ghost.default_capacity` keys at least; a parent older than that, or taken out of the index
without an eviction (a rolled-back block), found nowhere, counts as unnamed (tenant 0).
The owner rides in the ghost's own entry, so the tags hold no key the ghost list does not
(they kept a memory of every key tagged before: up to four times the pool's blocks in a
list and two maps, beside the ghost's own) and an eviction stores each key once.
"""

from __future__ import annotations

import array
import itertools
import operator
from collections.abc import Iterable, Mapping

import numpy as np

from ..keys import root_hash
from .ghost import GhostList


class TenantTags:
    """Which tenant each block of a pool of `num_blocks` belongs to.

    Parameters
    ----------
    names : list of str or None
        The tenants, the unnamed (None) first: a tenant is its index here.
    num_blocks : int
        The pool's blocks, the null block included.
    ghost : GhostList, optional
        The policy's ghost list, whose entries name the owner of each key it evicted (None:
        a parent found neither as a root nor indexed is the unnamed tenant's).

    Examples
    --------
    >>> tags = TenantTags([None, "a"], 8)
    >>> tags.tag(np.array([3, 4]), [b"k3", b"k4"], [root_hash("a"), b"k3"], {})
    >>> tags.of([3, 4]), tags.tenant_id(root_hash("a")), tags.tenant_id(root_hash("z"))
    ((1, 1), 1, 0)
    """

    def __init__(self, names: list[str | None], num_blocks: int,
                 ghost: GhostList | None = None) -> None:
        self.names = names
        self.ids = {root_hash(name): i for i, name in enumerate(names) if name}  # root -> tenant
        # per block, its tenant: set when it is indexed (stale elsewhere), read a run of
        # blocks at a time by one C call (`itemgetter`). A byte each (a 32-bit int past 256
        # tenants), written through a numpy view of the same memory: a step's blocks are
        # tagged by one scatter over the ids array the index makes anyway, not a Python
        # store per block, and the tags of a pool fit in a few pages of cache (a list of
        # ints takes eight bytes a block)
        wide = len(names) > 256
        self._tenant: bytearray | array.array = (
            array.array("I", bytes(4 * num_blocks)) if wide else bytearray(num_blocks))
        self._view = np.frombuffer(self._tenant, dtype=np.uint32 if wide else np.uint8)
        self._ghost = ghost
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
        """The first `count` blocks of `order` (indexed blocks) that are `tenant`'s, looking
        at its first `limit` only (fewer when those hold fewer). The order is read in
        chunks that double, each an array whose tags one numpy comparison tests (about
        half the time of a lazy test per block, which reads the order no further), so it
        is read little past the `count`-th."""
        view, found = self._view, []
        blocks, seen, chunk = iter(order), 0, max(8 * count, 64)
        while seen < limit and len(found) < count:
            ids = np.fromiter(itertools.islice(blocks, min(chunk, limit - seen)), np.int64)
            if not len(ids):
                break
            seen, chunk = seen + len(ids), 2 * chunk
            found += ids[view[ids] == tenant][: count - len(found)].tolist()
        return found

    def tag(self, block_ids: np.ndarray, keys: list[bytes], parents: list[bytes],
            index: Mapping[bytes, int]) -> None:
        """Record the tenant of `block_ids` (``[n]`` int64), about to be indexed under
        `keys` (`index` holds none of them yet) and chaining from `parents`."""
        if len(keys) == 1 or (parents[1] == keys[0] and parents[1:] == keys[:-1]):
            self.tag_one(block_ids, parents[0], index)
            return
        try:  # a decode step's blocks: each chains from its sequence's block indexed before
            owners = operator.itemgetter(*parents)(index)  # a tuple: two parents or more
        except KeyError:  # a parent not indexed: not indexed yet (in this batch), or gone
            owners = None
        if owners is not None:
            self._view[block_ids] = self.of(owners)
            return
        tenant_of = self._tenant
        batch: dict[bytes, int] = {}  # the tenants of this batch's keys, as they are found
        for block_id, key, parent in zip(block_ids.tolist(), keys, parents, strict=True):
            tenant = batch.get(parent)
            if tenant is None:
                tenant = self._tenant_of_parent(parent, index)
            tenant_of[block_id] = batch[key] = tenant

    def tag_one(self, block_ids: np.ndarray, parent: bytes, index: Mapping[bytes, int],
                ) -> None:
        """Record the tenant of `block_ids` (``[n]`` int64), one chain of blocks about to be
        indexed, the first chaining from `parent`: one tenant, the parent's."""
        self._view[block_ids] = self._tenant_of_parent(parent, index)

    def _tenant_of_parent(self, parent: bytes, index: Mapping[bytes, int]) -> int:
        """The tenant of a block chaining from `parent`: a salted root's, an indexed
        block's, else the owner the ghost list remembers for an evicted key (0, the
        unnamed, when found nowhere)."""
        tenant = self.ids.get(parent)
        if tenant is not None:
            return tenant
        owner = index.get(parent)
        if owner is not None:
            return self._tenant[owner]
        tenant = None if self._ghost is None else self._ghost.owner(parent)
        if tenant is None:
            self.misses += 1
            return 0
        return tenant

