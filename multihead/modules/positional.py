"""Absolute positional encodings added to token embeddings: sinusoidal (fixed) and learned.

Both take optional explicit ``positions`` so packed sequences can restart at 0 per document.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .. import _validation as V
from .._saveable import saveable

__all__ = ["LearnedPositionalEncoding", "SinusoidalPositionalEncoding", "sinusoidal_table"]


def sinusoidal_table(length: int, embed_dim: int, *, base: float = 10000.0) -> Tensor:
    """The (length, E) table of Vaswani et al. 2017, section 3.5, in fp32.

    ``table[p, 2i] = sin(p / base^(2i / E))`` and ``table[p, 2i + 1] = cos(p / base^(2i / E))``.
    """
    V.check_positive_int("embed_dim", embed_dim)
    if embed_dim % 2:
        raise ValueError(
            f"sinusoidal encodings pair a sine and a cosine per frequency, so embed_dim must be "
            f"even. Received: embed_dim={embed_dim}"
        )
    position = torch.arange(length, dtype=torch.float64)[:, None]
    inv_freq = base ** (-torch.arange(0, embed_dim, 2, dtype=torch.float64) / embed_dim)
    angle = position * inv_freq  # [length, E / 2]
    table = torch.stack([angle.sin(), angle.cos()], dim=-1).reshape(length, embed_dim)
    return table.float()


def _tracing() -> bool:
    return torch.compiler.is_exporting() or torch.compiler.is_compiling()


def _positions(x: Tensor, positions: Tensor | None, limit: int | None) -> Tensor:
    V.check_rank("x", x, 3, "(B, L, E)")
    if positions is None:
        positions = torch.arange(x.shape[1], device=x.device)
    elif positions.dtype in (torch.bool,) or positions.is_floating_point():
        raise TypeError(
            f"positions must be an integer tensor. Received: positions.dtype={positions.dtype}"
        )
    elif positions.shape not in ((x.shape[1],), tuple(x.shape[:2])):
        raise ValueError(
            f"positions must have shape (L,) or (B, L) = {tuple(x.shape[:2])}. "
            f"Received: positions.shape={tuple(positions.shape)}"
        )
    # the range check reads the tensor on the host: skipped while exporting (torch.export /
    # ONNX) and while compiling (torch.compile), where it would be a data-dependent branch
    # (a graph break per read); the traced graph's callers own it
    if positions.numel() and not _tracing():
        low, high = int(positions.min()), int(positions.max())
        if low < 0 or (limit is not None and high >= limit):
            bound = "" if limit is None else f" and below max_len={limit}"
            raise ValueError(
                f"positions must be >= 0{bound}; longer inputs need a larger max_len or "
                f"truncation. Received: positions from {low} to {high}"
            )
    return positions


@saveable("multihead.SinusoidalPositionalEncoding")
class SinusoidalPositionalEncoding(nn.Module):
    """``x + table[positions]`` with the fixed sinusoidal table; no parameters.

    Args:
        embed_dim: E (even).
        max_len: length of the precomputed table; longer inputs extend it on the fly.
        base: the wavelength base, 10000 in the original Transformer.
    """

    def __init__(self, embed_dim: int, *, max_len: int = 512, base: float = 10000.0) -> None:
        super().__init__()
        V.check_positive_int("max_len", max_len)
        self.embed_dim, self.base = embed_dim, float(base)
        self.register_buffer("table", sinusoidal_table(max_len, embed_dim, base=base), False)

    def forward(self, x: Tensor, positions: Tensor | None = None) -> Tensor:
        """x: (B, L, E); positions: (L,) or (B, L) integers (default 0..L-1).

        Under ``torch.compile`` or export, explicit positions are neither range-checked nor
        read to extend the table (host reads break the graph): keep them below ``max_len``.
        """
        explicit = positions
        positions = _positions(x, positions, None)
        if x.shape[-1] != self.embed_dim:
            raise ValueError(
                f"x must have last dimension {self.embed_dim}. Received: x.shape={tuple(x.shape)}"
            )
        table = self.get_buffer("table")
        if explicit is None:  # 0..L-1: the length is known without reading the tensor
            need = x.shape[1]
        elif _tracing():  # no host read in a traced graph: explicit positions use the table
            need = 0
        else:
            need = int(positions.max()) + 1 if positions.numel() else 0
        if need > table.shape[0]:
            table = sinusoidal_table(need, self.embed_dim, base=self.base).to(table.device)
        return x + table[positions].to(x.dtype)


@saveable("multihead.LearnedPositionalEncoding")
class LearnedPositionalEncoding(nn.Module):
    """``x + embedding[positions]`` with one trained vector per position (BERT, GPT-2).

    Args:
        max_len: number of positions; longer inputs raise.
        embed_dim: E.
    """

    def __init__(self, max_len: int, embed_dim: int) -> None:
        super().__init__()
        V.check_positive_int("max_len", max_len)
        V.check_positive_int("embed_dim", embed_dim)
        self.embedding = nn.Embedding(max_len, embed_dim)

    @property
    def max_len(self) -> int:
        return self.embedding.num_embeddings

    def forward(self, x: Tensor, positions: Tensor | None = None) -> Tensor:
        """x: (B, L, E); positions: (L,) or (B, L) integers below ``max_len`` (default 0..L-1)."""
        positions = _positions(x, positions, self.max_len)
        return x + self.embedding(positions)
