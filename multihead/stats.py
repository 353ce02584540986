"""Attention statistics without the weights: one number per key, per row or per (row, key)
reduced over heads, computed where the weights are born and never held as (B, h, L, S).

Where the fused kernel is built (an eager CPU call without gradients), ``attention_stats``
folds the statistics inside the kernel's pass (``backends.fused.stats``): each task keeps
its rows' scores over their key span in cache, as the weights path does, and adds them,
normalized from the row's final maximum and sum, into the statistics instead of writing them
out; a row's entropy comes from the same sums. The statistics cost one forward with the
weights path's row blocks, and the memory of the statistics themselves.

Elsewhere it sweeps the query rows in slices: each slice is one
``attention_with_weights(..., heads=...)`` call on the slice's rows (the mask and bias cropped
to them, so a causal or windowed slice skips what it hides), which returns the output rows of
every head and the weights of the chosen heads for those rows only; the slice's weights are
reduced at once and dropped. The output is assembled from the same calls, so the statistics
cost the weights of one slice in memory and one weights pass in time. Inputs holding NaN or
±inf take the sweep too, where the NaN rule's careful path runs.

Statistics (``h`` = the chosen heads, all by default):

    key_mass     (B, h, S)  the weights summed over the query rows (H2O's accumulated attention)
    window_mass  (B, h, S)  summed over the last ``window`` query rows (SnapKV's observation
                            window)
    entropy      (B, h, L)  each row's -sum_j w_j log w_j, 0 for a row that sees nothing
    head_mean    (B, L, S)  the mean of the chosen heads' weights (attention rollout)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from . import _validation as V
from . import bias as _bias
from .backends import fused
from .backends._nonfinite import NonFiniteInput
from .backends._tensors import stat_dtype
from .backends.call import prepare
from .backends.stat_names import KEY_STATS, STATS
from .functional import attention_with_weights, check_heads
from .masks import Mask, dense

__all__ = ["KEY_STATS", "STATS", "Reducer", "attention_stats", "check_stats", "stat_dtype"]


# the weights of one slice of query rows: bounded so the sweep's memory stays far below what
# holding (B, h, L, S) costs at the lengths statistics are for
_SLICE_BYTES = 16 << 20


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


class Reducer:
    """Folds slices of weights (B, h, rows, S) into the statistics, slice by slice.

    Args:
        names: the statistics wanted (checked with ``check_stats``).
        window: the rows ``window_mass`` sums (the last ``window`` of the call's L rows).
        shape: (B, h, L, S) of the weights the slices come from.
        dtype, device: of the results (float32 for half-precision inputs).
    """

    def __init__(
        self,
        names: Sequence[str],
        window: int | None,
        shape: tuple[int, int, int, int],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        b, h, length_q, length_k = shape
        self.names, self.length_q = tuple(names), length_q
        self.first_window_row = max(length_q - (window or length_q), 0)
        self.dtype = dtype

        def zeros(name: str) -> Tensor | None:
            return (
                torch.zeros(b, h, length_k, dtype=dtype, device=device) if name in names else None
            )

        self.key_mass, self.window_mass = zeros("key_mass"), zeros("window_mass")
        self.entropy: list[Tensor] = []
        self.head_mean: list[Tensor] = []

    def add(self, weights: Tensor, row0: int) -> None:
        """Take in the weights (B, h, rows, S) of query rows [row0, row0 + rows)."""
        w = weights.detach().to(self.dtype)
        if self.key_mass is not None:
            self.key_mass += w.sum(2)
        if self.window_mass is not None:
            skip = self.first_window_row - row0
            if skip < w.shape[2]:
                self.window_mass += w[:, :, max(skip, 0) :].sum(2)
        if "entropy" in self.names:
            # xlogy(0, 0) = 0: hidden keys and rows that see nothing add nothing
            self.entropy.append(-torch.special.xlogy(w, w).sum(-1))
        if "head_mean" in self.names:
            self.head_mean.append(w.mean(1))

    def result(self) -> dict[str, Tensor]:
        found = {
            "key_mass": self.key_mass,
            "window_mass": self.window_mass,
            "entropy": torch.cat(self.entropy, dim=2) if self.entropy else None,
            "head_mean": torch.cat(self.head_mean, dim=1) if self.head_mean else None,
        }
        return {name: value for name, value in found.items() if value is not None}


def slice_rows(batch: int, heads: int, length_k: int, length_q: int) -> int:
    """Query rows per slice: their weights (B, h, rows, S) in float32 fit ``_SLICE_BYTES``."""
    return max(1, min(length_q, _SLICE_BYTES // max(1, 4 * batch * heads * length_k)))


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
    b, h, _, length_q, length_k, _ = V.check_qkv(query, key, value)
    index = list(range(h)) if heads is None else check_heads(heads, h)
    if isinstance(mask, Tensor):
        V.check_mask_tensor_dtype("mask", mask)
    keep = dense(mask) if isinstance(mask, Tensor) and mask.dtype == torch.bool else mask
    modifier = _bias.as_modifier(bias)
    window_row = max(length_q - (window or length_q), 0)
    found = _in_kernel(query, key, value, keep, modifier, scale, names, window_row, index)
    if found is not None:
        return found
    reducer = Reducer(
        names, window, (b, len(index), length_q, length_k), stat_dtype(query.dtype), query.device
    )
    rows = slice_rows(b, len(index), length_k, length_q)
    outputs = []
    for r0 in range(0, length_q, rows):
        r1 = min(r0 + rows, length_q)
        whole = r0 == 0 and r1 == length_q
        part_mask, part_bias = keep, modifier
        if not whole:
            if isinstance(keep, Mask):
                part_mask = keep.crop(length_q, length_k, r0, r1, 0, length_k)
            elif isinstance(keep, Tensor):  # a float mask: slice its rows
                part_mask = keep[..., r0:r1, :] if keep.shape[-2] != 1 else keep
            if modifier is not None:
                part_bias = modifier.crop(length_q, length_k, r0, r1, 0, length_k)
        out, weights = attention_with_weights(
            query[:, :, r0:r1], key, value, part_mask, bias=part_bias, scale=scale, heads=index
        )
        outputs.append(out)
        reducer.add(weights, r0)
    output = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)
    return output, reducer.result()


def _in_kernel(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    keep: Mask | Tensor | None,
    modifier: _bias.ScoreModifier | None,
    scale: float | None,
    names: tuple[str, ...],
    window_row: int,
    index: list[int],
) -> tuple[Tensor, dict[str, Tensor]] | None:
    """The statistics folded inside the fused kernel's pass (``fused.stats``) where the kernel
    is built and takes the call (an eager CPU call without gradients or dropout); None where
    not, or where the inputs hold NaN or +-inf (the slice sweep then runs the NaN rule's
    careful path)."""
    if not names or query.device.type != "cpu" or not fused.built():
        return None
    call = prepare(query, key, value, keep, modifier, scale, 0.0, False)
    if call.traced or call.needs_grad or fused.BACKEND.why_not(call) is not None:
        return None
    try:
        return fused.stats(call, names, window_row, index)
    except NonFiniteInput:
        return None
