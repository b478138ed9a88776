"""The benchmark report: ``report.md``, ``results.json``, one PNG per workload, and the
summary table printed on stdout. matplotlib (the ``plot`` extra) is imported only here,
when plots are drawn, with the Agg backend.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
from pathlib import Path

import numpy as np
import torch

from .results import Plot, WorkloadResult


def machine_info() -> dict[str, str]:
    """CPU model and cores, OS, versions, device, threads and the date (UTC)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as file:
            models = [line.split(":", 1)[1].strip() for line in file
                      if line.startswith("model name")]
        cpu = models[0] if models else cpu
    except OSError:
        pass
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none (CPU only)"
    return {"CPU": cpu, "cores": str(os.cpu_count()), "torch threads": str(torch.get_num_threads()),
            "OS": platform.platform(), "Python": platform.python_version(),
            "torch": torch.__version__, "numpy": np.__version__, "GPU": device,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def fmt(value: float) -> str:
    """A number with about three significant digits, thousands separated.

    Examples
    --------
    >>> fmt(123456.7), fmt(42.123), fmt(0.98765), fmt(0.000123)
    ('123,457', '42.1', '0.988', '1.23e-04')
    """
    size = abs(value)
    if size >= 1000:
        return f"{value:,.0f}"
    if size >= 10:
        return f"{value:.1f}"
    if size >= 0.01 or size == 0:
        return f"{value:.3f}"
    return f"{value:.2e}"


def _spread(figure: dict, prefix: str = "") -> str:
    median, low, high = (figure[prefix + k] for k in ("median", "min", "max"))
    return f"{fmt(median)} [{fmt(low)}–{fmt(high)}] {figure['unit']}"


def to_json(command: str, machine: dict, mode: str, wall_time: float,
            results: list[WorkloadResult]) -> dict:
    """Everything the report shows, as plain JSON."""
    return {"command": command, "machine": machine, "mode": mode, "wall_time_s": wall_time,
            "workloads": [{"key": r.key, "title": r.title, "description": r.description,
                           "figures": [f.as_dict() for f in r.figures], "info": r.info,
                           "notes": r.notes, "plot": f"{r.key}.png"} for r in results]}


def markdown(data: dict) -> str:
    """``report.md`` from the `to_json` form."""
    lines = ["# paged_kv benchmark report", "", f"Command: `{data['command']}`", "",
             f"Mode: {data['mode']}; wall time {data['wall_time_s']:.1f} s.", "",
             *[f"**Warning:** {w}\n" for w in data.get("warnings", [])],
             "## Machine", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in data["machine"].items()]
    lines += ["", "Every figure is the median [min–max] over repeats, next to its baseline "
              "measured in the same run; the ratio is oriented so that above 1 means the paged "
              "cache is better (baseline / paged for times, paged / baseline otherwise).", ""]
    for w in data["workloads"]:
        lines += [f"## {w['title']}", "", w["description"], "",
                  "| figure | paged | baseline | baseline value | ratio |",
                  "|---|---|---|---|---|"]
        lines += [f"| {f['name']} | {_spread(f)} | {f['baseline']} | "
                  f"{_spread(f, 'baseline_')} | {f['ratio']:.2f}x |" for f in w["figures"]]
        lines += [""] + [f"- {k}: {fmt(v) if isinstance(v, float) else v}"
                         for k, v in w["info"].items()]
        lines += [f"\n> {note}" for note in w["notes"]]
        lines += ["", f"![{w['key']}]({w['plot']})", ""]
    return "\n".join(lines)


def summary_table(data: dict) -> str:
    """The table printed on stdout: one row per figure, medians and ratio."""
    rows = []
    for w in data["workloads"]:
        rows.append(f"\n{w['title']}")
        for f in w["figures"]:
            rows.append(f"  {f['name'][:66]:<66} {fmt(f['median']):>10} "
                        f"{fmt(f['baseline_median']):>10} {f['unit']:<12} {f['ratio']:>6.2f}x"
                        f"  vs {f['baseline'][:40]}")
    header = f"  {'figure':<66} {'paged':>10} {'baseline':>10} {'unit':<12} {'ratio':>7}"
    return "\n".join([f"paged_kv bench ({data['mode']}, {data['wall_time_s']:.1f} s)", header,
                      *rows])


def write_report(out: Path, data: dict, results: list[WorkloadResult]) -> list[str]:
    """Write ``results.json``, the PNGs and ``report.md`` under `out`; returns warnings."""
    warnings = []
    try:
        for result in results:
            draw(result, out / f"{result.key}.png")
    except ImportError:
        warnings.append("matplotlib is not installed (pip install 'paged_kv[plot]'): no plots")
    data["warnings"] = warnings
    (out / "results.json").write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    (out / "report.md").write_text(markdown(data) + "\n", encoding="utf-8")
    return warnings


def draw(result: WorkloadResult, path: Path) -> None:
    """One PNG with a panel per plot of `result` (Agg canvas, no pyplot state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6.4 * len(result.plots), 4.6))
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, len(result.plots), squeeze=False)[0]
    for ax, plot in zip(axes, result.plots, strict=True):
        _draw_panel(ax, plot)
    figure.suptitle(result.title)
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def _draw_panel(ax, plot: Plot) -> None:
    if plot.kind == "bar":
        labels = plot.series[0].x
        positions = np.arange(len(labels))
        width = 0.8 / len(plot.series)
        for i, s in enumerate(plot.series):
            y = np.array(s.y)
            error = None if s.low is None else [y - np.array(s.low), np.array(s.high) - y]
            ax.bar(positions + (i - (len(plot.series) - 1) / 2) * width, y, width,
                   yerr=error, capsize=3, label=s.name)
        ax.set_xticks(positions, labels, rotation=15, ha="right")
    for s in plot.series if plot.kind != "bar" else ():
        if plot.kind == "scatter":
            ax.scatter(s.x, s.y, s=5, alpha=0.4, label=s.name)
            continue
        ax.plot(s.x, s.y, marker="o", markersize=3, label=s.name)
        if s.low is not None:
            ax.fill_between(s.x, s.low, s.high, alpha=0.2)
    if plot.logx:
        ax.set_xscale("log", base=2)
    if plot.logy:
        ax.set_yscale("log")
    ax.set(title=plot.title, xlabel=plot.xlabel, ylabel=plot.ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
