"""Errors of the serving engine."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine cannot step any more (a worker died, or it was closed)."""
