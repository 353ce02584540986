"""Statistics of the softmax weights reduced from the weights themselves, for a statistics
call (``Call.stats``) that no backend folds into its own pass: the registry's fallback.

``sweep`` runs the call's query rows in slices: each slice is one call for the weights of the
chosen heads on the slice's rows (the mask and bias cropped to them, so a causal or windowed
slice skips what it hides), which returns the output rows of every head beside those
weights; ``Reducer`` folds the slice's weights into the statistics at once and they are
dropped. The output is assembled from the same calls, so the statistics cost the weights of
one slice in memory and one weights pass in time. Each slice runs through ``registry.run``
(handed in as ``run``), so the NaN rule's careful path covers inputs holding NaN or ±inf.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import torch
from torch import Tensor

from ._tensors import stat_dtype
from .call import Call

__all__ = ["Reducer", "slice_rows", "sweep"]

# the weights of one slice of query rows: bounded so the sweep's memory stays far below what
# holding (B, h, L, S) costs at the lengths statistics are for
SLICE_BYTES = 16 << 20


class Reducer:
    """Folds slices of weights (B, h, rows, S) into the statistics, slice by slice.

    Args:
        names: the statistics wanted (names from ``stat_names.STATS``).
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
    """Query rows per slice: their weights (B, h, rows, S) in float32 fit ``SLICE_BYTES``."""
    return max(1, min(length_q, SLICE_BYTES // max(1, 4 * batch * heads * length_k)))


Run = Callable[[Call], tuple[Tensor | None, Tensor | None]]


def sweep(call: Call, run: Run) -> tuple[Tensor, dict[str, Tensor]]:
    """The output of the statistics call ``call`` and its statistics, reduced from the weights
    of one slice of query rows at a time, each slice a weights call handed to ``run``."""
    assert call.stats is not None
    b, h, _, length_q, length_k, _ = call.shape
    index = tuple(range(h)) if call.heads is None else call.heads
    reducer = Reducer(
        call.stats, call.window, (b, len(index), length_q, length_k),
        stat_dtype(call.query.dtype), call.query.device,
    )  # fmt: skip
    weights_call = replace(call, stats=None, window=None, return_weights=True, heads=index)
    rows = slice_rows(b, len(index), length_k, length_q)
    outputs = []
    for r0 in range(0, max(length_q, 1), rows):  # L = 0: one call of no rows
        r1 = min(r0 + rows, length_q)
        out, weights = run(_rows(weights_call, r0, r1))
        assert out is not None and weights is not None
        outputs.append(out)
        reducer.add(weights, r0)
    output = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)
    return output, reducer.result()


def _rows(call: Call, r0: int, r1: int) -> Call:
    """``call`` on query rows [r0, r1): the query, mask and bias cropped to them."""
    _, _, _, length_q, length_k, _ = call.shape
    if r0 == 0 and r1 == length_q:
        return call
    crop = (length_q, length_k, r0, r1, 0, length_k)
    return replace(
        call,
        query=call.query[:, :, r0:r1],
        mask=None if call.mask is None else call.mask.crop(*crop),
        bias=None if call.bias is None else call.bias.crop(*crop),
    )
