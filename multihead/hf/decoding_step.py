"""A transformers Llama model's decoding steps in one C++ call (``decoding_step``).

``decoding_linears`` puts the products of a step on multihead's few-row kernel, but a
transformers step still runs its modules in Python: on SmolLM2's 30 layers that costs about
as much as reading the weights. ``decoding_step(model)`` runs each step of one new token per
row through the C++ loop multihead's own decoders use (``kernels/csrc/decoder_step.h``), over
the transformers model's own weights: RMSNorm, the q/k/v products stacked, the rotary
embedding as the model's ``rotary_emb`` gives it, the cache write, attention over the cache,
the output product, the SwiGLU feed-forward. The keys and values stay in transformers'
``DynamicCache``: its layers hold views into one buffer with room to grow, which the step
writes into. The result equals the modules' within float32 rounding.

It applies to ``LlamaForCausalLM`` (Llama, SmolLM2, ...) on the CPU in float32: a step of one
token per row over a ``DynamicCache`` whose rows all hold the same length (no padding), in
inference, with no hooks, no ``output_attentions`` / ``output_hidden_states`` and no
``multihead.acting`` block open. Every other call (the prompt, padded batches, ...) runs the
model's own forward, unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from .. import acting
from .._validation import tracing
from ..modules import decoder_step, native_step
from ..modules.few_rows import kernel_error
from ._transformers import hooked
from .linears import decoding_linears

__all__ = ["decoding_step"]

_FLAG = "_multihead_decoding_step"


def decoding_step(model: nn.Module) -> nn.Module:
    """Run ``model``'s decoding steps in one C++ call each, in place (and its float32 linear
    layers on the few-row kernel, as ``decoding_linears`` does). Calling it again changes
    nothing.

    Args:
        model: a transformers ``LlamaForCausalLM`` on the CPU in float32.

    Returns:
        ``model``.

    Raises:
        TypeError: ``model`` is not a ``LlamaForCausalLM``.
        RuntimeError: the few-row kernel cannot be built here (the message says why).
    """
    inner: Any = getattr(model, "model", None)
    if type(model).__name__ != "LlamaForCausalLM" or type(inner).__name__ != "LlamaModel":
        raise TypeError(
            "decoding_step takes a transformers LlamaForCausalLM (Llama, SmolLM2, ...); other "
            "models keep decoding_linears. Received: a model of type "
            f"{type(model).__name__}"
        )
    why = kernel_error()
    if why is not None:
        raise RuntimeError(f"decoding_step needs the few-row kernel, which {why}")
    decoding_linears(model)
    if not inner.__dict__.get(_FLAG):
        original = inner.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            out = None if args else _step(inner, kwargs)
            return original(*args, **kwargs) if out is None else out

        inner.forward = forward
        inner.__dict__[_FLAG] = True
    return model


def _step(inner: Any, kwargs: dict[str, Any]) -> Any:
    """The step in one C++ call where it applies (the module docstring), else None."""
    ids, cache = kwargs.get("input_ids"), kwargs.get("past_key_values")
    if not _applies(ids, cache, kwargs):
        return None
    assert ids is not None and cache is not None
    plan = _plan(inner)
    held = cache.layers[0].keys
    if plan is None or (held.shape[1], held.shape[-1], held.dtype) != (
        *plan.heads[:2],
        torch.float32,
    ):
        return None
    layers, length = cache.layers, held.shape[-2]
    b = ids.shape[0]
    keys, values = _buffers(cache, length + 1)
    x = inner.embed_tokens(ids)  # (B, 1, E)
    positions = torch.full((b, 1), length, dtype=torch.long)
    cos, sin = inner.rotary_emb(x, positions)  # (B, 1, D): the halves repeated
    half = cos.shape[-1] // 2
    scale = float(inner.layers[0].self_attn.scaling)
    cos, sin = cos[:, 0, :half].contiguous(), sin[:, 0, :half].contiguous()
    out = native_step.run(plan, x, keys, values, length, cos, sin, scale)
    for i, layer in enumerate(layers):
        layer.keys, layer.values = keys[i, :, :, : length + 1], values[i, :, :, : length + 1]
    from transformers.modeling_outputs import BaseModelOutputWithPast

    return BaseModelOutputWithPast(
        last_hidden_state=inner.norm(out.view(b, 1, -1)), past_key_values=cache
    )


def _applies(ids: Any, cache: Any, kwargs: dict[str, Any]) -> bool:
    """One new token per row over a DynamicCache of rows of one length, nothing else asked."""
    return _request_fits(ids, kwargs) and _cache_fits(cache, kwargs)


def _request_fits(ids: Any, kwargs: dict[str, Any]) -> bool:
    """One new token per row on the CPU in inference, no outputs to collect, no hook or
    acting block that would see the layers' calls."""
    if not isinstance(ids, Tensor) or ids.dim() != 2 or ids.shape[1] != 1 or ids.shape[0] > 16:
        return False
    asked = ("output_attentions", "output_hidden_states", "inputs_embeds")
    if ids.device.type != "cpu" or any(kwargs.get(k) is not None and kwargs.get(k) is not False
                                       for k in asked):  # fmt: skip
        return False
    if kwargs.get("use_cache") is False or torch.is_grad_enabled() or tracing():
        return False
    return native_step.enabled and not acting.active() and not decoder_step.global_hooks()


def _cache_fits(cache: Any, kwargs: dict[str, Any]) -> bool:
    """A DynamicCache whose layers all hold the same length, every row real (no padding)."""
    if type(cache).__name__ != "DynamicCache" or not cache.layers:
        return False
    layers = cache.layers
    if any(type(layer).__name__ != "DynamicLayer" or not layer.is_initialized for layer in layers):
        return False
    length = layers[0].keys.shape[-2]
    if length == 0 or any(layer.keys.shape[-2] != length for layer in layers):
        return False
    mask = kwargs.get("attention_mask")
    if mask is not None and not (mask.shape[-1] == length + 1 and bool(mask.all())):
        return False  # padding: rows of other lengths
    positions = kwargs.get("position_ids")
    return positions is None or bool((positions == length).all())


class _Plan(native_step.Plan):
    """``native_step.Plan`` for transformers' layers: transformers' output-capturing hooks do
    not count (``_transformers.hooked``)."""

    hooked = staticmethod(hooked)


def _plan(inner: Any) -> native_step.Plan | None:
    """The layers' tensors in decoder_step.h's order, gathered once and kept on the model
    while every module and tensor read is in its place and unhooked; None where some layer
    is not one the step runs."""
    kept = inner.__dict__.get("_multihead_plan")
    if kept is not None and kept.valid():
        return kept
    plan = _gathered(inner)
    inner.__dict__["_multihead_plan"] = plan
    return plan


def _gathered(inner: Any) -> native_step.Plan | None:
    embed = inner.embed_tokens
    if embed.weight.dtype != torch.float32:
        return None  # the step takes float32 activations
    return native_step.gather(_Plan(inner.layers), _layer)


def _layer(read: Any, layer: nn.Module) -> tuple[list[Tensor], tuple] | None:
    """A LlamaDecoderLayer's tensors (RMSNorms, SwiGLU) and ``Plan.shared``: the rotary
    comes from the model's ``rotary_emb`` at each step, so none is named here."""
    if type(layer).__name__ != "LlamaDecoderLayer" or hooked(layer):
        return None
    attn, mlp = read.module(layer, "self_attn"), read.module(layer, "mlp")
    norms = [read.module(layer, n) for n in ("input_layernorm", "post_attention_layernorm")]
    if any(m is None or hooked(m) for m in (attn, mlp, *norms)):
        return None
    if type(mlp.act_fn).__name__ not in ("SiLU", "SiLUActivation"):
        return None
    eps = {float(n.variance_epsilon) for n in norms}
    attn_products = native_step.products(
        read, attn, ("q_proj", "k_proj", "v_proj", "o_proj"), stacked=3
    )
    mlp_products = native_step.products(read, mlp, ("up_proj", "gate_proj", "down_proj"), stacked=2)
    if attn_products is None or mlp_products is None or len(eps) != 1:
        return None
    empty = native_step.EMPTY
    n1, n2 = (read.param(n, "weight") for n in norms)
    tensors = [n1, empty, *attn_products, n2, empty, *mlp_products]
    config, d = attn.config, attn.head_dim
    dims = (config.hidden_size, config.num_key_value_heads, d, d)
    norm, silu = native_step.RMS_NORM, native_step.SILU
    return tensors, (norm, eps.pop(), silu, True, None, config.num_attention_heads, dims)


def _buffers(cache: Any, need: int) -> tuple[Tensor, Tensor]:
    """(keys, values) (layers, B, H_kv, capacity, D) holding the cache's layers, whose keys
    and values are views into them; made (or grown, doubling) where ``need`` slots do not
    fit or a layer's tensors were replaced since."""
    kept = cache.__dict__.get("_multihead_buffers")
    layers = cache.layers
    if kept is not None:
        keys, values = kept
        held = all(
            layer.keys.data_ptr() == keys[i].data_ptr()
            and layer.values.data_ptr() == values[i].data_ptr()
            for i, layer in enumerate(layers)
        )
        if held and need <= keys.shape[3]:
            return keys, values
    first = layers[0].keys
    length = first.shape[-2]
    capacity = max(need, 2 * length, 64)
    shape = (len(layers), first.shape[0], first.shape[1], capacity, first.shape[-1])
    keys = first.new_zeros(shape)
    values = first.new_zeros((*shape[:4], layers[0].values.shape[-1]))
    for i, layer in enumerate(layers):
        keys[i, :, :, :length] = layer.keys
        values[i, :, :, :length] = layer.values
        layer.keys, layer.values = keys[i, :, :, :length], values[i, :, :, :length]
    cache.__dict__["_multihead_buffers"] = (keys, values)
    return keys, values
