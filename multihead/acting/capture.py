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
from collections.abc import Iterator, Sequence
from typing import Any, cast

from torch import nn

from .. import _validation as V
from ..functional import check_heads
from ..stats import check_stats
from ._transformers import attention_recorders, attn_implementation
from .recording import Block, Capture, activate
from .registration import register

__all__ = ["Capture", "capture", "model_layers", "open_block"]


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


def check_layers(layers: object, count: int) -> list[int] | None:
    if layers is None:
        return None
    return V.check_indices(
        "layers", layers, count, kind="layer", every="layer",
        size=f"the model has {count} self-attention layers, counted from 0",
    )  # fmt: skip


def model_layers(model: object, what: str) -> list[nn.Module]:
    """The self-attention layers of a transformers model, or a clear error."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise TypeError(
            f"{what} takes a transformers model (a PreTrainedModel, e.g. from "
            "AutoModel.from_pretrained). Received: model of type "
            f"{type(model).__name__}"
        )
    found = attention_layers(model)
    if not found:
        raise ValueError(
            f"found no self-attention layers in {type(model).__name__}: {what} finds them "
            "through the model's _can_record_outputs['attentions'], which this model does "
            "not declare. Received: a model without recorded attentions"
        )
    return found


@contextlib.contextmanager
def open_block(model: nn.Module, block: Block, found: list[nn.Module]) -> Iterator[None]:
    """Run ``model`` on the multihead implementation with ``block`` active; on leaving, the
    block ends and the model gets its own implementation back."""
    for index, layer in enumerate(found):
        for part in layer.modules():
            block._owner.setdefault(part, index)
    block._model = model
    name = register()
    before = attn_implementation(model)
    switch = before != name
    if switch:
        cast("Any", model).set_attn_implementation(name)
    try:
        with activate(block):
            yield
    finally:
        if switch and before is not None:
            cast("Any", model).set_attn_implementation(before)


@contextlib.contextmanager
def capture(
    model: nn.Module,
    layers: list[int] | None = None,
    heads: list[int] | None = None,
    *,
    stats: Sequence[str] = (),
    window: int | None = None,
    accumulate: bool = False,
) -> Iterator[Capture]:
    """Record the softmax weights, or statistics of them, for chosen heads of chosen layers
    while ``model`` runs.

    ::

        with multihead.hf.capture(model, layers=[1], heads=[0, 2]) as cap:
            model(**inputs)
        cap.weights[1]  # (B, 2, L, S): heads 0 and 2 of layer 1, in that order

        with multihead.hf.capture(model, stats=["key_mass", "entropy"]) as cap:
            model(**inputs)
        cap.stats[0]["key_mass"]  # (B, H, S): layer 0's weights summed over the queries

    Only the chosen heads of the chosen layers are computed with weights (through
    ``attention_with_weights(..., heads=...)``); every other attention call runs without
    any, so on a long input two heads of one layer cost about their own size in memory.
    Statistics come from ``multihead.attention_stats``: the weights of one slice of query
    rows at a time, reduced at once, never (B, h, L, S). The model runs on the
    ``"multihead"`` attention implementation inside the block, whatever it was loaded with,
    and gets its own back on leaving it. Inside ``generate()`` each call of a layer (the
    prompt, then one row per new token over the KV cache) replaces what the last one kept,
    except key statistics with ``accumulate=True``.

    Args:
        model: a transformers model (``PreTrainedModel``). For an encoder-decoder model the
            encoder's self-attention layers are captured; pass ``model.get_decoder()`` for the
            decoder's.
        layers: layer indices counted from 0 as in the model's config (None: every layer).
        heads: query-head indices, recorded in the order given (None: every head).
        stats: statistics to record instead of the weights, from ``"key_mass"`` (B, h, S),
            ``"window_mass"`` (B, h, S), ``"entropy"`` (B, h, L), ``"head_mean"`` (B, L, S);
            with any, ``cap.weights`` stays empty.
        window: the last query rows ``"window_mass"`` sums (required with it).
        accumulate: sum ``key_mass`` and ``window_mass`` over successive calls of a layer
            inside the block, per key position (H2O's accumulated attention over a growing
            KV cache; earlier calls are zero-extended).

    Yields:
        A ``Capture`` whose ``weights`` (or ``stats``) fill as the model runs: ``{layer:
        Tensor (B, len(heads), L, S)}``, detached, from the last forward that ran each layer.

    Raises:
        TypeError: ``model`` is not a transformers model.
        ValueError: no self-attention layers found, ``layers`` / ``heads`` that are not
            lists of distinct indices in range, an unknown or repeated statistic, ``window``
            missing for ``window_mass`` or below 1.
    """
    found = model_layers(model, "capture")
    names = check_stats(stats, window)
    accumulate = V.check_bool("accumulate", accumulate)
    cap = Capture(check_layers(layers, len(found)), len(found))
    cap.stat_names, cap.window, cap.accumulate = names, window, accumulate
    if heads is not None:
        count = num_heads(model)
        cap.heads = check_heads(heads, count) if count is not None else list(heads)
    with open_block(model, cap, found):
        yield cap
