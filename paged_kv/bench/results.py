"""What a workload hands the report: figures against baselines, facts, and plots."""

from __future__ import annotations

import dataclasses

from .timing import Figure


@dataclasses.dataclass(frozen=True, slots=True)
class Series:
    """One line (or set of bars / points) of a plot; `low` / `high` draw a min-max band."""

    name: str
    x: tuple[float, ...] | tuple[str, ...]
    y: tuple[float, ...]
    low: tuple[float, ...] | None = None
    high: tuple[float, ...] | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Plot:
    """One panel: ``kind`` is ``"line"``, ``"bar"`` (grouped, x are labels) or ``"scatter"``."""

    title: str
    xlabel: str
    ylabel: str
    series: tuple[Series, ...]
    kind: str = "line"
    logx: bool = False
    logy: bool = False


@dataclasses.dataclass(frozen=True)
class WorkloadResult:
    """A workload's outcome.

    Parameters
    ----------
    key : str
        Short name (the PNG is ``<key>.png``).
    title, description : str
        Section heading, and what is measured and how.
    figures : list of Figure
        Every number with its same-run baseline and ratio.
    info : dict
        Facts that are not comparisons (trace shape, shapes, counts).
    plots : list of Plot
        Panels of the workload's PNG.
    notes : list of str
        Caveats worth reading next to the numbers.
    """

    key: str
    title: str
    description: str
    figures: list[Figure]
    info: dict = dataclasses.field(default_factory=dict)
    plots: list[Plot] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
