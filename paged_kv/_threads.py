"""CPU threads for the engine's model steps.

torch's OpenMP threads spin at every barrier by default. When another process takes one of
the cores, each small parallel region then waits for a descheduled thread (a scheduler time
slice, milliseconds), and a step of many small ops runs 10-25x slower — measured on
`paged-kv demo` on 2 cores with the other core busy. Two remedies, both here:

- `prefer_passive_waiting`, run before torch is imported (by ``paged_kv/__init__``): sets
  ``OMP_WAIT_POLICY=PASSIVE`` unless the user chose a policy, so waiting threads sleep and a
  busy core costs time in proportion to the CPU lost.
- `engine_threads` / `intra_op_threads`: when torch was imported first (the policy is then
  whatever it was), the engine runs its CPU steps on one thread, which a busy core cannot
  stall; an explicit ``num_threads`` always wins.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

_PASSIVE = False  # set once, before torch is imported


def prefer_passive_waiting() -> None:
    """Ask OpenMP for passive waiting if torch is not loaded yet and no policy is set."""
    global _PASSIVE
    if "torch" in sys.modules:
        return  # too late: OpenMP read its settings when torch loaded
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    _PASSIVE = os.environ["OMP_WAIT_POLICY"].upper() == "PASSIVE"


def engine_threads(num_threads: int | None, device_type: str) -> int | None:
    """Intra-op threads for an engine's steps: `num_threads` if given; else, on the CPU
    with spinning OpenMP threads, 1; else None (torch's own setting)."""
    if num_threads is not None:
        if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
            raise ValueError(f"num_threads: expected an int >= 1, got {num_threads!r}")
        return num_threads
    if device_type == "cpu" and not _PASSIVE:
        return 1
    return None


@contextlib.contextmanager
def intra_op_threads(num_threads: int | None) -> Iterator[None]:
    """Run the block with torch's intra-op thread count set to `num_threads` (None: as is),
    restoring it afterwards (setting it costs well under a microsecond)."""
    import torch

    previous = torch.get_num_threads()
    if num_threads is None or num_threads == previous:
        yield
        return
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
