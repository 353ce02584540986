"""A PNG of the benchmark: speedup of every contender over the baseline, per workload."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def chart_figure(report) -> Any:
    """The chart as a matplotlib Figure (Agg canvas, no pyplot state). The legend sits to the
    right of the axes, where it covers no bar; a --quick report says it is a smoke test."""
    from matplotlib.figure import Figure

    workloads = report.workloads
    fig = Figure(figsize=(max(8, 1.3 * len(workloads)) + 2.5, 5), layout="constrained")
    ax = fig.subplots()
    speedup_bars(ax, workloads, [w["title"] for w in workloads], rotation=30)
    machine = report.machine
    title = f"multihead bench (medians), {machine['threads']} threads, torch {machine['torch']}"
    if getattr(report, "smoke_test", False):
        title += "\n--quick smoke test: warm-up dominates, not for comparison"
    ax.set_title(title)
    return fig


def speedup_bars(ax: Any, workloads: list[dict], labels: list[str], *, rotation: int = 0) -> None:
    """Every contender's speedup over its workload's baseline as grouped bars on ``ax``, each
    labelled with its ratio, on a log axis that reads as plain ratios; the legend right of
    the axes. ``workloads``: dicts with "baseline" and "contenders" ({name: {"speedup_vs_"
    + baseline: ratio}})."""
    from matplotlib.ticker import FuncFormatter

    names = sorted({c for w in workloads for c in w["contenders"]})
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        xs, ys = [], []
        for j, w in enumerate(workloads):
            row = w["contenders"].get(name)
            if row is not None:
                xs.append(j + (i - (len(names) - 1) / 2) * width)
                ys.append(row["speedup_vs_" + w["baseline"]])
        bars = ax.bar(xs, ys, width, label=name)
        ax.bar_label(bars, labels=[f"{y:.2f}x" for y in ys], fontsize=6, padding=2)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")
    plain = FuncFormatter(lambda y, _: f"{y:g}x")
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)
    ax.tick_params(axis="y", which="minor", labelsize=7)
    ax.set_xticks(range(len(workloads)))
    ha = "right" if rotation else "center"
    ax.set_xticklabels(labels, rotation=rotation, ha=ha, fontsize=8)
    ax.set_ylabel("speedup over the baseline (log scale)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


def write_chart(report, path: Path) -> Path | None:
    """Write the chart; return None (and write nothing) when matplotlib is not installed."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return None
    chart_figure(report).savefig(path, dpi=110)
    return path
