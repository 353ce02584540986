"""The table ``multihead train`` prints when it ends: every test metric of the model beside its
baselines', read from the run's metrics (the same numbers as metrics.json)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

__all__ = ["LOWER_IS_BETTER", "metric_groups", "summarize"]

# metrics where a smaller value is the better one; every other metric is better when larger
LOWER_IS_BETTER = frozenset({"mae", "mase", "mse", "rmse", "loss", "perplexity"})


def _scalars(row: Mapping[str, Any]) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in row.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def _table(value: Any) -> dict[str, dict[str, float]] | None:
    """``value`` as {contender: {metric: number}} when it is a metrics table, else None."""
    if not isinstance(value, Mapping) or "model" not in value:
        return None
    rows = {k: _scalars(v) for k, v in value.items() if isinstance(v, Mapping)}
    rows = {k: v for k, v in rows.items() if v}
    return rows if "model" in rows else None


def metric_groups(metrics: Mapping[str, Any]) -> Iterator[tuple[str, dict[str, dict[str, float]]]]:
    """Every metrics table in a run's metrics, with the name of what it measures: the run's own
    (``metrics``), or one per domain or series (``domains``/``series`` -> name -> ``metrics``)."""
    table = _table(metrics.get("metrics"))
    if table is not None:
        yield "test set", table
    for key in ("domains", "series"):
        groups = metrics.get(key)
        if not isinstance(groups, Mapping):
            continue
        for name, group in groups.items():
            table = _table(group.get("metrics") if isinstance(group, Mapping) else None)
            if table is not None:
                yield str(name), table


def _cell(value: float | None) -> str:
    if value is None:
        return "-"
    if not math.isfinite(value):
        return "nan"
    return f"{value:.3f}" if abs(value) >= 1e-3 or value == 0 else f"{value:.2e}"


def _best(table: dict[str, dict[str, float]], metric: str) -> float | None:
    values = [row[metric] for row in table.values() if math.isfinite(row.get(metric, math.nan))]
    if not values:
        return None
    return (min if metric in LOWER_IS_BETTER else max)(values)


def _direction(metric: str) -> str:
    return f"{metric} ({'lower' if metric in LOWER_IS_BETTER else 'higher'} is better)"


def _row(row: dict[str, float], columns: list[str], best: dict[str, float | None]) -> str:
    cells = []
    for m in columns:
        star = best[m] is not None and row.get(m) == best[m]
        cells.append(_cell(row.get(m)) + ("*" if star else " "))
    return "".join(f"  {c:>24}" for c in cells)


def _group(name: str, table: dict[str, dict[str, float]]) -> list[str]:
    """One group's lines: a header naming each metric's direction, then the model's row and
    its baselines', the best value of each column starred."""
    columns = sorted({m for row in table.values() for m in row})
    best = {m: _best(table, m) for m in columns}
    width = max(len(k) for k in table)
    lines = [f"\n{name}", "  " + " " * width + "".join(f"  {_direction(m):>24}" for m in columns)]
    for contender in ["model", *(k for k in table if k != "model")]:
        lines.append(f"  {contender:<{width}}" + _row(table[contender], columns, best))
    return lines


def summarize(metrics: Mapping[str, Any], out: str | Path) -> str:
    """The text printed when a run ends: one table per metrics group (rows: the model, then
    its baselines; the best value of each metric starred) and the folder written."""
    lines = []
    for name, table in metric_groups(metrics):
        lines += _group(name, table)
    if lines:
        task = metrics.get("task", "train")
        lines = [f"{task}: test metrics of the model and its baselines", *lines]
        lines.append("\n* best in its column")
    lines.append(f"wrote {out}")
    return "\n".join(lines)
