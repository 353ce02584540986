"""Rotary position embedding (RoPE, Su et al. 2021 "RoFormer"), applied to queries and keys.

Each pair of features of a head is rotated by an angle proportional to the token's position, so
the score q . k depends on the positions only through their difference. Positions are explicit
(B, L) integers: packed documents restart at 0, and cached decoding continues at each row's own
offset.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .. import _validation as V
from .._saveable import saveable

__all__ = ["RotaryEmbedding"]


@saveable("multihead.RotaryEmbedding")
class RotaryEmbedding(nn.Module):
    """Rotate (B, H, L, D) queries or keys by their positions; no parameters.

    Frequency i (of D / 2) is ``theta_i = base ** (-2i / D)``; a token at position p has its
    feature pair i rotated by the angle ``p * theta_i``::

        (x_a, x_b) -> (x_a cos(p theta_i) - x_b sin(p theta_i),
                       x_b cos(p theta_i) + x_a sin(p theta_i))

    The pairs are ``(x[i], x[i + D/2])`` in the half-split layout (``interleaved=False``;
    GPT-NeoX, Llama and Hugging Face checkpoints) and ``(x[2i], x[2i + 1])`` in the interleaved
    layout (``interleaved=True``; GPT-J and the original RoFormer).

    Angles and their cosines are computed in float32 (float64 for float64 inputs) with the same
    operations as transformers' Llama rotary, then cast to the input dtype, so a Llama loaded
    here matches transformers to rounding.

    Args:
        head_dim: D, the dim of each head; even.
        base: the wavelength base (``rope_theta`` in Hugging Face configs).
        interleaved: pair neighbouring features instead of the two halves.
    """

    def __init__(self, head_dim: int, *, base: float = 10000.0, interleaved: bool = False) -> None:
        super().__init__()
        V.check_positive_int("head_dim", head_dim)
        if head_dim % 2:
            raise ValueError(
                "rotary embeddings rotate pairs of features, so head_dim must be even. "
                f"Received: head_dim={head_dim}"
            )
        if isinstance(base, bool) or not isinstance(base, (int, float)) or not base > 0:
            raise ValueError(f"base must be a positive number. Received: base={base!r}")
        if not isinstance(interleaved, bool):
            raise TypeError(f"interleaved must be a bool. Received: interleaved={interleaved!r}")
        self.head_dim, self.base, self.interleaved = head_dim, float(base), interleaved

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, base={self.base}, interleaved={self.interleaved}"

    def inv_freq(self, dtype: torch.dtype = torch.float32, device=None) -> Tensor:
        """The D / 2 frequencies ``theta_i``, computed as transformers does."""
        exponent = torch.arange(0, self.head_dim, 2, dtype=dtype, device=device) / self.head_dim
        return 1.0 / (self.base**exponent)

    def angles(self, positions: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        """``positions[..., None] * theta``: (..., D / 2) in ``dtype``."""
        return positions[..., None].to(dtype) * self.inv_freq(dtype, positions.device)

    def forward(self, x: Tensor, positions: Tensor | None = None) -> Tensor:
        """Rotate ``x``.

        Args:
            x: (B, H, L, D) queries or keys.
            positions: (B, L) or (L,) integer positions; default 0..L-1.

        Returns:
            (B, H, L, D), same dtype as ``x``.
        """
        V.check_rank("x", x, 4, "(B, H, L, D)")
        b, _, length, d = x.shape
        if d != self.head_dim:
            raise ValueError(
                f"x must have head dim D={self.head_dim} in its last dimension. "
                f"Received: x.shape={tuple(x.shape)}"
            )
        if positions is None:
            positions = torch.arange(length, device=x.device)
        elif (
            not isinstance(positions, Tensor)
            or positions.dtype == torch.bool
            or (positions.is_floating_point() or positions.is_complex())
        ):
            got = positions.dtype if isinstance(positions, Tensor) else type(positions).__name__
            raise TypeError(f"positions must be an integer tensor. Received: {got}")
        elif tuple(positions.shape) not in ((length,), (b, length)):
            raise ValueError(
                f"positions must have shape (L,) or (B, L) = {(b, length)}. "
                f"Received: positions.shape={tuple(positions.shape)}"
            )
        return self.rotate(x, *self.cos_sin(positions, x.dtype, x.device))

    def cos_sin(
        self, positions: Tensor, dtype: torch.dtype, device: torch.device
    ) -> tuple[Tensor, Tensor]:
        """The cosines and sines ``forward`` rotates by, for integer positions (L,) or (B, L)
        (checked by the caller): each (L, D / 2) or (B, 1, L, D / 2), computed in float32
        (float64 for float64) and cast to ``dtype``. A decoding step makes them once for all
        its layers (``modules/decoding_python.py``)."""
        work = torch.float64 if dtype == torch.float64 else torch.float32
        angle = self.angles(positions.to(device), work)  # [B|., L, D/2]
        if angle.dim() == 3:
            angle = angle[:, None]  # [B, 1, L, D/2]: the same rotation for every head
        return angle.cos().to(dtype), angle.sin().to(dtype)

    def rotate(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x (B, H, L, D) rotated by ``cos_sin``'s cosines and sines, in this embedding's
        layout of pairs."""
        d = x.shape[-1]
        if self.interleaved:
            pairs = x.unflatten(-1, (d // 2, 2))
            a, c = pairs[..., 0], pairs[..., 1]
            return torch.stack((a * cos - c * sin, c * cos + a * sin), dim=-1).flatten(-2)
        a, c = x[..., : d // 2], x[..., d // 2 :]
        return torch.cat((a * cos - c * sin, c * cos + a * sin), dim=-1)
