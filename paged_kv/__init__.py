"""paged_kv: a paged KV cache for transformer inference.

Three owners, composed by `PagedKVCache`:

- `BlockAllocator` owns block ids: free queue, refcounts, prefix index, eviction order.
- `PageTables` owns each sequence's block ids and token count as numpy rows.
- `KVPool` owns the tensors: one ``[layers, 2, blocks, block_size, heads, head_dim]`` buffer.
"""

from .config import CacheConfig, LayerKind
from .core.accounting import CacheStats, SequenceStats
from .core.allocator import BlockAllocator
from .core.batch import StepBatch
from .core.cache import PagedKVCache
from .core.page_table import PageTables
from .core.pool import KVPool
from .errors import InvariantError, OutOfBlocksError, PagedKVError
from .keys import BlockEvent

__all__ = [
    "BlockAllocator",
    "BlockEvent",
    "CacheConfig",
    "CacheStats",
    "InvariantError",
    "KVPool",
    "LayerKind",
    "OutOfBlocksError",
    "PageTables",
    "PagedKVCache",
    "PagedKVError",
    "SequenceStats",
    "StepBatch",
]

__version__ = "0.1.0"
