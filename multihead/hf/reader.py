"""How blocks (``multihead.acting``: ``capture``, ``ablate``, ``knockout``, ``patch``,
``compress``) find a transformers model's layers, and the model they run: the reader of
transformers models, registered on ``import multihead.hf``.

A layer is found the way transformers finds the modules whose weights it reports as
``attentions``: the model's ``_can_record_outputs`` (per sub-model of a composite model), in
module order; the attention function recognizes the calling module as one of them or inside
one of them. Inside a block the model runs on the ``"multihead"`` attention implementation
(``attention.py`` reads the plan), and gets its own back on leaving it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, cast

from torch import nn

from .. import acting
from ._transformers import attention_recorders, attn_implementation
from .registration import register

__all__ = ["READER", "attention_layers", "model_layers", "num_heads", "running"]


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
            inner = attention_recorders(child) if isinstance(child, PreTrainedModel) else specs
            walk(child, f"{name}.{child_name}", inner)
        if any(_matches(module, name, spec) for spec in specs):
            found.append(module)

    walk(model, "", attention_recorders(model))
    return found


def _matches(module: nn.Module, name: str, spec: Any) -> bool:
    by_class = spec.target_class is not None and isinstance(module, spec.target_class)
    by_name = spec.class_name is not None and name.endswith(spec.class_name)
    if not (by_class or by_name):
        return False
    if spec.layer_name is None:
        return True
    return f".{spec.layer_name.strip('.')}." in name + "."


def num_heads(model: nn.Module) -> int | None:
    """The model's query heads per layer (None where its config does not say)."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    return heads if isinstance(heads, int) else None


def model_layers(model: nn.Module, what: str) -> list[nn.Module] | None:
    """The self-attention layers of a transformers model (None: not a transformers model),
    or a clear error."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        return None
    found = attention_layers(model)
    if not found:
        raise ValueError(
            f"found no self-attention layers in {type(model).__name__}: {what} finds them "
            "through the model's _can_record_outputs['attentions'], which this model does "
            "not declare. Received: a model without recorded attentions"
        )
    return found


@contextlib.contextmanager
def running(model: nn.Module) -> Iterator[None]:
    """``model`` on the multihead implementation inside the block, its own after it."""
    name = register()
    before = attn_implementation(model)
    switch = before != name
    if switch:
        cast("Any", model).set_attn_implementation(name)
    try:
        yield
    finally:
        if switch and before is not None:
            cast("Any", model).set_attn_implementation(before)


READER = acting.register(acting.Reader("transformers models", model_layers, num_heads, running))
