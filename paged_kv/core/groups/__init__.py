"""Layers of several kinds (full, sliding window, chunked) in one pool: per-group block
tables, windows that give their blocks back, prefix hits every kind accepts."""

from .cache import HybridKVCache

__all__ = ["HybridKVCache"]
