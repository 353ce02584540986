"""Normalization layers besides ``torch.nn.LayerNorm``: RMSNorm (Zhang & Sennrich 2019)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .. import _validation as V
from .._saveable import saveable

__all__ = ["RMSNorm"]


@saveable("multihead.RMSNorm")
class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim; no centering, no bias.

    The statistics are taken in float32 (or float64 for float64 inputs), then the normalized
    value is cast back to the input dtype before the weight multiplies it: the order Llama's
    reference code and transformers use, so half-precision results match them bit for bit.

    Args:
        dim: E, the normalized width.
        eps: added to the mean square (Llama: 1e-5 or 1e-6, from ``rms_norm_eps``).
    """

    def __init__(self, dim: int, *, eps: float = 1e-6) -> None:
        super().__init__()
        V.check_positive_int("dim", dim)
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
            raise ValueError(f"eps must be a number >= 0. Received: eps={eps!r}")
        self.eps = float(eps)
        self.weight = nn.Parameter(torch.ones(dim))

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"

    def forward(self, x: Tensor) -> Tensor:
        """x: (..., E) -> (..., E)."""
        if x.shape[-1:] != self.weight.shape:
            raise ValueError(
                f"x must have last dimension {self.weight.shape[0]}. "
                f"Received: x.shape={tuple(x.shape)}"
            )
        work = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
        normed = work * torch.rsqrt(work.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)
