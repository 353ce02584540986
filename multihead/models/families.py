"""Model families by ``model_type``: ``load(folder)`` opens a folder by what its config.json
says, ``register(model_type, loader)`` adds a family.

The built-in families (``bert``, ``gpt2``, ``llama``) register themselves at the end of their
own files; this module only knows which file to import for which ``model_type``, so neither
``import multihead`` nor ``import multihead.models`` loads a family (or safetensors and
tokenizers) before a folder asks for one.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["load", "register", "register_builtin", "supported"]

Loader = Callable[[Path], Any]

# model_type -> the module whose import registers the family (imported on first use)
_BUILTIN = {
    "bert": "multihead.models.bert",
    "gpt2": "multihead.models.gpt2",
    "llama": "multihead.models.llama",
}
_LOADERS: dict[str, Loader] = {}


def register(model_type: str, loader: Loader) -> None:
    """Open folders whose config.json has ``"model_type": model_type`` with ``loader(folder)``
    (``folder`` is a ``pathlib.Path``); a later call for the same ``model_type`` replaces the
    loader, built-in families included.

    Raises:
        TypeError: ``model_type`` is not a string or ``loader`` is not callable.
        ValueError: ``model_type`` is empty.
    """
    if not isinstance(model_type, str):
        raise TypeError(
            "model_type must be a string, as config.json's model_type field (e.g. 'bert'). "
            f"Received: {type(model_type).__name__} {model_type!r}"
        )
    if not model_type:
        raise ValueError(
            "model_type must be a non-empty string such as 'bert'. Received: model_type=''"
        )
    if not callable(loader):
        raise TypeError(
            "loader must be callable as loader(folder) -> model. "
            f"Received: {type(loader).__name__} {loader!r}"[:300]
        )
    _LOADERS[model_type] = loader


def register_builtin(model_type: str, loader: Loader) -> None:
    """What a built-in family's file calls when imported: a loader registered from outside
    before that import stays in place."""
    _LOADERS.setdefault(model_type, loader)


def supported() -> list[str]:
    """The ``model_type`` values ``load`` opens, built-in and registered."""
    return sorted({*_BUILTIN, *_LOADERS})


def _loader(model_type: str) -> Loader | None:
    if model_type not in _LOADERS and model_type in _BUILTIN:
        importlib.import_module(_BUILTIN[model_type])
    return _LOADERS.get(model_type)


def load(folder: str | Path | None = None, *, weights: str | None = None) -> Any:
    """The model in ``folder``, by its config.json: a folder written by ``multihead.save``
    (``format_version``) loads as ``multihead.io.load`` does; otherwise ``model_type`` picks
    the family (``bert``: a ``models.bert.Pretrained``; ``gpt2``, ``llama``: a decoder with its
    tokenizer, when the folder has one; or a family added with ``register``). None: the
    default BERT model, all-MiniLM-L6-v2 from its package. ``weights`` ("bf16", "int8") is
    handed to the decoder families' loaders (``gpt2.load``, ``llama.load``): weight-only
    formats for their linear layers.

    Raises:
        FileNotFoundError: the folder, its config.json or its weights are missing.
        ValueError: config.json is not a JSON object, has neither ``format_version`` nor
            ``model_type``, or names a ``model_type`` no family opens (the message names it and
            the supported ones); or the family's loader refuses the folder (named);
            ``weights`` given for a model that is not a GPT-2 or Llama decoder, or not None,
            "bf16" or "int8".
    """
    from .. import checkpoint, io
    from . import kinds

    if weights is not None and weights not in _WEIGHT_FORMATS:
        raise ValueError(f"weights must be None, 'bf16' or 'int8'. Received: weights={weights!r}")
    if folder is None:  # the default model, MiniLM, is the BERT family's to find
        _no_weights(weights, "the default model (BERT)")
        return importlib.import_module(_BUILTIN["bert"]).load(None)
    path = Path(folder)
    config = checkpoint.read_config(path) if (path / io.CONFIG).is_file() else {}
    model_type = config.get("model_type")
    if "format_version" in config or not isinstance(model_type, str):
        _no_weights(weights, "a multihead.save folder")
        return io.load(path)  # a multihead.save folder, or io.load names what is missing
    loader = _loader(model_type)
    if loader is None:
        found = kinds.FolderKind(path, model_type)
        raise ValueError(
            f"{path} holds {found.describe()}, which no model family opens; "
            f"multihead.models.load opens model_type {', '.join(map(repr, supported()))} and "
            "multihead.save folders (add a family with multihead.models.register(model_type, "
            f"loader)). Received: {found.received}"
        )
    if weights is None:
        return loader(path)
    _no_weights(weights if model_type not in _DECODERS else None, f"model_type {model_type!r}")
    decoder_loader: Any = loader  # the decoders' loaders also take weights=
    return decoder_loader(path, weights=weights)


_WEIGHT_FORMATS = ("bf16", "int8")
_DECODERS = ("gpt2", "llama")  # the families whose loaders take weights=


def _no_weights(weights: str | None, what: str) -> None:
    if weights is not None:
        raise ValueError(
            f"weights= packs the linear layers of the GPT-2 and Llama decoders; {what} takes "
            f"none. Received: weights={weights!r}"
        )
