"""Each layer kind's rules, one class per kind: what a row of its layers gives back as the
sequence grows, and so which blocks a prefix hit needs (`LayerGroup.accepted_hit` reads
`skipped_tokens`).

One rule serves both sides, so they never disagree (the silent-0% class of bug, where the
blocks kept after a window moves on and the blocks a prefix hit asks for came from two
different rules). A new kind of layer is a new `LayerGroup` subclass here, named in
`GROUP_OF_ATTENTION`, plus its tests; the cache, its steps and its admissions loop over
groups and never ask which kind a group is.
"""

from __future__ import annotations

import numpy as np

from ...config import CacheConfig
from ..allocator import BlockAllocator
from ..pool import KVPool
from .groups import LayerGroup
from .state_group import StateGroup


class FullAttentionGroup(LayerGroup):
    """Layers that read every earlier token: a row keeps all its blocks, and a hit needs
    every block from the first (a uniform model's cache is one such group)."""

    def skipped_tokens(self, num_tokens: int | np.ndarray) -> int | np.ndarray:
        return num_tokens * 0


class SlidingWindowGroup(LayerGroup):
    """Layers with a sliding window of ``W = kind.span`` tokens: the query at ``n`` sees
    keys from ``n - W + 1``, so a row gives back the blocks before that, and holds about
    ``cdiv(W, block_size) + 1`` blocks however long it grows."""

    gives_back = True

    def skipped_tokens(self, num_tokens: int | np.ndarray) -> int | np.ndarray:
        if isinstance(num_tokens, np.ndarray):
            return np.maximum(num_tokens - self.kind.span + 1, 0)
        return max(num_tokens - self.kind.span + 1, 0)


class ChunkedGroup(LayerGroup):
    """Layers of chunked local attention (chunks of ``C = kind.span``): a query sees the
    earlier tokens of its own chunk, so a row gives back every block of earlier chunks."""

    gives_back = True

    def skipped_tokens(self, num_tokens: int | np.ndarray) -> int | np.ndarray:
        return num_tokens // self.kind.span * self.kind.span


# the group class of each `LayerKind.attention` (a recurrent layer's state group holds a
# slot of the state slab per row, not blocks: its own module)
GROUP_OF_ATTENTION: dict[str, type[LayerGroup]] = {
    "full": FullAttentionGroup, "sliding": SlidingWindowGroup, "chunked": ChunkedGroup,
    "recurrent": StateGroup}


def build_groups(config: CacheConfig, allocator: BlockAllocator, pool: KVPool,
                 compiled: bool | None) -> tuple[LayerGroup, ...]:
    """The layer groups of `config` (`CacheConfig.layer_groups`, full attention first, the
    recurrent state group last), each its kind's class, over one allocator and pool (and
    one host pool when swapping); every group after the first is told the leading one."""
    host = (BlockAllocator(config.num_host_blocks + 1, enable_prefix_caching=False)
            if config.num_host_blocks else None)  # one host pool, every group's ids
    groups: list[LayerGroup] = []
    for index, (kind, layers) in enumerate(config.layer_groups):
        groups.append(GROUP_OF_ATTENTION[kind.attention].build(
            index, kind, layers, config, allocator, pool, compiled, host,
            leader=groups[0] if groups else None))
    return tuple(groups)
