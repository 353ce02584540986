"""The names of the attention statistics, defined once: ``multihead.attention_stats`` checks
requests against them, and a backend that folds them into its pass returns them in this order
(the fused kernel's ``forward_stats``)."""

from __future__ import annotations

__all__ = ["KEY_STATS", "STATS"]

STATS = ("key_mass", "window_mass", "entropy", "head_mean")
KEY_STATS = ("key_mass", "window_mass")  # summed over query rows: they accumulate over calls
