"""Loading transformers models: ``load_with_tokenizer`` gives ``(model, tokenizer)`` from a
transformers folder, a GGUF file or one of the names ``"smollm2"`` and ``"gemma3"``, where
``multihead.sources.resolve`` (which imports no more than the standard library) finds them;
``open_folder`` is the same model with the folder's own ``tokenizer.json``, for the commands
that run any architecture. transformers reads a GGUF file with the ``gguf`` and ``accelerate``
packages (the ``llm`` extra) and dequantizes its weights to float32, once: the result is kept
as a transformers folder in the user's cache (``multihead cache`` lists it). Nothing here
reaches for the network. ``load`` is the deprecated name of ``load_with_tokenizer``; the names
this module re-exports from ``multihead.sources`` keep working.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Any, NamedTuple

from ..models import gguf
from ..sources import (
    GEMMA3,
    GEMMA3_INSTALL,
    LLM_EXTRA,
    NAMES,
    SMOLLM2,
    SMOLLM2_INSTALL,
    Source,
    cache_root,
    converted_folder,
    is_llm_source,
    resolve,
)
from .registration import NAME, register

__all__ = [
    "GEMMA3",
    "GEMMA3_INSTALL",
    "LLM_EXTRA",
    "NAMES",
    "SMOLLM2",
    "SMOLLM2_INSTALL",
    "Loaded",
    "Source",
    "cache_root",
    "converted_folder",
    "is_llm_source",
    "load",
    "load_with_tokenizer",
    "open_folder",
    "resolve",
]


class Loaded(NamedTuple):
    """What ``load_with_tokenizer`` returns: transformers' model and transformers' tokenizer
    (unpacks as ``model, tokenizer = ...``)."""

    model: Any
    tokenizer: Any


def load_with_tokenizer(
    source: str | os.PathLike[str], *, causal_lm: bool = True, attn_implementation: str = NAME
) -> Loaded:
    """A transformers model in eval mode and float32, and transformers' tokenizer for it: the
    pair ``(model, tokenizer)``.

    The model is transformers' own (``AutoModelForCausalLM``, or ``AutoModel`` with
    ``causal_lm=False``: any architecture, without its head), on multihead's attention unless
    ``attn_implementation`` names another ("sdpa", "eager"). A GGUF file is read once by
    transformers (its weights dequantized to float32, its tokenizer rebuilt from the
    metadata: half a minute for SmolLM2, a line on stderr says so) and kept as a transformers
    folder in the user's cache (``converted_folder``); later loads read that folder. The
    tokenizer is transformers' (``AutoTokenizer``; for a folder holding only a
    ``tokenizer.json``, a ``PreTrainedTokenizerFast`` over it): its ``backend_tokenizer`` is
    the ``tokenizers.Tokenizer`` that multihead's own models carry as ``.tokenizer``.
    Example::

        model, tokenizer = multihead.hf.load_with_tokenizer("smollm2")
        chat = [{"role": "user", "content": "What is the capital of France?"}]
        ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt")
        out = model.generate(**ids, max_new_tokens=20, do_sample=False)

    Args:
        source: what ``multihead.sources.resolve`` takes: a transformers folder, a ``.gguf``
            file or one of the names ``"smollm2"``, ``"gemma3"``.
        causal_lm: load the language-model head (True), or the bare model (False; a GGUF
            source is a causal LM either way).
        attn_implementation: the attention transformers runs ("multihead" by default).

    Raises:
        TypeError, ModuleNotFoundError, FileNotFoundError: as ``resolve``.
        ValueError: as ``resolve``, or transformers could not load a model and its
            tokenizer from the source (its reason named).
    """
    where = resolve(source)
    if where.gguf_file is not None:
        where, causal_lm = Source(_converted(where)), True
    model = _model(where, causal_lm, attn_implementation=attn_implementation)
    return Loaded(model.eval(), _tokenizer(where))


def load(source: str | os.PathLike[str], *, attn_implementation: str = NAME) -> tuple[Any, Any]:
    """Deprecated: ``load_with_tokenizer`` (the same pair; ``multihead.load`` is the library's
    loader, which returns one model)."""
    from .._deprecation import deprecated

    deprecated("multihead.hf.load", "multihead.hf.load_with_tokenizer")
    return load_with_tokenizer(source, attn_implementation=attn_implementation)


def open_folder(folder: Path, what: str, *, causal_lm: bool, supports: str = "") -> tuple[Any, Any]:
    """(model in eval mode, the folder's ``tokenizer.json`` as a ``tokenizers.Tokenizer``, as
    it was saved) for the commands that run any architecture on its own tokenizer file
    (``multihead explain --model``, ``multihead heads``); ``what`` names the command in the
    messages, ``supports`` is appended where transformers cannot load the folder.

    Raises:
        FileNotFoundError: no ``tokenizer.json`` in the folder (checked before loading).
        ValueError: transformers could not load the folder (its reason named).
    """
    from tokenizers import Tokenizer

    vocabulary = folder / "tokenizer.json"
    if not vocabulary.is_file():
        raise FileNotFoundError(
            f"{what} needs the model's tokenizer.json, which is missing from {folder}. "
            "Received: a folder without tokenizer.json"
        )
    model = _model(
        Source(folder), causal_lm, attn_implementation=register(), needed=what + supports
    )
    return model.eval(), Tokenizer.from_file(str(vocabulary))


def _model(where: Source, causal_lm: bool = True, *, needed: str = "", **options: Any) -> Any:
    """transformers' model (float32; ``AutoModelForCausalLM`` or ``AutoModel``) from
    ``where``; what it cannot load is a ValueError naming the source and transformers'
    reason (and ``needed``: who asked, what it supports)."""
    import torch
    import transformers

    named = {} if where.gguf_file is None else {"gguf_file": where.gguf_file}
    auto = transformers.AutoModelForCausalLM if causal_lm else transformers.AutoModel
    try:
        with gguf.one_reading() if named else contextlib.nullcontext():
            return auto.from_pretrained(where.folder, dtype=torch.float32, **named, **options)
    except (ValueError, OSError, KeyError) as err:
        kind = "a causal language model" if causal_lm else "a model"
        for_whom = f" for {needed}" if needed else ""
        raise ValueError(
            f"transformers could not load {kind} from {where.path}{for_whom}. "
            f"Received: {type(err).__name__}: {str(err).splitlines()[0]}"
        ) from err


def _tokenizer(where: Source) -> Any:
    """transformers' tokenizer for ``where``: ``AutoTokenizer``, or, for a folder with only a
    ``tokenizer.json`` that ``AutoTokenizer`` cannot place, a ``PreTrainedTokenizerFast``
    over that file."""
    import transformers

    named = {} if where.gguf_file is None else {"gguf_file": where.gguf_file}
    try:
        with gguf.one_reading() if named else contextlib.nullcontext():
            return transformers.AutoTokenizer.from_pretrained(where.folder, **named)
    except (ValueError, OSError, KeyError) as err:
        file = where.folder / "tokenizer.json"
        if not named and file.is_file():
            return transformers.PreTrainedTokenizerFast(tokenizer_file=str(file))
        raise ValueError(
            f"transformers could not load the tokenizer from {where.path}. "
            f"Received: {type(err).__name__}: {str(err).splitlines()[0]}"
        ) from err


def _converted(where: Source) -> Path:
    """The GGUF file as a transformers folder (model in float32, tokenizer), written into the
    user's cache on first use (whole or not at all: ``replace_folder``)."""
    from .._atomic import replace_folder
    from ._transformers import saveable

    folder = converted_folder(where)
    if (folder / "config.json").is_file() and (folder / "tokenizer_config.json").is_file():
        return folder
    print(
        f"loading {where.path}: dequantizing its weights to float32, once (kept in {folder})",
        file=sys.stderr,
    )
    model, tokenizer = _model(where), _tokenizer(where)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with replace_folder(folder) as tmp:
        saveable(model).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return folder
