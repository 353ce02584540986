"""The shape checks every function of ``multihead.inspect`` and ``multihead.viz`` starts with."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor


def _check(weights: Tensor) -> Tensor:
    if not isinstance(weights, Tensor) or weights.dim() not in (3, 4):
        shape = tuple(weights.shape) if isinstance(weights, Tensor) else type(weights).__name__
        raise ValueError(
            f"weights must be (layers, H, L, L) or (H, L, L). Received: weights.shape={shape}"
        )
    if weights.shape[-1] != weights.shape[-2]:
        raise ValueError(
            "weights must be self-attention weights, square in the last two dimensions. "
            f"Received: weights.shape={tuple(weights.shape)}"
        )
    return weights[None] if weights.dim() == 3 else weights


def _check_tokens(tokens: Sequence[str], n: int) -> None:
    if len(tokens) != n:
        raise ValueError(f"tokens must have one label per position ({n}). Received: {len(tokens)}")
