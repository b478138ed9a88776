"""Repeats, medians and ratios: the shape every benchmark figure takes.

A `Stat` is one quantity measured over repeats (median, min, max); a `Figure` is a `Stat`
of the paged cache next to a `Stat` of its baseline from the same run, and their ratio,
oriented so that a ratio above 1 always means the paged cache is better.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Sequence

import torch


@dataclasses.dataclass(frozen=True, slots=True)
class Stat:
    """One quantity over repeats.

    Parameters
    ----------
    values : tuple of float
        One value per repeat (at least one).
    unit : str
        E.g. ``"s"``, ``"GB/s"``, ``"fraction"``.
    """

    values: tuple[float, ...]
    unit: str

    @property
    def median(self) -> float:
        return float(statistics.median(self.values))

    @property
    def min(self) -> float:
        return float(min(self.values))

    @property
    def max(self) -> float:
        return float(max(self.values))

    def scaled(self, factor: float, unit: str) -> Stat:
        """The same repeats times `factor` (e.g. seconds to microseconds)."""
        return Stat(tuple(v * factor for v in self.values), unit)

    def inverse(self, numerator: float, unit: str) -> Stat:
        """``numerator / value`` per repeat (e.g. bytes over seconds -> bytes per second)."""
        return Stat(tuple(numerator / v for v in self.values), unit)


@dataclasses.dataclass(frozen=True, slots=True)
class Figure:
    """A paged measurement, its same-run baseline, and their ratio (> 1: paged is better).

    Parameters
    ----------
    name : str
        What was measured, e.g. ``"trace replay, total time"``.
    value, baseline : Stat
        The paged cache's and the baseline's repeats, same unit.
    baseline_name : str
        What the baseline is.
    higher_is_better : bool
        Orientation of the ratio: ``value / baseline`` when True, else ``baseline / value``.
    """

    name: str
    value: Stat
    baseline_name: str
    baseline: Stat
    higher_is_better: bool

    @property
    def ratio(self) -> float:
        paged, base = self.value.median, self.baseline.median
        return paged / base if self.higher_is_better else base / paged

    def as_dict(self) -> dict:
        """Plain-JSON form (what ``results.json`` holds)."""
        return {"name": self.name, "unit": self.value.unit, "median": self.value.median,
                "min": self.value.min, "max": self.value.max,
                "repeats": len(self.value.values), "baseline": self.baseline_name,
                "baseline_median": self.baseline.median, "baseline_min": self.baseline.min,
                "baseline_max": self.baseline.max, "ratio": self.ratio,
                "higher_is_better": self.higher_is_better}


def synchronize(device: torch.device | str | None) -> None:
    """Wait for queued kernels on a CUDA `device` (no-op on CPU)."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], object], *, repeats: int, warmup: int = 1,
              device: torch.device | str | None = None, unit: str = "s") -> Stat:
    """Wall time of `fn()` over `repeats` calls after `warmup` untimed ones.

    Examples
    --------
    >>> stat = time_call(lambda: sum(range(100)), repeats=3)
    >>> len(stat.values), stat.min <= stat.median <= stat.max
    (3, True)
    """
    for _ in range(warmup):
        fn()
    synchronize(device)
    values = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize(device)
        values.append(time.perf_counter() - start)
    return Stat(tuple(values), unit)


def time_interleaved(fns: Sequence[Callable[[], object]], *, repeats: int, warmup: int = 1,
                     device: torch.device | str | None = None, unit: str = "s") -> list[Stat]:
    """Like `time_call` for several functions, alternating them within each repeat so that
    drift in a shared machine's speed hits all of them alike.

    Examples
    --------
    >>> fast, slow = time_interleaved([lambda: None, lambda: sum(range(10**5))], repeats=3)
    >>> fast.median < slow.median
    True
    """
    for fn in fns:
        for _ in range(warmup):
            fn()
    synchronize(device)
    values: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, times in zip(fns, values, strict=True):
            start = time.perf_counter()
            fn()
            synchronize(device)
            times.append(time.perf_counter() - start)
    return [Stat(tuple(times), unit) for times in values]


def percentile(values: Sequence[float], q: float) -> float:
    """The `q`-th percentile (0-100) of `values`, linear interpolation; NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)
