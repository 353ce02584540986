"""``load_folder``: a model folder opened by transformers on the multihead attention
implementation, with the folder's ``tokenizer.json`` (what the commands that run any
architecture, ``multihead explain --model`` and ``multihead heads``, read of a folder)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .registration import register

__all__ = ["load_folder"]


def load_folder(
    folder: Path, what: str, *, causal_lm: bool = False, supports: str = ""
) -> tuple[Any, Any]:
    """(model in eval mode, ``tokenizers.Tokenizer``) for ``folder``.

    Args:
        folder: a folder transformers loads, with ``tokenizer.json`` beside the weights.
        what: the command, for the messages ("multihead heads").
        causal_lm: load the language-model head too (``AutoModelForCausalLM``), not the bare
            model (``AutoModel``).
        supports: appended to the message when transformers cannot load the folder.

    Raises:
        FileNotFoundError: no ``tokenizer.json`` in the folder (checked before loading).
        ValueError: transformers could not load the folder (its reason named).
    """
    import transformers
    from tokenizers import Tokenizer

    vocabulary = folder / "tokenizer.json"
    if not vocabulary.is_file():
        raise FileNotFoundError(
            f"{what} needs the model's tokenizer.json, which is missing from {folder}. "
            "Received: a folder without tokenizer.json"
        )
    auto = transformers.AutoModelForCausalLM if causal_lm else transformers.AutoModel
    try:
        model = auto.from_pretrained(folder, attn_implementation=register())
    except (ValueError, OSError, KeyError) as err:
        raise ValueError(
            f"transformers could not load a model from {folder} for {what}{supports}. "
            f"Received: {type(err).__name__}: {str(err).splitlines()[0]}"
        ) from err
    return model.eval(), Tokenizer.from_file(str(vocabulary))
