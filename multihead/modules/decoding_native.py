"""A decoder's decoding step in C++ with no Python between the layers (``native_step`` in
``kernels/csrc/decoding_native.h``, built into the few-row kernel's module).

``decoding_python.py`` already runs a step without the module calls, but each layer still makes
a dozen Python calls (the products, the rotary, the cache write, the attention, the norms,
the activation): on SmolLM2's 30 layers of width 576 those calls cost as much as reading the
weights. Here the whole step is one call: the layers' tensors are gathered from the modules'
own dicts, and the C++ loop runs every layer (the norms, the stacked products on the few-row
kernel over float32, bf16 or int8 weights, the rotary, the cache write, the attention over
the cache, the feed-forward, the residuals). Its result equals the modules' path within
float32 rounding (its norms, softmax and activations sum in other orders), not bit for bit.

It applies where ``decoding_python`` applies and, besides: one new token per row, every row at
the same length (no padding, so the new keys go to one slot), a growing or fixed cache of
float32 (not a rolling window), at most 16 rows; every layer a pre-norm
``TransformerDecoderLayer`` whose norms are ``nn.LayerNorm`` or ``RMSNorm`` (one kind and
epsilon for all), whose projections are ``nn.Linear`` / ``RowsLinear`` (float32) or
``PackedLinear`` (bf16, int8) without hooks, q, k and v of one dtype, whose rotary embedding
is a ``RotaryEmbedding`` over the whole head (or none), and whose feed-forward is a
``FeedForward`` or ``GatedFeedForward`` with GELU, SiLU or ReLU. Anything else (hooks,
subclasses, other parts) takes ``decoding_python``'s path. ``MULTIHEAD_NATIVE_STEP=0`` (or
``decoding_native.enabled = False``) turns it off.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from . import decoding_python as python_step
from .attention import MultiHeadAttention
from .cache import KVCache
from .few_rows import _LOADER as _ROWS
from .few_rows import RowsLinear, kernel_fits
from .norms import RMSNorm
from .rotary import RotaryEmbedding
from .transformer import FeedForward, GatedFeedForward

__all__ = ["EMPTY", "Plan", "Reader", "applies", "enabled", "gather", "products", "run", "step"]

enabled = os.environ.get("MULTIHEAD_NATIVE_STEP", "1") != "0"

EMPTY = torch.empty(0)  # an absent bias, scale or norm weight
_WEIGHTS = (torch.float32, torch.bfloat16, torch.int8, torch.uint8)  # what the kernel reads
# norms and activations by kind, as decoding_native.h numbers them
LAYER_NORM, RMS_NORM = 0, 1
_GELU_ERF, _GELU_TANH, SILU, _RELU = 0, 1, 2, 3


def _hooked(m: nn.Module) -> bool:
    return bool(m._forward_hooks or m._forward_pre_hooks)


@dataclass
class Plan:
    """What a step hands the C++ call, gathered from ``layers`` once and kept on the
    ``KVCache`` for its later steps: the layers' tensors, what they share, and what must still
    hold for them to be the layers' own (``valid``): each module and tensor read still in its
    place, no hook on any of those modules, every dropout still as it was."""

    layers: nn.ModuleList
    tensors: list[Tensor] = field(default_factory=list)
    # what every layer shares: (norm kind, eps, activation, gated, rotary or None, H,
    # (E, H_kv, D, D_v)), the rotary as (D, base, interleaved)
    shared: tuple = ()
    width: int = 0  # E
    heads: tuple[int, int, int] = (0, 0, 0)  # (H_kv, D, D_v)
    held: list[tuple[dict, str, object]] = field(default_factory=list)  # (where, name, what)
    watched: list[nn.Module] = field(default_factory=list)  # modules whose hooks would count

    def valid(self) -> bool:
        """Everything read is still in its place, unhooked: checked at every step (a few
        hundred identity tests: tens of microseconds)."""
        return all(where.get(name) is what for where, name, what in self.held) and not any(
            self.hooked(m) for m in self.watched
        )

    # whether a hook on a module would see or change the step (any hook, here)
    hooked = staticmethod(_hooked)


class Reader:
    """Reads a layer's parts and notes each one in the plan's ``held`` and ``watched``."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan

    def module(self, parent: nn.Module, name: str) -> Any:
        found = parent._modules.get(name)
        self.plan.held.append((parent._modules, name, found))
        if found is not None:
            self.plan.watched.append(found)
        return found

    def tensor(self, where: dict, name: str) -> Any:
        found = where.get(name)
        self.plan.held.append((where, name, found))
        return found

    def param(self, m: nn.Module, name: str) -> Any:
        """The parameter ``name`` of ``m`` (or None), noted as held."""
        return self.tensor(m._parameters, name)

    def flag(self, m: nn.Module, name: str) -> Any:
        found = m.__dict__.get(name)
        self.plan.held.append((m.__dict__, name, found))
        return found


def _product(read: Reader, m: nn.Module | None) -> tuple[Tensor, Tensor, Tensor] | None:
    """(weight, scale, bias) of a projection as the kernel reads them, or None."""
    if m is None or _hooked(m):
        return None
    kind = type(m)
    if "packed" in m._buffers:
        weight, scale = read.tensor(m._buffers, "packed"), read.tensor(m._buffers, "scale")
    elif kind is nn.Linear or kind is RowsLinear:
        weight, scale = read.tensor(m._parameters, "weight"), None
    else:
        return None
    bias = read.tensor(m._parameters, "bias")
    if not weight.is_contiguous() or weight.dtype not in _WEIGHTS:
        return None
    return weight, EMPTY if scale is None else scale, EMPTY if bias is None else bias


def _norm(read: Reader, m: nn.Module | None) -> tuple[int, float, Tensor, Tensor] | None:
    """(kind, eps, weight, bias) of a norm: 0 LayerNorm, 1 RMSNorm; None for others."""
    if m is None or _hooked(m):
        return None
    params: dict[str, Any] = m._parameters
    if type(m) is nn.LayerNorm and len(m.normalized_shape) == 1:
        w, b = read.tensor(params, "weight"), read.tensor(params, "bias")
        return LAYER_NORM, float(m.eps), EMPTY if w is None else w, EMPTY if b is None else b
    if type(m) is RMSNorm and params["weight"].dtype == torch.float32:
        return RMS_NORM, float(m.eps), read.tensor(params, "weight"), EMPTY
    return None


def _activation(m: nn.Module | None) -> int | None:
    if m is None or _hooked(m):
        return None
    kind = type(m)
    if kind is nn.GELU:
        return _GELU_TANH if m.approximate == "tanh" else _GELU_ERF
    if kind is nn.SiLU:
        return SILU
    if kind is nn.ReLU:
        return _RELU
    return None


def _idle(read: Reader, dropout: nn.Module | None) -> bool:
    """A plain ``nn.Dropout`` that does nothing (rate 0 or eval mode), its mode held."""
    if dropout is None or type(dropout) is not nn.Dropout or _hooked(dropout):
        return False
    return dropout.p == 0.0 or not read.flag(dropout, "training")


def _attention(read: Reader, attn: Any) -> tuple[list[Tensor], tuple] | None:
    """A self-attention's q, k, v and output products (weight, scale, bias each) and what the
    step must share of it (rotary, heads, dims), or None where it cannot run natively."""
    if type(attn) is not MultiHeadAttention or _hooked(attn):
        return None
    if attn.dropout != 0.0 and read.flag(attn, "training"):
        return None
    found = products(read, attn, ("q_proj", "k_proj", "v_proj", "out_proj"), stacked=3)
    rotary = read.module(attn, "rotary")
    if found is None or (
        rotary is not None
        and (
            type(rotary) is not RotaryEmbedding
            or _hooked(rotary)
            or rotary.head_dim != attn.head_dim
        )
    ):
        return None
    rot = None if rotary is None else (rotary.head_dim, rotary.base, rotary.interleaved)
    dims = (attn.embed_dim, attn.num_kv_heads, attn.head_dim, attn.value_head_dim)
    return found, (rot, attn.num_heads, dims)


def _feed_forward(read: Reader, ff: Any) -> tuple[list[Tensor], tuple] | None:
    """A feed-forward's up, gate (empty for an ungated one) and down products and what the
    step must share of it (activation, gated), or None where it cannot run natively."""
    kind = type(ff)
    gated = kind is GatedFeedForward
    if (kind is not FeedForward and not gated) or _hooked(ff):
        return None
    names = ("up_proj", "gate_proj", "down_proj") if gated else ("linear1", None, "linear2")
    found = products(read, ff, names, stacked=2 if gated else 1)
    activation = _activation(read.module(ff, "activation"))
    if found is None or activation is None or not _idle(read, read.module(ff, "dropout")):
        return None
    return found, (activation, gated)


def products(
    read: Reader, parent: nn.Module, names: tuple[str | None, ...], stacked: int
) -> list[Tensor] | None:
    """The products ``names`` of ``parent`` (weight, scale, bias each; None names an absent
    one: three empty tensors), flat; None where one cannot run on the kernel or the first
    ``stacked`` (one kernel call) differ in dtype."""
    found = [
        (EMPTY, EMPTY, EMPTY) if n is None else _product(read, read.module(parent, n))
        for n in names
    ]
    kept = [p for p in found if p is not None]
    if len(kept) != len(names) or len({p[0].dtype for p in kept[:stacked]}) != 1:
        return None
    return [t for p in kept for t in p]


def _layer(read: Reader, layer: nn.Module, kind: type) -> tuple[list[Tensor], tuple] | None:
    """The layer's tensors in decoding_native.h's order (norm1, q, k, v, out, norm2, up, gate,
    down) and what the whole step must share (norm kind and eps, activation, gated, rotary,
    heads, dims), or None where it cannot run natively."""
    if type(layer) is not kind or _hooked(layer) or not _idle(read, read.module(layer, "dropout")):
        return None
    n1, n2 = _norm(read, read.module(layer, "norm1")), _norm(read, read.module(layer, "norm2"))
    if n1 is None or n2 is None or n1[:2] != n2[:2]:
        return None
    attn = _attention(read, read.module(layer, "self_attn"))
    ff = _feed_forward(read, read.module(layer, "feed_forward"))
    if attn is None or ff is None:
        return None
    tensors = [n1[2], n1[3], *attn[0], n2[2], n2[3], *ff[0]]
    rot, heads, dims = attn[1]
    return tensors, (n1[0], n1[1], *ff[1], rot, heads, dims)


def gather(
    plan: Plan, layer: Callable[[Reader, nn.Module], tuple[list[Tensor], tuple] | None]
) -> Plan | None:
    """``plan`` filled from its layers, each read by ``layer`` (its tensors in
    decoding_native.h's order and ``Plan.shared``), or None where one cannot run natively or
    the layers differ in what they must share."""
    read = Reader(plan)
    for name in plan.layers._modules:
        module = read.module(plan.layers, name)
        found = None if module is None else layer(read, module)
        if found is None or (plan.shared and found[1] != plan.shared):
            return None
        plan.tensors += found[0]
        plan.shared = found[1]
    if not plan.shared:
        return None
    dims = plan.shared[-1]
    plan.width, plan.heads = dims[0], dims[1:]
    return plan


def _plan(layers: nn.ModuleList, kind: type, cache: KVCache) -> Plan | None:
    """The plan kept on ``cache`` for ``layers`` where it is still valid, else gathered anew
    (and kept); None where the layers cannot run natively."""
    kept = cache.__dict__.get("_native_plan")
    if kept is not None and kept.layers is layers and kept.valid():
        return kept
    plan = gather(Plan(layers), lambda read, layer: _layer(read, layer, kind))
    cache.__dict__["_native_plan"] = plan
    return plan


def _one_slot(cache: KVCache) -> bool:
    """A float32 cache whose step puts every row's new token in one slot: not rolling, rows
    of one length, no mask for the step."""
    step = cache._step
    return (
        cache.window is None
        and cache._slots is None
        and step is not None
        and step.mask is None
        and cache.dtype == torch.float32
    )


def applies(layers: nn.ModuleList, kind: type, x: Tensor, cache: KVCache) -> bool:
    """Whether ``step`` may run ``x`` (B, 1, E) through ``layers`` (each of class ``kind``,
    ``TransformerDecoderLayer``) over ``cache`` (after ``cache.begin``): what
    ``python_step.ready`` asks, what the module docstring lists, and a valid plan."""
    if not enabled or not python_step.ready(x, cache) or not _one_slot(cache):
        return False
    if x.dtype != torch.float32 or x.shape[0] > 16 or x.device.type != "cpu":
        return False
    if not kernel_fits(x):  # the few-row kernel is built, and the step is in it
        return False
    plan = _plan(layers, kind, cache)
    return (
        plan is not None
        and x.shape[-1] == plan.width
        and (cache.num_kv_heads, cache.head_dim, cache.value_dim) == plan.heads
    )


def step(layers: nn.ModuleList, kind: type, x: Tensor, cache: KVCache) -> Tensor:
    """``x`` (B, 1, E) through ``layers`` in one C++ call, the new keys and values stored in
    ``cache``. Call it where ``applies`` says it may run (its plan is then on the cache)."""
    plan = cache.__dict__["_native_plan"]
    assert plan is not None and plan.layers is layers
    rot = plan.shared[4]
    cos = sin = EMPTY
    if rot is not None:
        first = next(iter(layers._modules.values()))
        rotary = first._modules["self_attn"]._modules["rotary"]
        cos, sin = rotary.cos_sin(cache.step.positions, torch.float32, x.device)
        b = x.shape[0]
        cos, sin = cos.reshape(b, -1).contiguous(), sin.reshape(b, -1).contiguous()
    scale = 1.0 / math.sqrt(cache.head_dim)
    out = run(plan, x, cache._keys, cache._values, cache._offsets[0], cos, sin, scale)
    cache._written = set(range(cache.num_layers))
    return out.view_as(x)


def run(
    plan: Plan,
    x: Tensor,
    keys: Tensor,
    values: Tensor,
    start: int,
    cos: Tensor,
    sin: Tensor,
    scale: float,
) -> Tensor:
    """The C++ step: ``x`` (B, ..., E) float32 through ``plan``'s layers, each row's new key
    and value written to slot ``start`` of ``keys`` / ``values`` (layers, B, H_kv, capacity,
    D) float32 contiguous; ``cos`` / ``sin`` (B, D / 2) of the new position (empty without a
    rotary embedding). Returns (B, E)."""
    norm, eps, activation, gated, rot, heads, dims = plan.shared
    kernel = _ROWS.module or _ROWS.load()
    return kernel.native_step(
        x.reshape(x.shape[0], -1).contiguous(), plan.tensors, keys, values, start, cos, sin,
        bool(rot is not None and rot[2]), heads, dims[1], scale, norm, eps, activation, gated,
    )  # fmt: skip
