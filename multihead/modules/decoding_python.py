"""A decoder's decoding step on a short path: one new token per row over a ``KVCache``.

A decoding step reads every weight of the model once and does little else, so what the
modules do around the products (the module calls, the checks of every call, the choice of
kernel per product, reshapes into and out of heads) is a large share of a small model's step.
``step`` runs the step ``TransformerDecoder.forward`` runs, the same operations in the same
order, so its result is the same to the bit, without what it need not repeat: the call is
checked once for every layer, each product goes straight to the kernel or ``F.linear`` its
module would choose (``few_rows.step_product``), the products of one input (q, k and v; a gated
feed-forward's gate and up) run as one kernel call where each would run on the kernel
(``few_rows.stacked_products``, the same bits), the heads are views of the product rows, the
keys and values go into the cache without its checks, a rotary embedding's cosines and sines
are made once for all the layers, and the attention takes the decoding short path the module
takes (``multihead/decoding_routes.py``).

It applies to a stack of ``TransformerDecoderLayer`` whose attention is a
``MultiHeadAttention`` and whose feed-forward is a ``FeedForward`` or ``GatedFeedForward``
(the blocks of every ``CausalLM`` here), outside autograd and traced graphs, without autocast,
with every dropout inactive, no hooks on those modules (nor global ones) and no block of
``multihead.acting`` open (its plan is read by the modules' calls). A LayerNorm and
the activations a feed-forward is built with (GELU, ReLU, SiLU), without hooks, are computed
as their ``forward`` computes them, without the module call; their other parts (another norm,
a rotary embedding, a linear layer of another kind, anything with hooks) are called as the
modules they are. Anything else takes the modules' path.
``MULTIHEAD_STEP_PATH=0`` (or ``decoding_python.enabled = False``) turns the short path off.

Submodules are read from ``_modules`` rather than as attributes: ``nn.Module.__getattr__``
costs about a microsecond, and a GPT-2-small step reads a few hundred of them.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules import module as _module

from .. import _validation as V
from .. import acting
from .. import decoding_routes as routes
from .attention import MultiHeadAttention
from .cache import KVCache
from .few_rows import kernel_fits, stacked_products, step_product
from .rotary import RotaryEmbedding
from .transformer import FeedForward, GatedFeedForward

__all__ = ["applies", "enabled", "global_hooks", "ready", "step"]

# whether decoding steps may take the short path at all
enabled = os.environ.get("MULTIHEAD_STEP_PATH", "1") != "0"


def _hooked(m: nn.Module) -> bool:
    return bool(m._forward_hooks or m._forward_pre_hooks)


def _idle(dropout: nn.Module) -> bool:
    """Whether a dropout module does nothing: a plain ``nn.Dropout`` at rate 0 or in eval
    mode, with no hooks."""
    return (
        type(dropout) is nn.Dropout
        and not _hooked(dropout)
        and (dropout.p == 0.0 or not dropout.training)
    )


def _layer_applies(layer: nn.Module, kind: type, x: Tensor, cache: KVCache) -> bool:
    if type(layer) is not kind:
        return False
    parts: dict[str, Any] = layer._modules
    attn, ff = parts["self_attn"], parts["feed_forward"]
    if not (
        not _hooked(layer)
        and _idle(parts["dropout"])
        and type(attn) is MultiHeadAttention
        and not _hooked(attn)
        and (attn.dropout == 0.0 or not attn.training)
        and type(ff) in (FeedForward, GatedFeedForward)
        and not _hooked(ff)
        and _idle(ff._modules["dropout"])
    ):
        return False
    want = attn._compute_dtype()
    # what the modules' checks would refuse, they refuse themselves, with their errors: the
    # input's dtype and width, and a cache of other heads, dims or dtype
    return (
        x.dtype == want == cache.dtype
        and x.shape[-1] == attn.embed_dim
        and (cache.num_kv_heads, cache.head_dim, cache.value_dim)
        == (attn.num_kv_heads, attn.head_dim, attn.value_head_dim)
    )


def applies(layers: nn.ModuleList, kind: type, x: Tensor, cache: KVCache) -> bool:
    """Whether ``step`` may run ``x`` (B, 1, E) through ``layers`` over ``cache``: each layer
    exactly of class ``kind`` (``TransformerDecoderLayer``, whose ``forward`` ``step``
    reproduces; a subclass may change it)."""
    if not ready(x, cache):
        return False
    return all(_layer_applies(layer, kind, x, cache) for layer in layers._modules.values())


def ready(x: Tensor, cache: KVCache) -> bool:
    """What ``applies`` asks besides the layers: the switch, one token per row, inference
    without autocast, hooks of every module or a graph being traced, a cache without a policy
    with its step begun, and no block of ``multihead.acting`` open."""
    return not (
        not enabled
        or x.dim() != 3
        or x.shape[1] != 1
        or torch.is_grad_enabled()
        or global_hooks()
        or torch.is_autocast_enabled(x.device.type)
        or V.tracing()
        or torch.jit.is_tracing()
        or cache.policy is not None  # a compressed cache: the modules read and hand back scores
        or acting.active()  # a block (capture, ablate, ...): the modules read its plan
        or not _step_begun(cache, x)
    )


def global_hooks() -> bool:
    """Whether a global forward hook is registered (``nn.modules.module``'s): it would see
    every module call a short path leaves out."""
    return bool(_module._global_forward_hooks or _module._global_forward_pre_hooks)


def _step_begun(cache: KVCache, x: Tensor) -> bool:
    """A step begun for x's batch and one token per row, no layer stored yet (the modules
    raise for a second forward pass without ``cache.begin``)."""
    return (
        cache._step is not None
        and cache.batch_size == x.shape[0]
        and cache._width == 1
        and not cache._written
    )


def step(layers: nn.ModuleList, x: Tensor, cache: KVCache) -> Tensor:
    """``x`` (B, 1, E) through ``layers``, each storing its keys and values in ``cache`` (after
    ``cache.begin``): what the layers' own calls give, bit for bit, every part called with
    the shapes the modules give it. Call it where ``applies`` says it may run."""
    fits = kernel_fits(x)
    turns: dict[tuple, tuple[Tensor, Tensor]] = {}  # the step's rotary cosines and sines
    for i, layer in enumerate(layers._modules.values()):
        parts: dict[str, Any] = layer._modules
        x = x + _attend(parts["self_attn"], _normed(parts["norm1"], x), cache, i, fits, turns)
        x = x + _feed_forward(parts["feed_forward"], _normed(parts["norm2"], x), fits)
    return x


def _normed(norm: nn.Module, x: Tensor) -> Tensor:
    """``norm(x)``: an ``nn.LayerNorm`` without hooks computes here, as its ``forward`` does
    (``F.layer_norm`` with the module's own arguments), without the module call; any other
    norm is called."""
    if type(norm) is nn.LayerNorm and not _hooked(norm):
        params: dict[str, Any] = norm._parameters
        return F.layer_norm(x, norm.normalized_shape, params["weight"], params["bias"], norm.eps)
    return norm(x)


def _activated(activation: Any, x: Tensor) -> Tensor:
    """``activation(x)``: the activations a feed-forward here is built with (``nn.GELU``,
    ``nn.ReLU``, ``nn.SiLU``), without hooks, compute here as their ``forward`` does, without
    the module call; any other module is called."""
    if not _hooked(activation):
        kind = type(activation)
        if kind is nn.GELU:
            return F.gelu(x, approximate=activation.approximate)
        if kind is nn.SiLU:
            return F.silu(x, inplace=activation.inplace)
        if kind is nn.ReLU:
            return F.relu(x, inplace=activation.inplace)
    return activation(x)


def _heads(x: Tensor, heads: int) -> Tensor:
    """(B, 1, heads * D) -> (B, heads, 1, D), as ``split_heads`` views it."""
    return x.view(x.shape[0], 1, heads, -1).transpose(1, 2)


def _attend(
    attn: MultiHeadAttention, x: Tensor, cache: KVCache, i: int, fits: bool, turns: dict
) -> Tensor:
    """The self-attention's output (B, 1, E_out) for x (B, 1, E); ``turns``: the step's rotary
    cosines and sines so far (``_rotated``)."""
    parts: dict[str, Any] = attn._modules
    projections = (parts["q_proj"], parts["k_proj"], parts["v_proj"])
    q, k, v = stacked_products(projections, x, fits) or [
        step_product(m, x, fits) for m in projections
    ]
    q, k, v = _heads(q, attn.num_heads), _heads(k, attn.num_kv_heads), _heads(v, attn.num_kv_heads)
    rotary = parts.get("rotary")  # a module, or None (then not among the modules)
    if rotary is not None:
        q, k = _rotated(rotary, q, k, cache.step.positions, turns)
    keys, values, mask = cache._append(i, k, v)
    out = routes.attend(q, keys, values, mask, None, None)  # (B, 1, H, D_v)
    return step_product(parts["out_proj"], out.reshape(out.shape[0], 1, -1), fits)


def _rotated(
    rotary: nn.Module, q: Tensor, k: Tensor, positions: Tensor, turns: dict
) -> tuple[Tensor, Tensor]:
    """``rotary(q, positions), rotary(k, positions)``, the cosines and sines made once per step
    for every layer whose ``RotaryEmbedding`` has the same head dim and base, on the same
    dtype and device (the same operations on the same positions: the same bits). A subclass,
    a module with hooks or a query whose head dim it does not take is called as it is."""
    if type(rotary) is not RotaryEmbedding or _hooked(rotary) or q.shape[-1] != rotary.head_dim:
        return rotary(q, positions), rotary(k, positions)
    key = (rotary.head_dim, rotary.base, q.dtype, q.device)
    turn = turns.get(key)
    if turn is None:
        turn = turns[key] = rotary.cos_sin(positions, q.dtype, q.device)
    return rotary.rotate(q, *turn), rotary.rotate(k, *turn)


def _feed_forward(ff: nn.Module, x: Tensor, fits: bool) -> Tensor:
    parts: dict[str, Any] = ff._modules
    activation = parts["activation"]
    if type(ff) is FeedForward:
        hidden = _activated(activation, step_product(parts["linear1"], x, fits))
        return step_product(parts["linear2"], hidden, fits)
    both = stacked_products((parts["gate_proj"], parts["up_proj"]), x, fits)
    if both is None:
        gate = _activated(activation, step_product(parts["gate_proj"], x, fits))
        up = step_product(parts["up_proj"], x, fits)
    else:
        gate, up = _activated(activation, both[0]), both[1]
    return step_product(parts["down_proj"], gate * up, fits)
