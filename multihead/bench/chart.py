"""A PNG of the benchmark: speedup of every contender over the baseline, per workload."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def chart_figure(report) -> Any:
    """The chart as a matplotlib Figure (Agg canvas, no pyplot state). The legend sits to the
    right of the axes, where it covers no bar; a --quick report says it is a smoke test."""
    from matplotlib.figure import Figure

    workloads = report.workloads
    names = sorted({c for w in workloads for c in w["contenders"]})
    fig = Figure(figsize=(max(8, 1.3 * len(workloads)) + 2.5, 5), layout="constrained")
    ax = fig.subplots()
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        xs, ys = [], []
        for j, w in enumerate(workloads):
            row = w["contenders"].get(name)
            if row is not None:
                xs.append(j + (i - (len(names) - 1) / 2) * width)
                ys.append(row["speedup_vs_" + w["baseline"]])
        ax.bar(xs, ys, width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_xticks(range(len(workloads)))
    ax.set_xticklabels([w["title"] for w in workloads], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("speedup over baseline (log scale)")
    machine = report.machine
    title = f"multihead bench (medians), {machine['threads']} threads, torch {machine['torch']}"
    if getattr(report, "smoke_test", False):
        title += "\n--quick smoke test: warm-up dominates, not for comparison"
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    return fig


def write_chart(report, path: Path) -> Path | None:
    """Write the chart; return None (and write nothing) when matplotlib is not installed."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return None
    chart_figure(report).savefig(path, dpi=110)
    return path
