"""Transformer encoder blocks built on ``MultiHeadAttention``: feed-forward, layer, stack.

Post-norm (the original Transformer and BERT) is the default; ``norm_first=True`` gives pre-norm.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, cast

from torch import Tensor, nn

from .. import _validation as V
from .._saveable import saveable
from ..functional import AttentionOutput
from ..masks import Mask
from .attention import MultiHeadAttention

__all__ = [
    "ACTIVATIONS",
    "FeedForward",
    "GatedFeedForward",
    "StackOutput",
    "TransformerEncoder",
    "TransformerEncoderLayer",
]

# name -> module factory; "gelu" is the exact erf form used by BERT, "gelu_tanh" the tanh
# approximation used by GPT-2 ("gelu_new" in Hugging Face configs).
ACTIVATIONS = {
    "gelu": lambda: nn.GELU(),
    "gelu_tanh": lambda: nn.GELU(approximate="tanh"),
    "relu": lambda: nn.ReLU(),
    "silu": lambda: nn.SiLU(),  # "swish"; the gate of SwiGLU (Shazeer 2020) in Llama
}


def _activation(name: str) -> nn.Module:
    if name not in ACTIVATIONS:
        raise ValueError(
            f"activation must be one of {', '.join(map(repr, ACTIVATIONS))}. "
            f"Received: activation={name!r}"
        )
    return ACTIVATIONS[name]()


class _RunsWithWeights(Protocol):
    """A part with ``run(...) -> AttentionOutput``: the attention modules and layers here, and
    any self-attention passed in that can return its weights."""

    def run(self, *args: Any, **kwargs: Any) -> AttentionOutput: ...


def _runner(part: nn.Module) -> _RunsWithWeights:
    """``part`` as something with ``run`` (what asking for weights calls)."""
    return cast(_RunsWithWeights, part)


@saveable("multihead.FeedForward")
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


@saveable("multihead.GatedFeedForward")
class GatedFeedForward(nn.Module):
    """Gated feed-forward (GLU family, Shazeer 2020): ``down(dropout(act(gate(x)) * up(x)))``.

    With ``activation="silu"`` (the default) this is SwiGLU, the feed-forward of Llama,
    Mistral and Qwen. (..., E) -> (..., E).

    Args:
        embed_dim: E, input and output width.
        hidden_dim: width of the gate and up projections (Llama-7B: 11008 for E = 4096).
        activation: "silu" (SwiGLU), "gelu" (GeGLU), "gelu_tanh" or "relu" (ReGLU).
        dropout: dropout on the gated hidden layer while training, in [0, 1).
        bias: whether the three projections have biases (Llama: no).
    """

    def __init__(
        self,
        embed_dim: int,
        hidden_dim: int,
        *,
        activation: str = "silu",
        dropout: float = 0.0,
        bias: bool = False,
    ) -> None:
        super().__init__()
        V.check_positive_int("embed_dim", embed_dim)
        V.check_positive_int("hidden_dim", hidden_dim)
        self.gate_proj = nn.Linear(embed_dim, hidden_dim, bias=bias)
        self.up_proj = nn.Linear(embed_dim, hidden_dim, bias=bias)
        self.down_proj = nn.Linear(hidden_dim, embed_dim, bias=bias)
        self.activation = _activation(activation)
        self.dropout = nn.Dropout(V.check_dropout(dropout, "dropout"))

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.dropout(self.activation(self.gate_proj(x)) * self.up_proj(x)))


@saveable("multihead.TransformerEncoderLayer")
class TransformerEncoderLayer(nn.Module):
    """Self-attention then feed-forward, each wrapped in a residual connection and LayerNorm.

    Post-norm (``norm_first=False``, as in Vaswani et al. 2017 and BERT)::

        x = norm1(x + dropout(self_attn(x)))
        x = norm2(x + dropout(feed_forward(x)))

    Pre-norm (``norm_first=True``)::

        x = x + dropout(self_attn(norm1(x)))
        x = x + dropout(feed_forward(norm2(x)))

    The parts can be passed in instead of built (as torchtune's layers take them): any of
    ``self_attn``, ``feed_forward``, ``norm1`` and ``norm2`` given is used as is, and only the
    missing ones are built from the sizes, so ``TransformerEncoderLayer(self_attn=attn,
    feed_forward=GatedFeedForward(256, 683), norm1=RMSNorm(256), norm2=RMSNorm(256),
    norm_first=True)`` needs no sizes at all. ``self_attn`` is called as
    ``self_attn(x, mask=..., bias=...)`` by ``forward`` and as ``self_attn.run(x, mask=...,
    bias=..., heads=...)`` (returning an ``AttentionOutput``) by ``run``, like
    ``MultiHeadAttention``.

    Args:
        embed_dim: E (needed to build the attention or a norm).
        num_heads: H; divides E (needed to build the attention).
        ff_dim: hidden width of the feed-forward block (needed to build it).
        dropout: dropout on the attention weights and on both residual branches, in [0, 1);
            a given part keeps its own dropout.
        activation: "gelu" (exact), "gelu_tanh", "relu" or "silu".
        norm_first: pre-norm instead of post-norm.
        layer_norm_eps: epsilon of both LayerNorms (BERT uses 1e-12).
        num_kv_heads: H_kv for grouped-query attention (default H).
        bias: biases in every linear layer and LayerNorm.
        self_attn, feed_forward, norm1, norm2: parts to use instead of building them.
    """

    def __init__(
        self,
        embed_dim: int | None = None,
        num_heads: int | None = None,
        ff_dim: int | None = None,
        *,
        dropout: float = 0.0,
        activation: str = "gelu",
        norm_first: bool = False,
        layer_norm_eps: float = 1e-5,
        num_kv_heads: int | None = None,
        bias: bool = True,
        self_attn: nn.Module | None = None,
        feed_forward: nn.Module | None = None,
        norm1: nn.Module | None = None,
        norm2: nn.Module | None = None,
    ) -> None:
        super().__init__()
        dropout = V.check_dropout(dropout, "dropout")
        given = {"self_attn": self_attn, "feed_forward": feed_forward, "norm1": norm1,
                 "norm2": norm2}  # fmt: skip
        for name, part in given.items():
            if part is not None and not isinstance(part, nn.Module):
                raise TypeError(
                    f"{name} must be a torch.nn.Module. Received: {name} of type "
                    f"{type(part).__name__}"
                )
        sizes = {"embed_dim": embed_dim, "num_heads": num_heads, "ff_dim": ff_dim}
        needs = {"self_attn": ("embed_dim", "num_heads"), "feed_forward": ("embed_dim", "ff_dim"),
                 "norm1": ("embed_dim",), "norm2": ("embed_dim",)}  # fmt: skip
        for name, part in given.items():
            lacking = [s for s in needs[name] if part is None and sizes[s] is None]
            if lacking:
                raise ValueError(
                    f"pass {' and '.join(lacking)} to build {name}, or pass {name}= itself. "
                    f"Received: {', '.join(f'{s}=None' for s in lacking)}"
                )
        # the sizes a missing part needs were checked above
        if self_attn is None:
            self_attn = MultiHeadAttention(
                cast(int, embed_dim), cast(int, num_heads), num_kv_heads=num_kv_heads,
                bias=bias, dropout=dropout,
            )  # fmt: skip
        if feed_forward is None:
            feed_forward = FeedForward(
                cast(int, embed_dim), cast(int, ff_dim), activation=activation, dropout=dropout,
                bias=bias,
            )  # fmt: skip
        self.self_attn = self_attn
        self.feed_forward = feed_forward
        if norm1 is None:
            norm1 = nn.LayerNorm(embed_dim, eps=layer_norm_eps, bias=bias)
        if norm2 is None:
            norm2 = nn.LayerNorm(embed_dim, eps=layer_norm_eps, bias=bias)
        self.norm1, self.norm2 = norm1, norm2
        self.dropout = nn.Dropout(dropout)
        self.norm_first = bool(norm_first)

    def extra_repr(self) -> str:
        return f"norm_first={self.norm_first}"

    @V.torch_keywords("TransformerEncoderLayer.forward()")
    def forward(
        self,
        x: Tensor,
        *,
        mask: Mask | Tensor | None = None,
        bias: Tensor | None = None,
    ) -> Tensor:
        """Args: x (B, L, E); mask and bias as in ``multihead.attention``.

        Returns:
            (B, L, E), always a tensor; ``run`` also returns the attention weights.
        """
        return self._finish(x, self.self_attn(self._attn_input(x), mask=mask, bias=bias))

    def run(
        self,
        x: Tensor,
        *,
        mask: Mask | Tensor | None = None,
        bias: Tensor | None = None,
        heads: list[int] | None = None,
    ) -> AttentionOutput:
        """``forward`` that also returns the self-attention weights (through
        ``self_attn.run``): ``AttentionOutput(output (B, L, E), weights (B, H, L, L))``, or
        (B, len(heads), L, L) with ``heads``; the output is the one ``forward`` computes."""
        out = _runner(self.self_attn).run(self._attn_input(x), mask=mask, bias=bias, heads=heads)
        return AttentionOutput(self._finish(x, out.output), out.weights)

    def _attn_input(self, x: Tensor) -> Tensor:
        return self.norm1(x) if self.norm_first else x

    def _finish(self, x: Tensor, attended: Tensor) -> Tensor:
        """The residual connections and norms around the attention output, and the
        feed-forward block."""
        if self.norm_first:
            x = x + self.dropout(attended)
            return x + self.dropout(self.feed_forward(self.norm2(x)))
        x = self.norm1(x + self.dropout(attended))
        return self.norm2(x + self.dropout(self.feed_forward(x)))


def check_layers(layers: Any, kind: type) -> nn.ModuleList:
    """A stack's layers: a non-empty list of distinct ``kind`` modules."""
    layers = list(layers)
    if not layers or not all(isinstance(m, kind) for m in layers):
        raise ValueError(
            f"layers must be a non-empty list of {kind.__name__}. "
            f"Received: {[type(m).__name__ for m in layers]}"
        )
    if len({id(m) for m in layers}) != len(layers):
        raise ValueError(
            "layers must be distinct modules (the same layer twice would share parameters). "
            f"Received: {len(layers)} layers, {len({id(m) for m in layers})} distinct"
        )
    return nn.ModuleList(layers)


class StackOutput(NamedTuple):
    """What ``run`` of ``TransformerEncoder`` and ``TransformerDecoder`` returns, whatever
    was asked for.

    output: (B, L, E) after the last layer (and the final norm, if any): what ``forward``
        returns.
    hidden_states: the input and every layer's output, num_layers + 1 tensors (B, L, E), the
        last one after the final norm, when ``return_hidden=True``; else None.
    weights: every layer's per-head weights, one (B, H, L, S) tensor per layer (or
        (B, len(heads), L, S) with ``heads``), unless ``weights=False``; then None.
    """

    output: Tensor
    hidden_states: tuple[Tensor, ...] | None
    weights: tuple[Tensor, ...] | None


def run_stack(
    layers: nn.ModuleList,
    norm: nn.Module | None,
    x: Tensor,
    options: Callable[[int], dict[str, Any]],
    *,
    weights: bool,
    heads: list[int] | None,
    return_hidden: bool,
) -> StackOutput:
    """Run ``layers`` in order (layer i with the keywords ``options(i)``), then ``norm``;
    collect what ``run`` of a stack was asked for. Layers run through their ``run`` only when
    weights are wanted, so ``weights=False`` stays on the fast path."""
    V.check_bool("weights", weights)
    V.check_bool("return_hidden", return_hidden)
    if heads is not None and not weights:
        raise ValueError(
            "heads= chooses which heads' weights to return, and weights=False asks for none; "
            f"drop one of them. Received: heads={heads!r}, weights=False"
        )
    hidden, per_layer = [x], []
    for i, layer in enumerate(layers):
        if weights:
            x, w = _runner(layer).run(x, heads=heads, **options(i))
            per_layer.append(w)
        else:
            x = layer(x, **options(i))
        hidden.append(x)
    if norm is not None:
        x = norm(x)
        hidden[-1] = x
    return StackOutput(
        x, tuple(hidden) if return_hidden else None, tuple(per_layer) if weights else None
    )


@saveable("multihead.TransformerEncoder")
class TransformerEncoder(nn.Module):
    """A stack of encoder layers sharing one mask, with an optional final norm (for pre-norm).

    ``forward`` returns the output tensor; ``run`` returns a ``StackOutput`` with the
    per-layer weights and, on request, the hidden states.

    Args:
        layers: the layers, run in order (e.g. ``[TransformerEncoderLayer(...) for _ in
            range(6)]``); each gets its own parameters.
        norm: applied to the last layer's output (pre-norm stacks need one), or None.
    """

    def __init__(self, layers: list[nn.Module], *, norm: nn.Module | None = None) -> None:
        super().__init__()
        self.layers = check_layers(layers, TransformerEncoderLayer)
        self.norm = norm

    @V.torch_keywords("TransformerEncoder.forward()")
    def forward(
        self,
        x: Tensor,
        *,
        mask: Mask | Tensor | None = None,
        bias: Tensor | None = None,
    ) -> Tensor:
        """Args: x (B, L, E); mask and bias as in ``multihead.attention``, used by every layer.

        Returns:
            (B, L, E), always a tensor; ``run`` gives weights and hidden states.
        """
        for layer in self.layers:
            x = layer(x, mask=mask, bias=bias)
        return x if self.norm is None else self.norm(x)

    def run(
        self,
        x: Tensor,
        *,
        mask: Mask | Tensor | None = None,
        bias: Tensor | None = None,
        weights: bool = True,
        heads: list[int] | None = None,
        return_hidden: bool = False,
    ) -> StackOutput:
        """``forward`` with more, always as a ``StackOutput(output, hidden_states, weights)``.

        Args:
            x, mask, bias: as in ``forward``.
            weights: return every layer's per-head weights (default); False leaves
                ``weights`` None and runs the layers on the fast path.
            heads: only these heads' weights, in every layer (see
                ``multihead.attention_with_weights``).
            return_hidden: also return the input and every layer's output.
        """
        return run_stack(
            self.layers,
            self.norm,
            x,
            lambda i: {"mask": mask, "bias": bias},
            weights=weights,
            heads=heads,
            return_hidden=return_hidden,
        )
