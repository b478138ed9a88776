"""Exceptions raised by paged_kv: one base class, and a typed event for running out of blocks."""

from __future__ import annotations


class PagedKVError(Exception):
    """Base class of every error paged_kv raises on purpose."""


class OutOfBlocksError(PagedKVError):
    """A call needed more KV blocks than the pool can give; nothing was changed.

    Parameters
    ----------
    requested : int
        Blocks the call needed (copy-on-write copies included).
    free : int
        Blocks obtainable now: free blocks plus evictable cached blocks.
    """

    def __init__(self, requested: int, free: int, what: str = "prepare()") -> None:
        self.requested = requested
        self.free = free
        super().__init__(
            f"{what}: out of KV blocks: requested {requested}, only {free} obtainable "
            f"(free + evictable cached); free finished sequences, preempt one, "
            f"or raise num_blocks"
        )


class InvariantError(PagedKVError):
    """An internal invariant of the cache is broken: a bug in paged_kv, never a caller mistake."""


def ensure(condition: bool, message: str) -> None:
    """Raise `InvariantError(message)` unless `condition`; an explicit raise, not an assert,
    so invariant checks keep working under ``python -O``."""
    if not condition:
        raise InvariantError(message)
