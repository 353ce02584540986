"""Writing a decoder family's model (GPT-2, Llama) as a transformers-format folder:
``config.json`` with ``model_type``, ``model.safetensors`` under the checkpoint names and, when
the model has one, ``tokenizer.json`` with a ``tokenizer_config.json`` for
``PreTrainedTokenizerFast``.

The folder opens with ``multihead.models.load``, the family's ``load`` and transformers'
``AutoModelForCausalLM``. The names come from the family's own table (``Family.names``) run
backwards, and every written tensor is read back through the loader's
conversion and compared with the model's before the file is written, so a writer that
disagreed with the loader could not write a folder. Needs the ``pretrained`` extra.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .._extras import require
from .causal_lm import CausalLM
from .families import Family, all_families

__all__ = ["save_pretrained"]


def _family(model: CausalLM) -> Family:
    """The decoder family of ``model`` that names its tensors in transformers' format."""
    writable = [f for f in all_families() if f.causal and f.names is not None and f.transformers]
    for family in writable:
        if isinstance(model, family.model):
            return family
    raise TypeError(
        "save_pretrained writes the models of the decoder families ("
        + ", ".join(f.saved_class for f in writable)
        + f"). Received: {type(model).__qualname__}"
    )


def _stored(own: dict[str, Tensor], names: dict[str, Any]) -> dict[str, Tensor]:
    """The checkpoint's tensors from our state dict: ``names`` maps our key to a checkpoint
    name, or to (name, convert) where the checkpoint stores it differently. GPT-2's converters
    are the two kinds the loader uses: one key per name read transposed, or several keys
    (query, key, value in that order) cut from one fused (in, out) matrix or bias."""
    groups: dict[str, list[tuple[str, Callable[[Tensor], Tensor] | None]]] = {}
    for mine, source in names.items():
        name, convert = source if isinstance(source, tuple) else (source, None)
        groups.setdefault(name, []).append((mine, convert))
    out = {}
    for name, members in groups.items():
        tensors = [own[mine].detach() for mine, _ in members]
        if members[0][1] is None:  # stored as is (a tied output layer names the embeddings)
            out[name] = tensors[0]
        elif len(members) == 1:
            out[name] = tensors[0].T if tensors[0].dim() == 2 else tensors[0]
        else:
            out[name] = torch.cat(tensors, dim=0).T if tensors[0].dim() == 2 else torch.cat(tensors)
        out[name] = out[name].contiguous()
    for mine, source in names.items():  # the loader's conversion must give our tensors back
        name, convert = source if isinstance(source, tuple) else (source, None)
        back = out[name] if convert is None else convert(out[name])
        if back.shape != own[mine].shape or not torch.equal(back, own[mine].detach()):
            raise AssertionError(f"writing {mine} as {name} does not read back")
    return out


def _config(model: CausalLM, model_type: str, architecture: str) -> dict[str, Any]:
    fields = {k: v for k, v in asdict(model.config).items() if v is not None}
    dtype = str(model.lm_head.weight.dtype).removeprefix("torch.")
    return {"model_type": model_type, "architectures": [architecture], **fields, "dtype": dtype}


def _tokenizer_config(model: CausalLM) -> dict[str, Any]:
    """What ``PreTrainedTokenizerFast.from_pretrained`` needs beside tokenizer.json: the class
    and the end-of-text token (also the beginning and padding one)."""
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model.max_positions,
        "clean_up_tokenization_spaces": False,
    }
    if model.eos_token_ids:
        eos = model.tokenizer.id_to_token(model.eos_token_ids[0])
        config.update(bos_token=eos, eos_token=eos, pad_token=eos)
    return config


def save_pretrained(model: CausalLM, folder: str | Path) -> Path:
    """Write ``model`` (a GPT-2 or Llama ``CausalLM``) into ``folder`` in transformers' format.

    Writes config.json (``model_type``, ``architectures`` and the config's fields),
    model.safetensors (fp32 or whatever dtype the model holds; a tied output layer is not
    stored twice) and, when ``model.tokenizer`` is set, tokenizer.json and
    tokenizer_config.json. ``folder`` is created when missing; files of the same names are
    replaced.

    Raises:
        TypeError: ``model`` is not the model of a decoder family (GPT-2, Llama, or one
            registered with its weight names and transformers class).
    """
    save_file = require("safetensors.torch", "pretrained", "writing model.safetensors").save_file
    family = _family(model)
    tied = bool(model.config.tie_word_embeddings)
    stored = _stored(model.state_dict(), family.names(model.config, tied))
    if tied:  # the loader reads the output layer from the embeddings
        stored.pop("lm_head.weight", None)
    tensors = {k if k == "lm_head.weight" else family.prefix + k: v for k, v in stored.items()}
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = _config(model, family.model_type, family.transformers)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if model.tokenizer is not None:
        model.tokenizer.save(str(folder / "tokenizer.json"))
        text = json.dumps(_tokenizer_config(model), indent=2) + "\n"
        (folder / "tokenizer_config.json").write_text(text)
    return folder
