"""What a window or chunked layer can still read, as arithmetic on token counts.

One rule serves both sides, so they never disagree (the silent-0% class of bug, where the
blocks kept after a window moves on and the blocks a prefix hit asks for came from two
different rules): `skipped_tokens` says which tokens no later query of a sequence reads,
so its blocks go back to the pool; a prefix hit of ``n`` tokens needs exactly the blocks
of the tokens ``skipped_tokens(kind, n)`` leaves.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ...config import LayerKind


def skipped_tokens(kind: LayerKind, num_tokens: int | np.ndarray) -> int | np.ndarray:
    """Leading tokens that no query from position `num_tokens` on can see.

    A sliding window of ``W`` lets the query at ``n`` see keys from ``n - W + 1``; a chunk
    of ``C`` from the start of the query's own chunk; full attention sees everything.

    Examples
    --------
    >>> skipped_tokens(LayerKind.sliding(4), 10), skipped_tokens(LayerKind.chunked(8), 10)
    (7, 8)
    """
    if kind.window:
        return np.maximum(num_tokens - kind.window + 1, 0) if isinstance(
            num_tokens, np.ndarray) else max(num_tokens - kind.window + 1, 0)
    if kind.chunk:
        return num_tokens // kind.chunk * kind.chunk
    return num_tokens * 0


def skipped_blocks(kind: LayerKind, num_tokens: int | np.ndarray,
                   block_size: int) -> int | np.ndarray:
    """Leading blocks wholly made of `skipped_tokens`: those a row can give back."""
    return skipped_tokens(kind, num_tokens) // block_size


def accepted_hit(kind: LayerKind, end: int, block_size: int,
                 cached: Callable[[int], bool]) -> int:
    """The longest hit of at most `end` blocks this kind accepts: the blocks a query right
    after it reads (from ``skipped_blocks`` of the hit on) are all cached. Scanned right to
    left, so a hit far past blocks long evicted is still found (vLLM's rule); full
    attention needs every block from the first.

    Parameters
    ----------
    cached : callable
        ``cached(column)``: whether the block at that column is in the prefix cache.

    Examples
    --------
    >>> have = {2, 3}.__contains__  # columns 0, 1 evicted
    >>> accepted_hit(LayerKind.sliding(8), 4, 4, have), accepted_hit(LayerKind(), 4, 4, have)
    (4, 0)
    """
    while end > 0:
        first = skipped_blocks(kind, end * block_size, block_size)
        missing = next((c for c in range(end - 1, first - 1, -1) if not cached(c)), None)
        if missing is None:
            return end
        end = missing  # every longer hit below `end` needs that block too
    return 0


def group_key(key: bytes, group: int) -> bytes:
    """The key a block of layer group `group` is indexed under: the chained block key,
    then the group's number (group 0's is the key itself), so each group's blocks are
    found, evicted and stored in the tiers apart, under keys that name their group."""
    return key if group == 0 else key + group.to_bytes(1, "little")
