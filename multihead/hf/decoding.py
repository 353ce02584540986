"""A transformers model's decoding on multihead's kernels: ``multihead.hf.fast_decoding``.

A decoding step multiplies one row per sequence by every weight matrix of the model. On the
CPU torch hands such a product to its BLAS as a matrix-vector product, which streams the
weights at a fraction of the memory bandwidth; multihead's few-row kernel
(``multihead.modules.few_rows.RowsLinear``) splits the output channels over every core and
streams them at the bandwidth. In a decoding step the products are most of the time and the
attention a few percent of it: this, not the attention implementation, is what makes a
transformers model's ``generate()`` faster.

``fast_decoding(model)`` takes the faster of the two ways this module has:

- **the native step** for ``LlamaForCausalLM`` (Llama, SmolLM2, ...): each step of one new
  token per row runs in one C++ call, the loop multihead's own decoders use
  (``modules/decoding_native.py`` driving ``kernels/csrc/decoding_native.h``), over the transformers
  model's own weights: RMSNorm, the q/k/v products stacked, the rotary embedding as the
  model's ``rotary_emb`` gives it, the cache write, attention over the cache, the output
  product, the SwiGLU feed-forward. The keys and values stay in transformers' ``DynamicCache``:
  its layers hold views into one buffer with room to grow, which the step writes into. The
  result equals the modules' within float32 rounding. It runs a step of one token per row
  over a ``DynamicCache`` whose rows all hold the same length (no padding), in inference, with
  no hooks, no ``output_attentions`` / ``output_hidden_states`` and no ``multihead.acting``
  block open; every other call (the prompt, padded batches, ...) runs the model's own
  forward, on the few-row linears below;
- **the few-row linears** for every other model: its float32 ``nn.Linear`` layers become
  ``RowsLinear`` (a subclass of ``nn.Linear`` holding the same parameters: tied weights stay
  tied, the state dict and ``save_pretrained`` are unchanged), whose products of at most 16
  rows outside autograd run on the kernel where it measured faster than ``F.linear``. Other
  layers (embeddings, norms, transformers' ``Conv1D``) are left as they are.

Where the kernel cannot be built here (no C++ compiler), one warning per process says so and
the model keeps decoding as it did. ``decoding_step`` and ``decoding_linears``, the two entries
this one replaces, keep working for a release with a ``MultiheadDeprecationWarning``.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor, nn

from .. import acting
from .._deprecation import deprecated
from .._validation import tracing
from ..modules import decoding_native as native_step
from ..modules import decoding_python as python_step
from ..modules import few_rows
from ._transformers import hooked

__all__ = [
    "LINEARS",
    "NATIVE",
    "decoding_linears",
    "decoding_path",
    "decoding_step",
    "fast_decoding",
]

NATIVE, LINEARS = "native step", "few-row linears"  # what decoding_path names
_FLAG = "_multihead_decoding_step"
_PATH = "_multihead_decoding_path"
_warned: list[str] = []  # the kernel's absence, said once per process


def fast_decoding(model: nn.Module) -> nn.Module:
    """Speed up ``model``'s decoding on the CPU, in place: the native step for a
    ``LlamaForCausalLM``, the few-row linears for any other model (``multihead.hf.decoding``
    says what each does). Calling it again changes nothing.

    Where the few-row kernel cannot be built here, a ``RuntimeWarning`` says why (once per
    process; ``multihead doctor`` says how to get the kernel) and ``model`` is returned
    unchanged, decoding as it did.

    Args:
        model: a transformers model on the CPU in float32.

    Returns:
        ``model``; ``decoding_path(model)`` names the way taken.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: ``model`` has no float32 ``nn.Linear`` on the CPU (nothing to speed up;
            the message names the dtypes and devices found).
    """
    _check_linears(model, "fast_decoding")
    why = few_rows.kernel_error()
    if why is not None:
        if not _warned:
            _warned.append(why)
            warnings.warn(
                f"multihead's few-row kernel is not available ({why}); fast_decoding leaves the "
                "model decoding as it did. `multihead doctor` says how to get the kernel.",
                RuntimeWarning,
                stacklevel=2,
            )
        return model
    if _is_llama(model):
        _native(model)
    return _linears(model)


def decoding_path(model: nn.Module) -> str | None:
    """The way ``fast_decoding`` (or an old entry) set ``model`` decoding: ``NATIVE`` ("native
    step"), ``LINEARS`` ("few-row linears"), or None where nothing did (never called, or the
    kernel was missing)."""
    return model.__dict__.get(_PATH)


def decoding_step(model: nn.Module) -> nn.Module:
    """Deprecated: ``fast_decoding(model)`` takes this path for a ``LlamaForCausalLM``.

    Runs ``model``'s decoding steps in one C++ call each, in place (its float32 linear layers
    on the few-row kernel too), as before: a model other than ``LlamaForCausalLM`` is a
    ``TypeError`` and a missing kernel a ``RuntimeError``.
    """
    deprecated("multihead.hf.decoding_step", "multihead.hf.fast_decoding")
    if not _is_llama(model):
        raise TypeError(
            "decoding_step takes a transformers LlamaForCausalLM (Llama, SmolLM2, ...); "
            "multihead.hf.fast_decoding takes any model. Received: a model of type "
            f"{type(model).__name__}"
        )
    why = few_rows.kernel_error()
    if why is not None:
        raise RuntimeError(f"decoding_step needs the few-row kernel, which {why}")
    _check_linears(model, "decoding_step")
    _native(model)
    return _linears(model)


def decoding_linears(model: nn.Module) -> nn.Module:
    """Deprecated: ``fast_decoding(model)`` takes this path for every model but a
    ``LlamaForCausalLM``, for which it runs the faster native step.

    Puts ``model``'s float32 ``nn.Linear`` layers on the few-row kernel, in place, as before
    (a missing kernel: a warning, and the layers keep ``F.linear``).
    """
    deprecated("multihead.hf.decoding_linears", "multihead.hf.fast_decoding")
    _check_linears(model, "decoding_linears")
    reason = few_rows.kernel_error()
    if reason is not None:
        warnings.warn(
            f"multihead's few-row kernel is not available ({reason}); the linear layers keep "
            "running F.linear. `multihead doctor` says how to get the kernel.",
            RuntimeWarning,
            stacklevel=2,
        )
    return _linears(model)


def _check_linears(model: Any, name: str) -> None:
    """``model`` is a module with a float32 ``nn.Linear`` on the CPU (or one already moved)."""
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"{name} takes a torch.nn.Module (a transformers model). "
            f"Received: an object of type {type(model).__name__}"
        )
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if not any(map(_fits, linears)) and not any(type(m) is few_rows.RowsLinear for m in linears):
        found = sorted({f"{m.weight.dtype} on {m.weight.device.type}" for m in linears})
        raise ValueError(
            f"{name} moves float32 nn.Linear layers on the CPU (the few-row kernel reads "
            f"float32 activations); this model has none: {len(linears)} linear layers"
            + (f" ({', '.join(found)})" if found else "")
            + ". Convert it with model.float().cpu() first"
        )


def _fits(m: nn.Linear) -> bool:
    """A plain ``nn.Linear`` with a float32 weight on the CPU."""
    weight = m.weight
    return type(m) is nn.Linear and weight.dtype == torch.float32 and weight.device.type == "cpu"


def _is_llama(model: nn.Module) -> bool:
    inner: Any = getattr(model, "model", None)
    return type(model).__name__ == "LlamaForCausalLM" and type(inner).__name__ == "LlamaModel"


def _linears(model: nn.Module) -> nn.Module:
    """The few-row linears: the float32 ``nn.Linear`` layers on the kernel (a model already
    on the native step keeps that name)."""
    few_rows.few_row_linears(model)
    model.__dict__.setdefault(_PATH, LINEARS)
    return model


def _native(model: nn.Module) -> None:
    """The native step on a LlamaForCausalLM (the kernel known present); the few-row linears
    under it are ``_linears``'s."""
    inner: Any = model.model
    if not inner.__dict__.get(_FLAG):
        original = inner.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            out = None if args else _step(inner, kwargs)
            return original(*args, **kwargs) if out is None else out

        inner.forward = forward
        inner.__dict__[_FLAG] = True
    model.__dict__[_PATH] = NATIVE


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
    return native_step.enabled and not acting.active() and not python_step.global_hooks()


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
    not count (``hooked``)."""

    hooked = staticmethod(hooked)


def _plan(inner: Any) -> native_step.Plan | None:
    """The layers' tensors in decoding_native.h's order, gathered once and kept on the model
    while every module and tensor read is in its place and unhooked; None where some layer
    is not one the step runs."""
    if inner.embed_tokens.weight.dtype != torch.float32:
        return None  # the step takes float32 activations
    kept = inner.__dict__.get("_multihead_plan")
    if kept is not None and kept.valid():
        return kept
    plan = native_step.gather(_Plan(inner.layers), _layer)
    inner.__dict__["_multihead_plan"] = plan
    return plan


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
