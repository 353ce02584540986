"""A decoder's decoding step in C++ with no Python between the layers (``decoder_step`` in
``kernels/csrc/decoder_step.h``, built into the few-row kernel's module).

``decoder_step.py`` already runs a step without the module calls, but each layer still makes
a dozen Python calls (the products, the rotary, the cache write, the attention, the norms,
the activation): on SmolLM2's 30 layers of width 576 those calls cost as much as reading the
weights. Here the whole step is one call: the layers' tensors are gathered from the modules'
own dicts, and the C++ loop runs every layer (the norms, the stacked products on the few-row
kernel over float32, bf16 or int8 weights, the rotary, the cache write, the attention over
the cache, the feed-forward, the residuals). Its result equals the modules' path within
float32 rounding (its norms, softmax and activations sum in other orders), not bit for bit.

It applies where ``decoder_step`` applies and, besides: one new token per row, every row at
the same length (no padding, so the new keys go to one slot), a growing or fixed cache of
float32 (not a rolling window), at most 16 rows; every layer a pre-norm
``TransformerDecoderLayer`` whose norms are ``nn.LayerNorm`` or ``RMSNorm`` (one kind and
epsilon for all), whose projections are ``nn.Linear`` / ``RowsLinear`` (float32) or
``PackedLinear`` (bf16, int8) without hooks, q, k and v of one dtype, whose rotary embedding
is a ``RotaryEmbedding`` over the whole head (or none), and whose feed-forward is a
``FeedForward`` or ``GatedFeedForward`` with GELU, SiLU or ReLU. Anything else (hooks,
subclasses, other parts) takes ``decoder_step``'s path. ``MULTIHEAD_NATIVE_STEP=0`` (or
``native_step.enabled = False``) turns it off.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
from torch import Tensor, nn

from . import decoder_step
from .cache import KVCache
from .few_rows import _LOADER as _ROWS
from .few_rows import RowsLinear, kernel_fits
from .norms import RMSNorm
from .rotary import RotaryEmbedding
from .transformer import FeedForward, GatedFeedForward

__all__ = ["applies", "enabled", "step"]

enabled = os.environ.get("MULTIHEAD_NATIVE_STEP", "1") != "0"

_NONE = torch.empty(0)  # an absent bias, scale or norm weight
_WEIGHTS = (torch.float32, torch.bfloat16, torch.int8)  # what the few-row kernel reads
# activations by kind, as decoder_step.h numbers them
_GELU_ERF, _GELU_TANH, _SILU, _RELU = 0, 1, 2, 3


def _hooked(m: nn.Module) -> bool:
    return bool(m._forward_hooks or m._forward_pre_hooks)


def _product(m: nn.Module) -> tuple[Tensor, Tensor, Tensor] | None:
    """(weight, scale, bias) of a projection as the kernel reads them, or None."""
    if _hooked(m):
        return None
    params: dict[str, Any] = m._parameters
    buffers: dict[str, Any] = m._buffers
    kind = type(m)
    if "packed" in buffers:
        weight, scale = buffers["packed"], buffers["scale"]
    elif kind is nn.Linear or kind is RowsLinear:
        weight, scale = params["weight"], None
    else:
        return None
    bias = params.get("bias")
    if not weight.is_contiguous() or weight.dtype not in _WEIGHTS:
        return None
    return weight, _NONE if scale is None else scale, _NONE if bias is None else bias


def _norm(m: nn.Module) -> tuple[int, float, Tensor, Tensor] | None:
    """(kind, eps, weight, bias) of a norm: 0 LayerNorm, 1 RMSNorm; None for others."""
    if _hooked(m):
        return None
    params: dict[str, Any] = m._parameters
    if type(m) is nn.LayerNorm and len(m.normalized_shape) == 1:
        w, b = params.get("weight"), params.get("bias")
        return 0, float(m.eps), _NONE if w is None else w, _NONE if b is None else b
    if type(m) is RMSNorm and params["weight"].dtype == torch.float32:
        return 1, float(m.eps), params["weight"], _NONE
    return None


def _activation(m: nn.Module) -> int | None:
    if _hooked(m):
        return None
    kind = type(m)
    if kind is nn.GELU:
        return _GELU_TANH if m.approximate == "tanh" else _GELU_ERF
    if kind is nn.SiLU:
        return _SILU
    if kind is nn.ReLU:
        return _RELU
    return None


def _layer(layer: nn.Module, kind: type) -> tuple[list[Tensor], tuple] | None:
    """The layer's tensors in decoder_step.h's order and what the whole step must share
    (norm kind and eps, activation, gated, rotary), or None where it cannot run natively."""
    if type(layer) is not kind:
        return None
    parts: dict[str, Any] = layer._modules
    attn, ff = parts["self_attn"], parts["feed_forward"]
    n1, n2 = _norm(parts["norm1"]), _norm(parts["norm2"])
    if n1 is None or n2 is None or n1[:2] != n2[:2]:
        return None
    a: dict[str, Any] = attn._modules
    qkv = [_product(a[name]) for name in ("q_proj", "k_proj", "v_proj")]
    out = _product(a["out_proj"])
    if any(p is None for p in qkv) or out is None or len({p[0].dtype for p in qkv}) != 1:
        return None
    rotary = a.get("rotary")
    if rotary is not None and (
        type(rotary) is not RotaryEmbedding or _hooked(rotary) or rotary.head_dim != attn.head_dim
    ):
        return None
    f: dict[str, Any] = ff._modules
    ff_kind = type(ff)
    if ff_kind is FeedForward:
        up, gate, down = _product(f["linear1"]), (_NONE, _NONE, _NONE), _product(f["linear2"])
    elif ff_kind is GatedFeedForward:
        up, gate, down = _product(f["up_proj"]), _product(f["gate_proj"]), _product(f["down_proj"])
        if gate is not None and up is not None and gate[0].dtype != up[0].dtype:
            return None
    else:
        return None
    activation = _activation(f["activation"])
    if up is None or gate is None or down is None or activation is None:
        return None
    tensors = [n1[2], n1[3], *qkv[0], *qkv[1], *qkv[2], *out, n2[2], n2[3], *up, *gate, *down]
    rot = None if rotary is None else (rotary.head_dim, rotary.base, rotary.interleaved)
    shared = (n1[0], n1[1], activation, ff_kind is GatedFeedForward, rot, attn.num_heads)
    return tensors, shared


def applies(layers: nn.ModuleList, kind: type, x: Tensor, cache: KVCache) -> bool:
    """Whether ``step`` may run ``x`` (B, 1, E) through ``layers`` (each of class ``kind``,
    ``TransformerDecoderLayer``) over ``cache`` (after ``cache.begin``):
    ``decoder_step.applies`` and what the module docstring lists."""
    if not enabled or cache.window is not None or cache._slots is not None:
        return False
    step = cache._step
    if step is None or step.mask is not None or cache.dtype != torch.float32:
        return False
    if x.dtype != torch.float32 or x.shape[0] > 16 or x.device.type != "cpu":
        return False
    if not decoder_step.applies(layers, kind, x, cache):
        return False
    return kernel_fits(x) and hasattr(_ROWS.module or _ROWS.load(), "decoder_step")


def step(layers: nn.ModuleList, kind: type, x: Tensor, cache: KVCache) -> Tensor | None:
    """``x`` (B, 1, E) through ``layers`` in one C++ call, the new keys and values stored in
    ``cache``; None where some layer cannot run natively (the caller then takes
    ``decoder_step``'s path, nothing having been written)."""
    tensors: list[Tensor] = []
    shared = None
    for layer in layers._modules.values():
        found = _layer(layer, kind)
        if found is None or (shared is not None and found[1] != shared):
            return None
        tensors += found[0]
        shared = found[1]
    assert shared is not None
    norm, eps, activation, gated, rot, heads = shared
    attn = next(iter(layers._modules.values()))._modules["self_attn"]
    cos = sin = _NONE
    if rot is not None:
        rotary = attn._modules["rotary"]
        cos, sin = rotary.cos_sin(cache.step.positions, torch.float32, x.device)
        b = x.shape[0]
        cos, sin = cos.reshape(b, -1).contiguous(), sin.reshape(b, -1).contiguous()
    kernel = _ROWS.module or _ROWS.load()
    out = kernel.decoder_step(
        x.reshape(x.shape[0], -1).contiguous(), tensors, cache._keys, cache._values,
        cache._offsets[0], cos, sin, bool(rot is not None and rot[2]), heads,
        cache.num_kv_heads, 1.0 / math.sqrt(cache.head_dim), norm, eps, activation, gated,
    )  # fmt: skip
    cache._written = set(range(cache.num_layers))
    return out.view_as(x)
