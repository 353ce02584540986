"""Decoder-only blocks (GPT-2, Llama) that take their parts as arguments, as torchtune's do.

A layer is ``x + attn(norm1(x))`` then ``x + feed_forward(norm2(x))`` (pre-norm); which
attention (rotary or not, GQA), feed-forward (GELU MLP or SwiGLU) and norm (LayerNorm or
RMSNorm) is up to the caller. The stack threads a ``KVCache`` through its layers.
"""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor, nn

from .. import _validation as V
from .. import masks
from .._saveable import saveable
from ..masks import Mask
from .cache import KVCache, LayerCache
from .transformer import check_layers

__all__ = ["DecoderOutput", "TransformerDecoder", "TransformerDecoderLayer"]


def _check_part(name: str, part: object) -> nn.Module:
    if not isinstance(part, nn.Module):
        raise TypeError(
            f"{name} must be a torch.nn.Module. Received: {name} of type {type(part).__name__}"
        )
    return part


@saveable("multihead.TransformerDecoderLayer")
class TransformerDecoderLayer(nn.Module):
    """One pre-norm decoder block built from the parts it is given::

        x = x + dropout(self_attn(norm1(x), mask=mask, positions=positions, cache=cache))
        x = x + dropout(feed_forward(norm2(x)))

    GPT-2: ``MultiHeadAttention(E, H)``, ``FeedForward(E, 4E, activation="gelu_tanh")`` and two
    ``nn.LayerNorm(E)``. Llama: ``MultiHeadAttention(E, H, num_kv_heads=H_kv, bias=False,
    rotary=RotaryEmbedding(D))``, ``GatedFeedForward(E, hidden)`` and two ``RMSNorm(E)``.

    Args:
        self_attn: called as ``self_attn(x, mask=..., return_weights=...)``, plus
            ``positions=`` and ``cache=`` when those are given (``MultiHeadAttention`` takes
            all of them).
        feed_forward: (B, L, E) -> (B, L, E).
        norm1: before the attention (default none: ``nn.Identity``).
        norm2: before the feed-forward (default none).
        dropout: on both residual branches while training, in [0, 1).
    """

    def __init__(
        self,
        self_attn: nn.Module,
        feed_forward: nn.Module,
        *,
        norm1: nn.Module | None = None,
        norm2: nn.Module | None = None,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.self_attn = _check_part("self_attn", self_attn)
        self.feed_forward = _check_part("feed_forward", feed_forward)
        self.norm1 = nn.Identity() if norm1 is None else _check_part("norm1", norm1)
        self.norm2 = nn.Identity() if norm2 is None else _check_part("norm2", norm2)
        self.dropout = nn.Dropout(V.check_dropout(dropout, "dropout"))

    def forward(
        self,
        x: Tensor,
        *,
        mask: Mask | Tensor | None = None,
        positions: Tensor | None = None,
        cache: LayerCache | None = None,
        return_weights: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Args:
            x: (B, L, E).
            mask: the attention mask; default ``masks.causal()`` (no token sees a later one).
                With a cache the cache supplies it.
            positions: (B, L) positions for a rotary attention.
            cache: this layer's view of a ``KVCache`` (``cache[i]``).
            return_weights: also return the per-head weights (B, H, L, S).

        Returns:
            (B, L, E), or ``(output, weights)`` when ``return_weights=True``.
        """
        extra = {}
        if positions is not None:
            extra["positions"] = positions
        if cache is not None:
            extra["cache"] = cache
        elif mask is None:
            mask = masks.causal()
        attended = self.self_attn(self.norm1(x), mask=mask, return_weights=return_weights, **extra)
        attended, weights = attended if return_weights else (attended, None)
        x = x + self.dropout(attended)
        x = x + self.dropout(self.feed_forward(self.norm2(x)))
        return (x, weights) if return_weights else x


class DecoderOutput(NamedTuple):
    """What ``TransformerDecoder`` returns when asked for more than the output.

    output: (B, L, E) after the last layer and the final norm.
    hidden_states: the input and every layer's output (num_layers + 1 tensors) when asked.
    weights: every layer's per-head weights (B, H, L, S) when asked.
    """

    output: Tensor
    hidden_states: tuple[Tensor, ...] | None
    weights: tuple[Tensor, ...] | None


@saveable("multihead.TransformerDecoder")
class TransformerDecoder(nn.Module):
    """A stack of decoder layers with a final norm; threads one ``KVCache`` through them.

    Args:
        layers: distinct ``TransformerDecoderLayer`` modules, run in order.
        norm: applied to the last layer's output (pre-norm stacks need one), or None.
    """

    def __init__(self, layers: list[nn.Module], *, norm: nn.Module | None = None) -> None:
        super().__init__()
        self.layers = check_layers(layers, TransformerDecoderLayer)
        self.norm = nn.Identity() if norm is None else _check_part("norm", norm)

    def forward(
        self,
        x: Tensor,
        *,
        mask: Mask | Tensor | None = None,
        positions: Tensor | None = None,
        cache: KVCache | None = None,
        return_weights: bool = False,
        return_hidden: bool = False,
    ) -> Tensor | DecoderOutput:
        """Args:
            x: (B, L, E).
            mask: used by every layer; default causal. Must be None with a cache.
            positions: (B, L) positions for rotary attention; default the cache step's.
            cache: a ``KVCache`` with one entry per layer, after ``cache.begin(counts)``.
            return_weights, return_hidden: as in ``TransformerEncoder``.

        Returns:
            (B, L, E), or a ``DecoderOutput`` when ``return_weights`` or ``return_hidden``.
        """
        if cache is not None and cache.num_layers != len(self.layers):
            raise ValueError(
                f"the cache must have one entry per layer ({len(self.layers)}). "
                f"Received: a cache with num_layers={cache.num_layers}"
            )
        hidden, weights = [x], []
        for i, layer in enumerate(self.layers):
            x = layer(
                x,
                mask=mask,
                positions=positions,
                cache=None if cache is None else cache[i],
                return_weights=return_weights,
            )
            if return_weights:
                x, w = x
                weights.append(w)
            if return_hidden:
                hidden.append(x)
        x = self.norm(x)
        if not (return_weights or return_hidden):
            return x
        if return_hidden:
            hidden[-1] = x
        return DecoderOutput(
            x,
            tuple(hidden) if return_hidden else None,
            tuple(weights) if return_weights else None,
        )
