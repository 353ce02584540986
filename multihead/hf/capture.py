"""``capture``: the softmax weights of chosen heads of chosen layers of a transformers model.

Inside ``with capture(model, layers=[1], heads=[0, 2]) as cap:`` every forward of ``model``
runs on the ``"multihead"`` attention implementation; the attention function asks
``attention_with_weights(..., heads=[0, 2])`` for exactly those heads of layer 1 and runs every
other call without weights, so nothing else is ever materialized.

A layer is found the way transformers finds the modules whose weights it reports as
``attentions``: the model's ``_can_record_outputs`` (per sub-model of a composite model), in
module order; the attention function recognizes the calling module as one of them or inside
one of them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, cast

from torch import nn

from .. import _validation as V
from ..functional import check_heads
from .recording import Capture, recording
from .registration import register

__all__ = ["Capture", "capture"]


def attention_layers(model: nn.Module) -> list[nn.Module]:
    """The modules whose weights transformers reports as ``attentions``, in layer order: for an
    encoder-decoder model, its encoder's."""
    from transformers import PreTrainedModel

    config = getattr(model, "config", None)
    encoder = getattr(model, "get_encoder", None)
    if getattr(config, "is_encoder_decoder", False) and callable(encoder):
        model = encoder()
    found: list[nn.Module] = []

    def walk(module: nn.Module, name: str, specs: list[Any]) -> None:
        for child_name, child in module.named_children():
            inner = _specs(child) if isinstance(child, PreTrainedModel) else specs
            walk(child, f"{name}.{child_name}", inner)
        if any(_matches(module, name, spec) for spec in specs):
            found.append(module)

    walk(model, "", _specs(model))
    return found


def _specs(model: Any) -> list[Any]:
    """The "attentions" recorders of a transformers model, as OutputRecorder records."""
    from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY, OutputRecorder

    spec = _CAN_RECORD_REGISTRY.get(model).get("attentions")
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


def _matches(module: nn.Module, name: str, spec: Any) -> bool:
    by_class = spec.target_class is not None and isinstance(module, spec.target_class)
    by_name = spec.class_name is not None and name.endswith(spec.class_name)
    if not (by_class or by_name):
        return False
    if spec.layer_name is None:
        return True
    return f".{spec.layer_name.strip('.')}." in name + "."


def _num_heads(model: nn.Module) -> int | None:
    config = getattr(model, "config", None)
    if config is None:
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    return heads if isinstance(heads, int) else None


def _check_layers(layers: object, count: int) -> list[int] | None:
    if layers is None:
        return None
    return V.check_indices(
        "layers", layers, count, kind="layer", every="layer",
        size=f"the model has {count} self-attention layers, counted from 0",
    )  # fmt: skip


@contextlib.contextmanager
def capture(
    model: nn.Module, layers: list[int] | None = None, heads: list[int] | None = None
) -> Iterator[Capture]:
    """Record the softmax weights of chosen heads of chosen layers while ``model`` runs.

    ::

        with multihead.hf.capture(model, layers=[1], heads=[0, 2]) as cap:
            model(**inputs)
        cap.weights[1]  # (B, 2, L, S): heads 0 and 2 of layer 1, in that order

    Only the chosen heads of the chosen layers are computed with weights (through
    ``attention_with_weights(..., heads=...)``); every other attention call runs without
    any, so on a long input two heads of one layer cost about their own size in memory. The
    model runs on the ``"multihead"`` attention implementation inside the block, whatever it
    was loaded with, and gets its own back on leaving it.

    Args:
        model: a transformers model (``PreTrainedModel``). For an encoder-decoder model the
            encoder's self-attention layers are captured; pass ``model.get_decoder()`` for the
            decoder's.
        layers: layer indices counted from 0 as in the model's config (None: every layer).
        heads: query-head indices, recorded in the order given (None: every head).

    Yields:
        A ``Capture`` whose ``weights`` dict fills as the model runs: ``{layer: Tensor
        (B, len(heads), L, S)}``, detached, from the last forward that ran each layer.

    Raises:
        TypeError: ``model`` is not a transformers model.
        ValueError: no self-attention layers found, or ``layers`` / ``heads`` that are not
            lists of distinct indices in range.
    """
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise TypeError(
            "capture takes a transformers model (a PreTrainedModel, e.g. from "
            "AutoModel.from_pretrained). Received: model of type "
            f"{type(model).__name__}"
        )
    found = attention_layers(model)
    if not found:
        raise ValueError(
            f"found no self-attention layers in {type(model).__name__}: capture finds them "
            "through the model's _can_record_outputs['attentions'], which this model does "
            "not declare. Received: a model without recorded attentions"
        )
    cap = Capture(_check_layers(layers, len(found)), None, len(found))
    if heads is not None:
        count = _num_heads(model)
        cap.heads = check_heads(heads, count) if count is not None else list(heads)
    for index, layer in enumerate(found):
        for part in layer.modules():
            cap._owner.setdefault(part, index)
    name = register()
    before = getattr(model.config, "_attn_implementation", None)
    switch = before != name
    if switch:
        model.set_attn_implementation(name)
    try:
        with recording(cap):
            yield cap
    finally:
        if switch and before is not None:
            model.set_attn_implementation(before)
