"""A PNG of the benchmark: speedup of every contender over the baseline, per workload."""

from __future__ import annotations

from pathlib import Path


def write_chart(report, path: Path) -> Path | None:
    """Write the chart; return None (and write nothing) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    workloads = report.workloads
    names = sorted({c for w in workloads for c in w["contenders"]})
    fig, ax = plt.subplots(figsize=(max(8, 1.3 * len(workloads)), 5))
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
    ax.set_title(
        f"multihead bench (medians), {machine['threads']} threads, torch {machine['torch']}"
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
