"""Transformer encoder blocks built on ``MultiHeadAttention``: feed-forward, layer, stack.

Post-norm (the original Transformer and BERT) is the default; ``norm_first=True`` gives pre-norm.
"""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor, nn

from .. import _validation as V
from ..masks import Mask
from .attention import MultiHeadAttention

__all__ = [
    "ACTIVATIONS",
    "EncoderOutput",
    "FeedForward",
    "TransformerEncoder",
    "TransformerEncoderLayer",
]

# name -> module factory; "gelu" is the exact erf form used by BERT, "gelu_tanh" the tanh
# approximation used by GPT-2 ("gelu_new" in Hugging Face configs).
ACTIVATIONS = {
    "gelu": lambda: nn.GELU(),
    "gelu_tanh": lambda: nn.GELU(approximate="tanh"),
    "relu": lambda: nn.ReLU(),
}


def _activation(name: str) -> nn.Module:
    if name not in ACTIVATIONS:
        raise ValueError(
            f"activation must be one of {', '.join(map(repr, ACTIVATIONS))}. "
            f"Received: activation={name!r}"
        )
    return ACTIVATIONS[name]()


class FeedForward(nn.Module):
    """Position-wise feed-forward: ``linear2(dropout(act(linear1(x))))``, (..., E) -> (..., E).

    Args:
        embed_dim: E, input and output width.
        hidden_dim: width of the hidden layer (4 * E in the original Transformer).
        activation: "gelu" (exact), "gelu_tanh" or "relu".
        dropout: dropout after the activation while training, in [0, 1).
        bias: whether both linear layers have biases.
    """

    def __init__(
        self,
        embed_dim: int,
        hidden_dim: int,
        *,
        activation: str = "gelu",
        dropout: float = 0.0,
        bias: bool = True,
    ) -> None:
        super().__init__()
        V.check_positive_int("embed_dim", embed_dim)
        V.check_positive_int("hidden_dim", hidden_dim)
        self.linear1 = nn.Linear(embed_dim, hidden_dim, bias=bias)
        self.activation = _activation(activation)
        self.dropout = nn.Dropout(V.check_dropout(dropout, "dropout"))
        self.linear2 = nn.Linear(hidden_dim, embed_dim, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear2(self.dropout(self.activation(self.linear1(x))))


class TransformerEncoderLayer(nn.Module):
    """Self-attention then feed-forward, each wrapped in a residual connection and LayerNorm.

    Post-norm (``norm_first=False``, as in Vaswani et al. 2017 and BERT)::

        x = norm1(x + dropout(self_attn(x)))
        x = norm2(x + dropout(feed_forward(x)))

    Pre-norm (``norm_first=True``)::

        x = x + dropout(self_attn(norm1(x)))
        x = x + dropout(feed_forward(norm2(x)))

    Args:
        embed_dim: E.
        num_heads: H; divides E.
        ff_dim: hidden width of the feed-forward block.
        dropout: dropout on the attention weights and on both residual branches, in [0, 1).
        activation: "gelu" (exact), "gelu_tanh" or "relu".
        norm_first: pre-norm instead of post-norm.
        layer_norm_eps: epsilon of both LayerNorms (BERT uses 1e-12).
        num_kv_heads: H_kv for grouped-query attention (default H).
        bias: biases in every linear layer and LayerNorm.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        ff_dim: int,
        *,
        dropout: float = 0.0,
        activation: str = "gelu",
        norm_first: bool = False,
        layer_norm_eps: float = 1e-5,
        num_kv_heads: int | None = None,
        bias: bool = True,
    ) -> None:
        super().__init__()
        dropout = V.check_dropout(dropout, "dropout")
        self.self_attn = MultiHeadAttention(
            embed_dim, num_heads, num_kv_heads=num_kv_heads, bias=bias, dropout=dropout
        )
        self.feed_forward = FeedForward(
            embed_dim, ff_dim, activation=activation, dropout=dropout, bias=bias
        )
        self.norm1 = nn.LayerNorm(embed_dim, eps=layer_norm_eps, bias=bias)
        self.norm2 = nn.LayerNorm(embed_dim, eps=layer_norm_eps, bias=bias)
        self.dropout = nn.Dropout(dropout)
        self.norm_first = bool(norm_first)

    def extra_repr(self) -> str:
        return f"norm_first={self.norm_first}"

    def forward(
        self,
        x: Tensor,
        *,
        mask: Mask | Tensor | None = None,
        bias: Tensor | None = None,
        return_weights: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Args: x (B, L, E); mask and bias as in ``multihead.attention``.

        Returns:
            (B, L, E), or ``(output, weights)`` with per-head weights (B, H, L, L) when
            ``return_weights=True``; the output is computed on the same fast path either way.
        """
        h = self.norm1(x) if self.norm_first else x
        attended = self.self_attn(h, mask=mask, bias=bias, return_weights=return_weights)
        attended, weights = attended if return_weights else (attended, None)
        if self.norm_first:
            x = x + self.dropout(attended)
            x = x + self.dropout(self.feed_forward(self.norm2(x)))
        else:
            x = self.norm1(x + self.dropout(attended))
            x = self.norm2(x + self.dropout(self.feed_forward(x)))
        return (x, weights) if return_weights else x


class EncoderOutput(NamedTuple):
    """What ``TransformerEncoder`` returns when asked for more than the output.

    output: (B, L, E) after the last layer (and the final norm, if any).
    hidden_states: the input and every layer's output, num_layers + 1 tensors (B, L, E), when
        ``return_hidden=True``; else None.
    weights: every layer's per-head weights (B, H, L, L) when ``return_weights=True``; else None.
    """

    output: Tensor
    hidden_states: tuple[Tensor, ...] | None
    weights: tuple[Tensor, ...] | None


class TransformerEncoder(nn.Module):
    """A stack of encoder layers sharing one mask, with an optional final norm (for pre-norm).

    Args:
        layers: the layers, run in order (e.g. ``[TransformerEncoderLayer(...) for _ in
            range(6)]``); each gets its own parameters.
        norm: applied to the last layer's output (pre-norm stacks need one), or None.
    """

    def __init__(self, layers: list[nn.Module], *, norm: nn.Module | None = None) -> None:
        super().__init__()
        layers = list(layers)
        if not layers or not all(isinstance(m, TransformerEncoderLayer) for m in layers):
            raise ValueError(
                "layers must be a non-empty list of TransformerEncoderLayer. "
                f"Received: {[type(m).__name__ for m in layers]}"
            )
        if len({id(m) for m in layers}) != len(layers):
            raise ValueError(
                "layers must be distinct modules (the same layer twice would share parameters). "
                f"Received: {len(layers)} layers, {len({id(m) for m in layers})} distinct"
            )
        self.layers = nn.ModuleList(layers)
        self.norm = norm

    def forward(
        self,
        x: Tensor,
        *,
        mask: Mask | Tensor | None = None,
        bias: Tensor | None = None,
        return_weights: bool = False,
        return_hidden: bool = False,
    ) -> Tensor | EncoderOutput:
        """Args: x (B, L, E); mask and bias as in ``multihead.attention``, used by every layer.

        Returns:
            (B, L, E), or an ``EncoderOutput`` when ``return_weights`` or ``return_hidden``.
        """
        hidden = [x]
        weights = []
        for layer in self.layers:
            x = layer(x, mask=mask, bias=bias, return_weights=return_weights)
            if return_weights:
                x, w = x
                weights.append(w)
            hidden.append(x)
        if self.norm is not None:
            x = self.norm(x)
            hidden[-1] = x
        if not (return_weights or return_hidden):
            return x
        return EncoderOutput(
            x,
            tuple(hidden) if return_hidden else None,
            tuple(weights) if return_weights else None,
        )
