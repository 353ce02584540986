"""The kinds of model whose attention reads plans, and how a block finds a model's layers.

Each kind registers a ``Reader`` in its own file: ``MultiHeadAttention``'s (the library's own
models, ``multihead/modules/attention.py``) and the transformers bridge's
(``multihead/hf/reader.py``, on ``import multihead.hf``). A block asks them in turn for the
model's self-attention layers; the first that knows the model answers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from torch import nn

__all__ = ["Reader", "find", "readers", "register"]


@dataclass(frozen=True)
class Reader:
    """A kind of model whose attention reads the plan, as a block sees it.

    Attributes:
        name: what the kind is called in messages ("the library's own models").
        layers: ``(model, what)`` -> the model's self-attention layers in order, one module
            per layer (a call from the module or from a module inside it reads the layer's
            plan); None when the model is not of this kind. ``what`` names the function
            asking, for the error of a model of this kind without layers.
        num_heads: model -> its query heads per layer (None where the model does not say).
        running: model -> the context a block's model runs in (transformers: switched to the
            "multihead" attention implementation and back); none by default.
    """

    name: str
    layers: Callable[[Any, str], list[nn.Module] | None]
    num_heads: Callable[[Any], int | None]
    running: Callable[[Any], AbstractContextManager[object]] = contextlib.nullcontext


_READERS: list[Reader] = []


def register(reader: Reader) -> Reader:
    """Add ``reader`` (idempotent by name: registering a name again replaces it)."""
    _READERS[:] = [r for r in _READERS if r.name != reader.name] + [reader]
    return reader


def readers() -> tuple[Reader, ...]:
    """The registered readers, in the order a block asks them."""
    return tuple(_READERS)


def find(model: object, what: str) -> tuple[Reader, list[nn.Module]]:
    """(the model's reader, its self-attention layers in order), or a clear error.

    Raises:
        TypeError: no reader knows ``model``.
        ValueError: a model of a known kind without self-attention layers (its reader says).
    """
    for reader in _READERS:
        found = reader.layers(model, what)
        if found is not None:
            return reader, found
    raise TypeError(
        f"{what} takes a transformers model (a PreTrainedModel, e.g. from "
        "AutoModel.from_pretrained; import multihead.hf first) or one of the library's own "
        "models (its MultiHeadAttention modules are its layers: multihead.models, "
        "multihead.load, multihead.models.bert.load, multihead.modules). Received: model of "
        f"type {type(model).__name__}"
    )
