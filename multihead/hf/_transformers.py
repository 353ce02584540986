"""Every name of transformers' own that is not its public API, read in this one module.

multihead.hf needs a few things transformers keeps to itself: which factory made a mask
function and what its closure captured, whether the running forward collects attentions,
which modules a model records as ``attentions``, and the implementation a model runs on.
Each function below names what it reads and the transformers version it was read from
(5.23); when transformers renames one, the fix is here, and every reader falls back to
something correct instead of failing: an unreadable mask function is evaluated as
transformers evaluates it, an unreadable collector asks for the weights.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn
from transformers import masking_utils as mu
from transformers.utils import output_capturing

__all__ = [
    "attention_recorders",
    "attn_implementation",
    "collecting_attentions",
    "hooked",
    "read_mask_function",
    "saveable",
]

# The variables each factory's closure captures in transformers 5.23 (masking_utils.py), by
# the kind make_mask reads it as; the reader hands them on under these same names.
_CAPTURED: dict[str, tuple[str, ...]] = {
    "and": ("mask_functions",),
    "or": ("mask_functions",),
    "sliding": ("sliding_window",),
    "sliding_both": ("sliding_window",),
    "chunked": ("chunk_size", "left_padding"),
    "padding": ("padding_mask",),
    "packed": ("packed_sequence_mask",),
    "remap": ("mask_function", "position_ids"),
    "offsets": ("mask_function", "q_offset", "kv_offset"),
}


def _factories() -> dict[str, Callable[[], object]]:
    """One closure of each kind, made by transformers' own factory."""
    ones = torch.ones(1, 1, dtype=torch.bool)
    zeros = torch.zeros(1, 1, dtype=torch.long)
    causal = mu.causal_mask_function
    return {
        "and": lambda: mu.and_masks(causal),
        "or": lambda: mu.or_masks(causal),
        "sliding": lambda: mu.sliding_window_overlay(1),
        "sliding_both": lambda: mu.sliding_window_bidirectional_overlay(1),
        "chunked": lambda: mu.chunked_overlay(1, zeros[0]),
        "padding": lambda: mu.padding_mask_function(ones),
        "packed": lambda: mu.packed_sequence_mask_function(zeros),
        "remap": lambda: mu.remap_positions_for_packed_sequence(causal, zeros),
        "offsets": lambda: mu.add_offsets_to_mask_function(causal, 0, 0),
    }


@functools.cache
def _factory_codes() -> dict[object, str]:
    """The kind of each factory's closure, keyed by the closure's code object (every closure
    a factory returns shares it). A factory transformers no longer has, or whose closure has
    no code, is left out: its mask functions are then evaluated like any other."""
    codes: dict[object, str] = {}
    for kind, make in _factories().items():
        try:
            codes[make().__code__] = kind  # type: ignore[attr-defined]
        except (AttributeError, TypeError):
            continue
    return codes


def read_mask_function(fn: object) -> tuple[str, dict[str, Any]] | None:
    """(kind, captured values) of a mask function made by transformers' ``masking_utils``.

    Reads, as of transformers 5.23: ``causal_mask_function`` and
    ``bidirectional_mask_function`` by identity (kinds "causal", "bidirectional", nothing
    captured); the closures of ``and_masks``, ``or_masks``, ``sliding_window_overlay``,
    ``sliding_window_bidirectional_overlay``, ``chunked_overlay``, ``padding_mask_function``,
    ``packed_sequence_mask_function``, ``remap_positions_for_packed_sequence`` and
    ``add_offsets_to_mask_function`` by their code object, and their captured variables
    (``__closure__`` over ``co_freevars``) under the names in ``_CAPTURED``.

    Returns None for any other function and for a factory's closure that does not hold every
    variable under the name expected (one transformers renamed): the caller then evaluates the
    function as transformers does, never raises.
    """
    if fn is mu.causal_mask_function:
        return "causal", {}
    if fn is mu.bidirectional_mask_function:
        return "bidirectional", {}
    kind = _factory_codes().get(getattr(fn, "__code__", None))
    if kind is None:
        return None
    code = cast("Any", fn).__code__
    cells: dict[str, Any] = {}
    for name, cell in zip(code.co_freevars, cast("Any", fn).__closure__ or ()):
        try:
            cells[name] = cell.cell_contents
        except ValueError:  # a cell not yet filled
            continue
    if any(name not in cells for name in _CAPTURED[kind]):
        return None
    return kind, {name: cells[name] for name in _CAPTURED[kind]}


def collecting_attentions() -> bool:
    """Whether the running forward collects attention weights (``output_attentions`` in the
    model's call or config): reads ``transformers.utils.output_capturing._active_collector``
    (5.23), the context variable ``capture_outputs`` sets to the names it collects.

    Where that name is gone the answer is True: the weights are then computed on every call,
    slower but never missing from what transformers collects.
    """
    collector = getattr(output_capturing, "_active_collector", None)
    if collector is None:
        return True
    collected = collector.get()
    return bool(collected) and any("attentions" in key for key in collected)


def attention_recorders(model: nn.Module) -> list[Any]:
    """The ``attentions`` recorders of a transformers model as ``OutputRecorder`` records:
    reads ``transformers.utils.output_capturing._CAN_RECORD_REGISTRY`` (5.23), which holds
    each model class's ``_can_record_outputs``; where the registry is gone, the class
    attribute ``_can_record_outputs`` itself. A name given as a string (a class-name suffix)
    becomes a recorder by class name, a class one by class, both at output index 1."""
    from transformers.utils.output_capturing import OutputRecorder

    registry = getattr(output_capturing, "_CAN_RECORD_REGISTRY", None)
    flags = registry.get(model) if registry is not None else None
    if not isinstance(flags, dict):
        flags = getattr(type(model), "_can_record_outputs", None) or {}
    spec = flags.get("attentions")
    specs = spec if isinstance(spec, list) else ([] if spec is None else [spec])
    return [
        s
        if isinstance(s, OutputRecorder)
        else OutputRecorder(
            target_class=cast("type[nn.Module]", None if isinstance(s, str) else s),
            index=1,
            class_name=s if isinstance(s, str) else None,
        )
        for s in specs
    ]


def attn_implementation(model: nn.Module) -> str | None:
    """The attention implementation ``model`` runs on: reads its config's
    ``_attn_implementation`` (5.23; ``set_attn_implementation`` is the public writer, with no
    public reader). None where the config does not say."""
    config = getattr(model, "config", None)
    found = getattr(config, "_attn_implementation", None)
    return found if isinstance(found, str) else None


def saveable(model: Any) -> Any:
    """``model`` as ``save_pretrained`` writes it in float32: a model read from a GGUF file
    carries the GGUF quantizer (``hf_quantizer``) and its ``quantization_config``, for which
    ``save_pretrained`` refuses to write (5.23), although its weights are already dequantized
    float32 tensors. Both are dropped, so the folder reloads as a plain float32 model."""
    model.hf_quantizer = None
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    return model


def hooked(m: nn.Module) -> bool:
    """Whether module ``m`` has a forward hook besides transformers' output-capturing hooks
    (``output_capturing``'s, installed for good by a model's first call that collects
    outputs, and recording only inside that call's collecting context)."""
    hooks = [*m._forward_hooks.values(), *m._forward_pre_hooks.values()]
    return any(getattr(h, "__module__", None) != output_capturing.__name__ for h in hooks)
