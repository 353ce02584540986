"""Model families by ``model_type``: a ``Family`` record says everything the library needs to
know about one (its classes, loader, weight names, what it can do), ``register(family)`` adds
it, and ``load(folder)`` opens a folder by what its config.json says.

A built-in family lives in ``multihead/models/<model_type>.py`` and registers itself at the end
of that file, which is imported when a folder first names its ``model_type``: neither ``import
multihead`` nor ``import multihead.models`` loads a family (or safetensors and tokenizers)
before a folder asks for one. ``all_families()`` imports every built-in one, for the commands that
list what they take.
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "Family",
    "all_families",
    "family",
    "load",
    "register",
    "register_builtin",
    "supported",
]


@dataclass(frozen=True)
class Family:
    """One model family, registered once with ``multihead.models.register``.

    Attributes:
        model_type: the ``model_type`` of the config.json files it opens ("gpt2").
        description: what it is, in words, for messages ("a GPT-2 decoder").
        model: its model class; ``multihead.save`` folders of that class are this family's.
        load: ``load(folder, **kwargs) -> model``, what ``models.load`` calls (a causal
            family's loader also takes ``weights=``).
        config: its config dataclass, built with ``config.from_dict(dict)``; None when the
            family has none of its own.
        causal: a decoder language model (a ``CausalLM``): it generates text, explain shows
            causal heads, export writes the decoder graph with past keys and values, and
            ``weights="bf16"``/``"int8"`` pack its linear layers. Otherwise an encoder whose
            model embeds sentences (``multihead serve`` and ``embed`` take those).
        transformers: the transformers class it mirrors ("GPT2LMHeadModel"), written into the
            ``architectures`` of a folder it saves.
        names: ``names(config, tied)`` -> {our state-dict key: the checkpoint's name, or
            (name, convert) where the checkpoint stores it differently}.
        prefix: what the checkpoint's names begin with ("transformer.").
        unused: name endings of checkpoint tensors that hold no weights (old buffers).
        sized: ``sized(vocab_size=, context=, width=, layers=, heads=, kv_heads=, **token_ids)``
            -> a config for a fresh model of those sizes (``multihead train lm --arch``).
    """

    model_type: str
    description: str
    model: type
    load: Callable[..., Any]
    config: Any = None
    causal: bool = False
    transformers: str | None = None
    names: Callable[[Any, bool], dict[str, Any]] | None = None
    prefix: str = ""
    unused: tuple[str, ...] = ()
    sized: Callable[..., Any] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model_type, str) or not self.model_type:
            raise ValueError(
                "model_type must be a non-empty string, as config.json's model_type field "
                f"(e.g. 'bert'). Received: model_type={self.model_type!r}"
            )
        if not callable(self.load):
            raise TypeError(
                "load must be callable as load(folder) -> model. "
                f"Received: {type(self.load).__name__} {self.load!r}"[:300]
            )

    @property
    def saved_class(self) -> str:
        """The name ``multihead.save`` records for this family's model class."""
        return f"{self.model.__module__}.{self.model.__qualname__}"


_FAMILIES: dict[str, Family] = {}


def register(family: Family) -> None:
    """Open folders whose config.json has ``"model_type": family.model_type`` with this
    family; a later registration of the same ``model_type`` replaces the family, built-in
    families included.

    Raises:
        TypeError: ``family`` is not a ``Family``.
    """
    if not isinstance(family, Family):
        raise TypeError(
            "register takes a multihead.models.Family record (model_type, description, model, "
            f"load, ...). Received: {type(family).__name__} {family!r}"[:300]
        )
    _FAMILIES[family.model_type] = family


def register_builtin(family: Family) -> None:
    """What a built-in family's file calls when imported: a family registered from outside
    under the same ``model_type`` before that import stays in place."""
    _FAMILIES.setdefault(family.model_type, family)


def family(model_type: str) -> Family | None:
    """The family that opens ``model_type`` (importing its built-in file when there is one),
    or None."""
    name = f"{__package__}.{model_type}"
    builtin = model_type.isidentifier() and importlib.util.find_spec(name) is not None
    if model_type not in _FAMILIES and builtin:
        importlib.import_module(name)
    return _FAMILIES.get(model_type)


def all_families() -> list[Family]:
    """Every family, built-in (all imported now) and registered, by ``model_type``."""
    package = importlib.import_module(__package__)
    for module in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{__package__}.{module.name}")
    return [_FAMILIES[name] for name in sorted(_FAMILIES)]


def describe(model_type: str) -> str:
    """A folder's model in words, with the config.json field that names it: the family's own
    description, or the bare ``model_type`` when no family opens it."""
    known = family(model_type)
    name = f"a {model_type!r} model" if known is None else known.description
    return f"{name} (config.json model_type {model_type!r})"


def supported() -> list[str]:
    """The ``model_type`` values ``load`` opens, built-in and registered."""
    return [f.model_type for f in all_families()]


def load(folder: str | Path | None = None, *, weights: str | None = None) -> Any:
    """The model in ``folder``, by its config.json (or a ``.gguf`` file, or one of the names
    ``"smollm2"``, ``"gemma3"`` that ``multihead.sources.locate`` finds, by the file's
    ``general.architecture``: llama only, so ``"smollm2"`` and not ``"gemma3"``): a folder
    written by ``multihead.save`` (``format_version``) loads as ``multihead.io.load`` does;
    otherwise ``model_type`` picks
    the family (``bert``: a ``models.bert.Pretrained``; ``gpt2``, ``llama``: a decoder with its
    tokenizer, when the folder has one; or a family added with ``register``). None: the
    default BERT model, all-MiniLM-L6-v2 from its package. ``weights`` ("bf16", "int8", "w8a16") is
    handed to a causal family's loader: weight-only formats for its linear layers.

    Raises:
        FileNotFoundError: the folder, its config.json or its weights are missing.
        ModuleNotFoundError: a name whose package is not installed (the command named).
        ValueError: config.json is not a JSON object, has neither ``format_version`` nor
            ``model_type``, or names a ``model_type`` no family opens (the message names it and
            the supported ones); or the family's loader refuses the folder (named);
            ``weights`` given for a model that is not a causal decoder, or not None, "bf16",
            "int8" or "w8a16".
    """
    from .. import folder_reading, io, sources
    from ..modules.quant import WEIGHT_FORMATS
    from . import gguf

    if weights is not None and weights not in WEIGHT_FORMATS:
        raise ValueError(
            f"weights must be None, 'bf16', 'int8' or 'w8a16'. Received: weights={weights!r}"
        )
    if folder is None:  # the default model, MiniLM, is the BERT family's to find
        _no_weights(weights, "the default model (BERT)")
        return importlib.import_module(f"{__package__}.bert").load(None)
    if sources.is_llm_source(folder):  # a name, or a .gguf path: found as every loader finds it
        folder = sources.locate(folder).path
    path = Path(folder)
    if gguf.is_gguf(path):  # a GGUF file names its family in its metadata
        config, field = {"model_type": gguf.architecture(path)}, "general.architecture"
    else:
        config = folder_reading.read_config(path) if (path / io.CONFIG).is_file() else {}
        field = "model_type"
    model_type = config.get("model_type")
    if "format_version" in config or not isinstance(model_type, str):
        _no_weights(weights, "a multihead.save folder")
        return io.load(path)  # a multihead.save folder, or io.load names what is missing
    found = family(model_type)
    if found is None:
        raise ValueError(
            f"{path} holds {describe(model_type)}, which no model family opens; "
            f"multihead.models.load opens model_type {', '.join(map(repr, supported()))} and "
            "multihead.save folders (add a family with multihead.models.register(Family(...)))"
            f". Received: model_type={model_type!r}"
        )
    if weights is None:
        return found.load(path)
    _no_weights(None if found.causal else weights, f"{field} {model_type!r}")
    return found.load(path, weights=weights)


def _no_weights(weights: str | None, what: str) -> None:
    if weights is not None:
        raise ValueError(
            f"weights= packs the linear layers of causal decoders (GPT-2, Llama); {what} takes "
            f"none. Received: weights={weights!r}"
        )
