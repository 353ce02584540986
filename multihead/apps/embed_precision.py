"""``--precision auto|fp32|bf16`` of ``multihead embed`` and ``multihead serve``: sentence
embeddings with the model's linear layers in bf16 where that is faster on this machine.

bf16 here means: each ``nn.Linear`` keeps its weight and bias in bf16 and multiplies in bf16
(``Bf16Linear``: the input cast to bf16, the product cast back to fp32), so the linear layers
run at the bf16 matmul rate; everything between them stays fp32: the residual stream, layer
norms and the pooling. Two exceptions cost almost nothing in accuracy:

* inside a ``FeedForward`` the first layer applies the activation to its fp32 product and
  hands bf16 to the second layer, which would round the activation's output to bf16 anyway:
  the activation reads the unrounded product (one rounding instead of two), and the widest
  tensor is neither cast nor passed over again;
* a ``MultiHeadAttention``'s query, key and value products stay bf16 into attention (the
  fused kernel keeps scores, softmax statistics and sums in fp32 and rounds the weights to
  bf16 for their product with the values), whose output goes to the output projection, which
  rounds its input to bf16 anyway. The products' values are bf16 already: their casts to fp32
  and back are saved, and attention reads half the bytes.

On all-MiniLM-L6-v2 the embeddings keep a cosine of at least 0.9999 to fp32 (the tests
hold them to 0.999 mean, 0.995 minimum).

``auto`` decides as ``multihead train --precision auto`` does (``precision.choose``): fp32
where bf16 matmuls measure no faster than fp32, else the model's own embedding pass on one
packed row (the input's first texts, or a generated text) timed with bf16 and fp32 linear
layers, bf16 kept only where it is at least ``precision.STEP_PAYS`` times faster. Measured,
never read from CPU flags: an Intel Xeon with AVX512-BF16 and no AMX runs bf16 matmuls at
about 0.6x fp32, a Zen 4 EPYC at 2x or more.
"""

from __future__ import annotations

import copy
import functools
import itertools
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import _validation as V
from ..modules import FeedForward, MultiHeadAttention
from ..modules.transformer import ACTIVATIONS
from .precision import PrecisionChoice, choose

if TYPE_CHECKING:
    from ..models.bert import Pretrained

__all__ = [
    "FUSED",
    "PRECISIONS",
    "Bf16Linear",
    "at_precision",
    "bf16_linears",
    "linear_precision",
]

PRECISIONS = ("auto", "fp32", "bf16")  # what --precision of embed and serve takes
_PROJECTIONS = ("q_proj", "k_proj", "v_proj")  # a MultiHeadAttention's, handing bf16 on
# oneDNN's post-op (attr, algorithm) for each activation of modules.transformer.ACTIVATIONS
# a Bf16Linear applies inside its product
_ONEDNN: dict[str | None, tuple[str, str]] = {
    None: ("none", ""),
    "gelu": ("gelu", "none"),
    "gelu_tanh": ("gelu", "tanh"),
    "relu": ("relu", ""),
}
FUSED = tuple(name for name in _ONEDNN if name is not None)
# the timed pass's stand-in for input when none is given: about 60 tokens of ordinary words
_FILLER = (
    "The committee met on a quiet Tuesday morning to review the plans for the new library, "
    "and after a long discussion of costs, schedules and the needs of the neighbourhood, it "
    "agreed to open the building in the spring."
)


class Bf16Linear(nn.Module):
    """An inference-only linear layer that multiplies in bf16 between fp32 neighbours.

    ``y = out_dtype(act(bf16(x) @ weight.T + bias))`` with ``weight`` (out, in) and ``bias``
    (out,) stored in bf16: the product runs at the bf16 matmul rate (the BLAS accumulates in
    fp32 and rounds once). It takes float32 (or bf16) and returns ``out_dtype``, float32 by
    default, so the layers around it (norms, residual sums) are unchanged. Unlike
    ``modules.quant.PackedLinear`` ("bf16" weights, float32 activations), the activations are
    rounded too: that is what makes the product itself faster.

    Where oneDNN runs bf16 natively (``mkldnn._is_mkldnn_bf16_supported``), the product is
    oneDNN's linear on a weight reordered once into its blocked layout, with the bias and the
    activation applied to the fp32 accumulator inside the product: no pass that copies the
    bias into the output first (what ``addmm`` does) and no pass over the product for the
    activation. Elsewhere it is ``F.linear`` followed by the activation.

    Attributes:
        weight: (out, in) bfloat16, no gradient.
        bias: (out,) bfloat16 or None.
        out_dtype: float32, or bfloat16 where what follows takes bf16 anyway (a feed-forward's
            activation, attention after the query, key and value projections).
        activation: None, or one of ``FUSED`` ("gelu", "gelu_tanh", "relu") applied to the
            product before it is rounded (a feed-forward's first layer).
    """

    def __init__(
        self,
        linear: nn.Linear,
        *,
        out_dtype: torch.dtype = torch.float32,
        activation: str | None = None,
    ) -> None:
        super().__init__()
        if activation is not None and activation not in FUSED:
            raise ValueError(
                f"activation must be None or one of {', '.join(map(repr, FUSED))}. "
                f"Received: activation={activation!r}"
            )
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.out_dtype, self.activation = out_dtype, activation
        # the activation as a module of its own, for the plain path
        self.outside = nn.Identity() if activation is None else ACTIVATIONS[activation]()
        weight = linear.weight.detach().to(torch.bfloat16).contiguous()
        self.weight = nn.Parameter(weight, requires_grad=False)
        bias = linear.bias
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(torch.bfloat16), False)
        # (the weight, its state when reordered, oneDNN's copy of it)
        self._reordered: tuple[Tensor, tuple, Tensor] | None = None

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state["_reordered"] = None  # oneDNN's opaque tensor: made again on the next call
        return state

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of the activations it is given: float32 (what attention checks its
        inputs against)."""
        return torch.float32

    def forward(self, x: Tensor) -> Tensor:  # (..., in) -> (..., out)
        x = x.to(torch.bfloat16)
        reordered = self._onednn_weight(x)
        if reordered is not None:
            attr, algorithm = _ONEDNN[self.activation]
            y = torch.ops.mkldnn._linear_pointwise(x, reordered, self.bias, attr, [], algorithm)
        else:
            y = self.outside(F.linear(x, self.weight, self.bias))
        return y.to(self.out_dtype)

    def _onednn_weight(self, x: Tensor) -> Tensor | None:
        """The weight in oneDNN's layout, made on first use and again whenever ``weight``
        changed (replaced, its storage swapped, written in place); None where oneDNN does not
        run this call (a GPU, no native bf16, autograd, a graph being traced, compiled or
        exported, which could not hold its opaque weight)."""
        if V.tracing() or torch.jit.is_tracing():  # first: nothing below enters the graph
            return None
        if x.device.type != "cpu" or not _onednn_bf16() or torch.is_grad_enabled():
            return None
        w = self.weight
        # the storage, dtype and in-place write count (an inference tensor has none: it
        # cannot be written outside inference mode)
        state = (w.data_ptr(), w.dtype, None if w.is_inference() else w._version)
        old = self._reordered
        if old is None or old[0] is not w or old[1] != state:
            packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), None)
            self._reordered = (w, state, packed)
        return self._reordered[2]

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, compute=bf16, out_dtype={self.out_dtype}"
            + (f", activation={self.activation}" if self.activation else "")
        )


@functools.cache
def _onednn_bf16() -> bool:
    """Whether oneDNN runs bf16 products natively here (its linear is then the fast path)."""
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


def bf16_linears(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose ``nn.Linear`` layers are ``Bf16Linear`` (a ``FeedForward``'s
    first one applying its activation inside the product and handing bf16 on, and an
    attention's query, key and value projections bf16 to attention: see the module
    docstring).

    Every other parameter and buffer is the same tensor as in ``model``, not a copy, so the
    copy costs only its bf16 linear weights; ``model`` itself is left as it was.
    """
    tensors = itertools.chain(model.parameters(), model.buffers())
    shared: dict[int, object] = {id(t): t for t in tensors}
    twin = copy.deepcopy(model, shared)
    for parent in list(twin.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            inner = isinstance(parent, FeedForward) and name == "linear1"
            projection = isinstance(parent, MultiHeadAttention) and name in _PROJECTIONS
            out = torch.bfloat16 if inner or projection else torch.float32
            activation = _activation_name(parent.activation) if inner else None
            setattr(parent, name, Bf16Linear(child, out_dtype=out, activation=activation))
            if activation is not None:  # applied inside linear1's product now
                parent.activation = nn.Identity()
    return twin.eval()


def _activation_name(module: nn.Module) -> str | None:
    """The ``FUSED`` name of a feed-forward's activation module, or None (left outside)."""
    if type(module) is nn.ReLU:
        return "relu"
    if type(module) is nn.GELU:
        return "gelu" if module.approximate == "none" else "gelu_tanh"
    return None


def linear_precision(model: nn.Module) -> str:
    """What ``model``'s linear layers run in: "bf16" where they are ``Bf16Linear``, else
    "fp32"."""
    return "bf16" if any(isinstance(m, Bf16Linear) for m in model.modules()) else "fp32"


def _sample(pretrained: Pretrained, texts: Sequence[str], max_tokens: int) -> list[list[int]]:
    """Token ids of one packed row to time (at most ``max_tokens`` tokens, at least one
    text): the first of ``texts``, or without any a generated text, repeated."""
    encoded = [
        list(e.ids)
        for e in pretrained._encode(list(texts[:max_tokens]) or [_FILLER], pretrained.embed_length)
    ]
    if not texts:
        encoded *= max(1, max_tokens // len(encoded[0]))
    row: list[list[int]] = []
    used = 0
    for ids in encoded:
        if row and used + len(ids) > max_tokens:
            break
        row.append(ids)
        used += len(ids)
    return row


def _pass_timer(
    pretrained: Pretrained, bf16: Pretrained, sample: list[list[int]], max_tokens: int
) -> Callable[[str], float]:
    """A function timing one embedding pass of ``sample`` with fp32 or bf16 linear layers."""
    embedders = {"fp32": pretrained, "bf16": bf16}

    def once(precision: str) -> float:
        start = time.perf_counter()
        embedders[precision].embed_ids(sample, max_tokens=max_tokens)
        return time.perf_counter() - start

    return once


def at_precision(
    pretrained: Pretrained,
    requested: str,
    *,
    texts: Sequence[str] = (),
    max_tokens: int = 1536,
    say: Callable[[str], None] | None = None,
) -> tuple[Pretrained, PrecisionChoice]:
    """``pretrained`` for ``--precision requested``, and the choice with its reason.

    ``fp32`` returns ``pretrained`` itself. ``bf16`` returns a ``Pretrained`` sharing its
    tokenizer and every tensor but the linear weights (``bf16_linears``); where bf16 matmuls
    measure slower than fp32, ``say`` gets one line saying so. ``auto`` times an embedding
    pass with both (``precision.choose``) on one packed row of ``max_tokens`` tokens: the first
    of ``texts``, or a generated text where none are given (a server at start-up).

    Raises:
        ValueError: ``requested`` is not one of ``PRECISIONS``.
    """
    if requested not in PRECISIONS:
        raise ValueError(
            f"precision must be one of {', '.join(PRECISIONS)}. Received: precision={requested!r}"
        )
    if requested == "fp32":
        return pretrained, choose("fp32")
    bf16 = copy.copy(pretrained)  # the same tokenizers and settings
    bf16.model = bf16_linears(pretrained.model)
    time_step = None
    if requested == "auto":
        sample = _sample(pretrained, texts, max_tokens)
        time_step = _pass_timer(pretrained, bf16, sample, max_tokens)
    device = next(pretrained.model.parameters()).device
    choice = choose(requested, device, say=say, time_step=time_step, work="embedding pass")
    return (bf16 if choice.precision == "bf16" else pretrained), choice
