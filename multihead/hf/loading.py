"""``load``: a causal language model and its tokenizer from a transformers folder, a GGUF file
or one of the names ``"smollm2"`` and ``"gemma3"``, where ``multihead.sources.resolve`` (which
imports no more than the standard library) finds them. transformers reads a GGUF file with the
``gguf`` and ``accelerate`` packages (the ``llm`` extra) and dequantizes its weights to float32,
once: the result is kept as a transformers folder in the user's cache (``multihead cache``
lists it). Nothing here reaches for the network. The names this module re-exports from
``multihead.sources`` keep working.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Any

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
from .registration import NAME

__all__ = [
    "GEMMA3",
    "GEMMA3_INSTALL",
    "LLM_EXTRA",
    "NAMES",
    "SMOLLM2",
    "SMOLLM2_INSTALL",
    "Source",
    "cache_root",
    "converted_folder",
    "is_llm_source",
    "load",
    "resolve",
]


def load(source: str | os.PathLike[str], *, attn_implementation: str = NAME) -> tuple[Any, Any]:
    """A causal language model in eval mode and float32, and its transformers tokenizer.

    The model is transformers' own (``AutoModelForCausalLM``), on multihead's attention unless
    ``attn_implementation`` names another ("sdpa", "eager"). A GGUF file is read once by
    transformers (its weights dequantized to float32, its tokenizer rebuilt from the
    metadata: half a minute for SmolLM2, a line on stderr says so) and kept as a transformers
    folder in the user's cache (``converted_folder``); later loads read that folder. The
    tokenizer is transformers' (``AutoTokenizer``; a command that takes a
    ``tokenizers.Tokenizer`` takes its ``backend_tokenizer``). Example::

        model, tokenizer = multihead.hf.load("smollm2")
        chat = [{"role": "user", "content": "What is the capital of France?"}]
        ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt")
        out = model.generate(**ids, max_new_tokens=20, do_sample=False)

    Args:
        source: what ``resolve`` takes: a transformers folder, a ``.gguf`` file or
            one of the names ``"smollm2"``, ``"gemma3"``.
        attn_implementation: the attention transformers runs ("multihead" by default).

    Raises:
        TypeError, ModuleNotFoundError, FileNotFoundError: as ``resolve``.
        ValueError: as ``resolve``, or transformers could not load a causal LM and its
            tokenizer from the source (its reason named).
    """
    where = resolve(source)
    if where.gguf_file is not None:
        where = Source(_converted(where))
    model, tokenizer = _read(where, attn_implementation=attn_implementation)
    return model.eval(), tokenizer


def _read(where: Source, **options: Any) -> tuple[Any, Any]:
    """transformers' causal LM (float32) and tokenizer from ``where``; what it cannot load is
    a ValueError naming the source and transformers' reason."""
    import torch
    import transformers

    named = {} if where.gguf_file is None else {"gguf_file": where.gguf_file}
    try:
        with gguf.one_reading() if named else contextlib.nullcontext():
            model = transformers.AutoModelForCausalLM.from_pretrained(
                where.folder, dtype=torch.float32, **named, **options
            )
            tokenizer = transformers.AutoTokenizer.from_pretrained(where.folder, **named)
    except (ValueError, OSError, KeyError) as err:
        raise ValueError(
            f"transformers could not load a causal language model and its tokenizer from "
            f"{where.path}. Received: {type(err).__name__}: {str(err).splitlines()[0]}"
        ) from err
    return model, tokenizer


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
    model, tokenizer = _read(where)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with replace_folder(folder) as tmp:
        saveable(model).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return folder
