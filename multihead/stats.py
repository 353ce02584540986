"""Attention statistics without the weights: one number per key, per row or per (row, key)
reduced over heads, computed where the weights are born and never held as (B, h, L, S).

``attention_stats`` is a request of the attention call (``Call.stats``) and runs through
``registry.run`` like every other call, so the NaN rule, the fallback and
``explain_backend(..., stats=...)`` cover it. A backend that declares the ``stats``
capability folds the statistics into its own pass (the fused kernel, in an eager CPU call
without gradients: each task keeps its rows' scores over their key span in cache, as the
weights path does, and adds them, normalized from the row's final maximum and sum, into the
statistics instead of writing them out; a row's entropy comes from the same sums). Where no
backend can, or the inputs hold NaN or ±inf, the registry reduces them from the weights of one
slice of query rows at a time (``backends/reduce.py``): the weights of one slice in memory and
one weights pass in time.

Statistics (``h`` = the chosen heads, all by default):

    key_mass     (B, h, S)  the weights summed over the query rows (H2O's accumulated attention)
    window_mass  (B, h, S)  summed over the last ``window`` query rows (SnapKV's observation
                            window)
    entropy      (B, h, L)  each row's -sum_j w_j log w_j, 0 for a row that sees nothing
    head_mean    (B, L, S)  the mean of the chosen heads' weights (attention rollout)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from torch import Tensor

from . import _validation as V
from . import bias as _bias
from .backends import registry
from .backends._tensors import stat_dtype
from .backends.call import prepare
from .backends.reduce import Reducer
from .backends.stat_names import KEY_STATS, STATS, check_stats
from .functional import check_heads
from .masks import Mask

__all__ = ["KEY_STATS", "STATS", "Reducer", "attention_stats", "check_stats", "stat_dtype"]


@V.torch_keywords("attention_stats()")
def attention_stats(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Mask | Tensor | None = None,
    *,
    stats: Sequence[str],
    window: int | None = None,
    heads: list[int] | None = None,
    bias: Tensor | _bias.ScoreModifier | None = None,
    scale: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """``attention`` with statistics of the softmax weights, never holding (B, h, L, S).

    Equivalent to (``weights`` from ``attention_with_weights(..., heads=heads)``)::

        key_mass    = weights.sum(2)                             # (B, h, S)
        window_mass = weights[:, :, L - window:].sum(2)          # (B, h, S)
        entropy     = -(weights * log(weights)).nansum(-1)       # (B, h, L)
        head_mean   = weights.mean(1)                            # (B, L, S)

    computed inside the fused kernel's pass where it is built (an eager CPU call without
    gradients), else slice by slice over the query rows (see the module's docstring).

    Args:
        query, key, value, mask, bias, scale: as in ``multihead.attention``.
        stats: names from ``"key_mass"``, ``"window_mass"``, ``"entropy"``, ``"head_mean"``.
        window: the last ``window`` query rows ``window_mass`` sums (>= 1; all rows when it
            exceeds L); required with ``window_mass`` and refused without it.
        heads: distinct query-head indices the statistics cover, in that order (None: all).

    Returns:
        (output (B, H, L, D_v) as ``multihead.attention`` returns it, ``{name: Tensor}``), the
        statistics in float32 for half-precision inputs and in the inputs' dtype otherwise.

    Raises:
        ValueError: an unknown or repeated statistic, ``window`` missing for ``window_mass``,
            below 1 or given without it, ``heads`` that are not distinct indices in [0, H),
            and everything ``multihead.attention`` raises.
    """
    names = check_stats(stats, window)
    h = V.check_qkv(query, key, value)[1]
    index = None if heads is None else tuple(check_heads(heads, h))
    call = prepare(query, key, value, mask, bias, scale, 0.0, False)
    out, found = registry.run(replace(call, stats=names, window=window, heads=index), "auto")
    assert out is not None and isinstance(found, dict)
    return out, found
