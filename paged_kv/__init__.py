"""paged_kv: a paged KV cache for transformer inference.

Three owners, composed by `PagedKVCache`:

- `BlockAllocator` owns block ids: free queue, refcounts, prefix index, eviction order.
- `PageTables` owns each sequence's block ids and token count as numpy rows.
- `KVPool` owns the tensors: one ``[layers, 2, blocks, block_size, heads, head_dim]`` buffer.
"""

from .accounting import CacheStats, SequenceStats
from .allocator import BlockAllocator
from .cache import PagedKVCache
from .config import CacheConfig, LayerKind
from .errors import InvariantError, OutOfBlocksError, PagedKVError
from .hybrid import HybridKVCache
from .keys import BlockEvent
from .page_table import PageTables
from .pool import KVPool
from .step.batch import StepBatch

__all__ = [
    "BlockAllocator",
    "BlockEvent",
    "CacheConfig",
    "CacheStats",
    "HybridKVCache",
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
