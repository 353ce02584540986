"""Decoder-only blocks (GPT-2, Llama) that take their parts as arguments, as torchtune's do.

A layer is ``x + attn(norm1(x))`` then ``x + feed_forward(norm2(x))`` (pre-norm); which
attention (rotary or not, GQA), feed-forward (GELU MLP or SwiGLU) and norm (LayerNorm or
RMSNorm) is up to the caller. The stack threads a ``KVCache`` through its layers.
"""

from __future__ import annotations

from torch import Tensor, nn

from .. import _validation as V
from .. import masks
from .._saveable import saveable
from ..functional import AttentionOutput
from ..masks import Mask
from . import decoding_native as native_step
from . import decoding_python as python_step
from .cache import KVCache, LayerCache
from .transformer import StackOutput, _runner, check_layers, run_stack

__all__ = ["TransformerDecoder", "TransformerDecoderLayer"]


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
        self_attn: called as ``self_attn(x, mask=...)`` by ``forward`` and as
            ``self_attn.run(x, mask=..., heads=...)`` (an ``AttentionOutput``) by ``run``,
            plus ``positions=`` and ``cache=`` when those are given (``MultiHeadAttention``
            takes all of them).
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

    @V.torch_keywords("TransformerDecoderLayer.forward()")
    def forward(
        self,
        x: Tensor,
        *,
        mask: Mask | Tensor | None = None,
        positions: Tensor | None = None,
        cache: LayerCache | None = None,
    ) -> Tensor:
        """Args:
            x: (B, L, E).
            mask: the attention mask; default ``masks.causal()`` (no token sees a later one).
                With a cache the cache supplies it.
            positions: (B, L) positions for a rotary attention.
            cache: this layer's view of a ``KVCache`` (``cache[i]``).

        Returns:
            (B, L, E), always a tensor; ``run`` also returns the attention weights.
        """
        attended = self.self_attn(self.norm1(x), **self._options(mask, positions, cache))
        return self._finish(x, attended)

    def run(
        self,
        x: Tensor,
        *,
        mask: Mask | Tensor | None = None,
        positions: Tensor | None = None,
        cache: LayerCache | None = None,
        heads: list[int] | None = None,
    ) -> AttentionOutput:
        """``forward`` that also returns the self-attention weights (through
        ``self_attn.run``): ``AttentionOutput(output (B, L, E), weights (B, H, L, S))``, or
        (B, len(heads), L, S) with ``heads``. The layer has no cross-attention, so the
        weights are always its self-attention's (S = L, or the cache slots with a cache)."""
        options = self._options(mask, positions, cache)
        out = _runner(self.self_attn).run(self.norm1(x), heads=heads, **options)
        return AttentionOutput(self._finish(x, out.output), out.weights)

    @staticmethod
    def _options(
        mask: Mask | Tensor | None, positions: Tensor | None, cache: LayerCache | None
    ) -> dict[str, object]:
        """The keywords for ``self_attn``: positions and cache only when given (a plain
        attention need not take them); without a cache the mask, causal by default."""
        options: dict[str, object] = {"mask": mask}
        if positions is not None:
            options["positions"] = positions
        if cache is not None:
            options["cache"] = cache
        elif mask is None:
            options["mask"] = masks.causal()
        return options

    def _finish(self, x: Tensor, attended: Tensor) -> Tensor:
        x = x + self.dropout(attended)
        return x + self.dropout(self.feed_forward(self.norm2(x)))


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

    @V.torch_keywords("TransformerDecoder.forward()")
    def forward(
        self,
        x: Tensor,
        *,
        mask: Mask | Tensor | None = None,
        positions: Tensor | None = None,
        cache: KVCache | None = None,
    ) -> Tensor:
        """Args:
            x: (B, L, E).
            mask: used by every layer; default causal. Must be None with a cache.
            positions: (B, L) positions for rotary attention; default the cache step's.
            cache: a ``KVCache`` with one entry per layer, after ``cache.begin(counts)``.

        Returns:
            (B, L, E), always a tensor; ``run`` gives weights and hidden states.
        """
        self._check_cache(cache)
        if mask is None and positions is None and cache is not None:
            # a decoding step: in one C++ call (within float32 rounding), else the same
            # operations as the layers' without the module calls around them
            kind = TransformerDecoderLayer
            if native_step.applies(self.layers, kind, x, cache):
                return self.norm(native_step.step(self.layers, kind, x, cache))
            if python_step.applies(self.layers, kind, x, cache):
                return self.norm(python_step.step(self.layers, x, cache))
        for i, layer in enumerate(self.layers):
            x = layer(x, mask=mask, positions=positions, cache=None if cache is None else cache[i])
        return self.norm(x)

    def run(
        self,
        x: Tensor,
        *,
        mask: Mask | Tensor | None = None,
        positions: Tensor | None = None,
        cache: KVCache | None = None,
        weights: bool = True,
        heads: list[int] | None = None,
        return_hidden: bool = False,
    ) -> StackOutput:
        """``forward`` with more, always as a ``StackOutput(output, hidden_states, weights)``.

        Args:
            x, mask, positions, cache: as in ``forward``.
            weights, heads, return_hidden: as in ``TransformerEncoder.run``.
        """
        self._check_cache(cache)
        return run_stack(
            self.layers,
            self.norm,
            x,
            lambda i: {
                "mask": mask,
                "positions": positions,
                "cache": None if cache is None else cache[i],
            },
            weights=weights,
            heads=heads,
            return_hidden=return_hidden,
        )

    def _check_cache(self, cache: KVCache | None) -> None:
        if cache is not None and cache.num_layers != len(self.layers):
            raise ValueError(
                f"the cache must have one entry per layer ({len(self.layers)}). "
                f"Received: a cache with num_layers={cache.num_layers}"
            )
