"""The options every benchmark shares: where its results go and how often it times."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .._flags import option, positive_int

__all__ = ["Results", "Timed", "goal_line"]


@dataclass(frozen=True, kw_only=True)
class Results:
    """A benchmark's output folder."""

    out: Path = option(Path("bench-results"), "folder for the results", metavar="DIR")


@dataclass(frozen=True, kw_only=True)
class Timed(Results):
    """A benchmark that times each contender several times."""

    repeats: int | None = option(
        None,
        "timed repeats per contender (default: 3; kernels: 5, with --quick 3)",
        parse=positive_int,
    )


def goal_line(goal: dict) -> str:
    """A goal as the benchmarks print it: ``goal TEXT: FIGURE -> met`` (or ``MISSED``), the
    figure to four significant digits, so one that falls just short of its threshold does not
    read as the threshold itself (0.6997 against 0.70, where two decimals or three digits
    print 0.70 and 0.7)."""
    return f"  goal {goal['text']}: {goal['figure']:.4g} -> {'met' if goal['met'] else 'MISSED'}"
