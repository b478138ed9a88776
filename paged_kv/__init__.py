"""paged_kv: a paged KV cache for transformer inference.

Three owners, composed by `PagedKVCache`:

- `BlockAllocator` owns block ids: free queue, refcounts, prefix index, eviction order.
- `PageTables` owns each sequence's block ids and token count as numpy rows.
- `KVPool` owns the tensors: one ``[layers, 2, blocks, block_size, heads, head_dim]`` buffer.
"""

from ._threads import prefer_passive_waiting

prefer_passive_waiting()  # before torch loads: see _threads.py

from .accounting import CacheStats, SequenceStats  # noqa: E402
from .allocator import BlockAllocator, BlockEvent  # noqa: E402
from .cache import PagedKVCache  # noqa: E402
from .config import CacheConfig  # noqa: E402
from .errors import InvariantError, OutOfBlocksError, PagedKVError  # noqa: E402
from .page_table import PageTables, StepBatch  # noqa: E402
from .pool import KVPool  # noqa: E402

__all__ = [
    "BlockAllocator",
    "BlockEvent",
    "CacheConfig",
    "CacheStats",
    "InvariantError",
    "KVPool",
    "OutOfBlocksError",
    "PageTables",
    "PagedKVCache",
    "PagedKVError",
    "SequenceStats",
    "StepBatch",
]

__version__ = "0.1.0"
