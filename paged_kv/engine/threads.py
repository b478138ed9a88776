"""CPU threads for the engine's steps: all of torch's threads while the cores are free, one
while other processes hold them.

torch's OpenMP threads spin at every barrier. When another process takes one of the
cores, each small parallel region waits for a descheduled thread (a scheduler time slice,
milliseconds), and a step of many small ops runs 2-25x slower: `paged-kv demo` on 2 cores
took 10 s instead of 2.6 s with one other busy process, and 40-64 s under heavier load.
One thread runs at the speed of the core it has (4.1 s both idle and busy), but leaves the
second core unused on an idle machine; waiting passively (``OMP_WAIT_POLICY=PASSIVE``)
costs as much as one thread when idle (3.8-4.3 s), measured the same day.

So the engine measures: every half second of stepping, `ThreadGovernor` reads how much CPU
the other processes of the machine used (``/proc/stat`` minus this process's own time) and
runs the next steps on the cores left free, at least one. An explicit ``num_threads``
always wins; where ``/proc/stat`` is missing torch's own count is kept.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

PERIOD_S = 0.5  # how often the governor looks at the machine


def _busy_ticks() -> tuple[int, int] | None:
    """``(busy, total)`` clock ticks of all CPUs since boot, or None off Linux."""
    try:
        with open("/proc/stat", encoding="ascii") as stat:
            fields = [int(v) for v in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields[:8]) - idle, sum(fields[:8])


class ThreadGovernor:
    """Chooses the intra-op thread count of the engine's steps.

    Parameters
    ----------
    num_threads : int, optional
        Fixed count; None lets the governor follow the cores other processes leave free.
    max_threads : int, optional
        The most it uses (default: torch's thread count when the governor is made).
    """

    def __init__(self, num_threads: int | None = None, max_threads: int | None = None) -> None:
        if num_threads is not None and (isinstance(num_threads, bool)
                                        or not isinstance(num_threads, int) or num_threads < 1):
            raise ValueError(f"num_threads: expected an int >= 1, got {num_threads!r}")
        import torch

        self.fixed = num_threads
        self.max_threads = max_threads or torch.get_num_threads()
        self.threads = num_threads or self.max_threads
        self._ticks_per_s = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._last = self._sample()

    def _sample(self) -> tuple[float, float, tuple[int, int] | None]:
        return time.monotonic(), time.process_time(), _busy_ticks()

    def step_threads(self) -> int:
        """The thread count for the next step (re-read from the machine at most every
        `PERIOD_S` seconds)."""
        if self.fixed is not None or time.monotonic() - self._last[0] < PERIOD_S:
            return self.threads
        now = wall, own, ticks = self._sample()
        last_wall, last_own, last_ticks = self._last
        self._last = now
        if ticks is None or last_ticks is None:
            return self.threads
        machine = (ticks[0] - last_ticks[0]) / self._ticks_per_s  # CPU-seconds, all processes
        others = max(0.0, machine - (own - last_own)) / (wall - last_wall)  # cores in use
        cores = os.cpu_count() or 1
        self.threads = max(1, min(self.max_threads, round(cores - others)))
        return self.threads


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
