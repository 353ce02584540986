"""The names of the attention statistics, defined once: ``multihead.attention_stats`` checks
requests against them, and a backend that folds them into its pass returns them in this order
(the fused kernel's ``forward_stats``); ``check_stats`` checks a request."""

from __future__ import annotations

__all__ = ["KEY_STATS", "STATS", "check_stats"]

STATS = ("key_mass", "window_mass", "entropy", "head_mean")
KEY_STATS = ("key_mass", "window_mass")  # summed over query rows: they accumulate over calls


def check_stats(stats: object, window: object) -> tuple[str, ...]:
    """``stats`` as a tuple of distinct known names, with ``window`` checked against them."""
    if isinstance(stats, str) or not isinstance(stats, (list, tuple)):
        raise ValueError(
            f"stats must be a list or tuple of names from {list(STATS)}. Received: stats={stats!r}"
        )
    names = tuple(stats)
    unknown = [s for s in names if s not in STATS]
    if unknown:
        raise ValueError(
            f"unknown statistic {unknown[0]!r}; the statistics are {', '.join(STATS)}. "
            f"Received: stats={list(names)!r}"
        )
    if len(set(names)) != len(names):
        raise ValueError(f"stats must not repeat a name. Received: stats={list(names)!r}")
    if "window_mass" in names and window is None:
        raise ValueError(
            "window_mass sums the weights of the last `window` query rows: give window= "
            "(an int >= 1). Received: window=None"
        )
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an int >= 1. Received: window={window!r}")
        if "window_mass" not in names:
            raise ValueError(
                "window only applies to window_mass, which stats does not ask for. "
                f"Received: window={window!r}, stats={list(names)!r}"
            )
    return names
