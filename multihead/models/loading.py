"""Opening and saving the decoder families' folders: the loading sequence GPT-2 and Llama
share (``load_decoder``), the checks of their token ids and weight formats, and
``register_decoder``, which makes a family saveable by ``multihead.save`` and openable by
``multihead.models.load``.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ..modules import quant
from . import gguf
from .causal_lm import CausalLM, decode_layout
from .families import Family, register_builtin

__all__ = ["check_token_ids", "check_weights", "load_decoder", "register_decoder"]


def load_decoder(
    family: Family,
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    weights: str | None = None,
) -> Any:
    """Load a folder of the decoder ``family`` (``config.json``, the weights: single or sharded
    safetensors, or ``pytorch_model.bin``, and ``tokenizer.json`` when present), as written by
    transformers' ``save_pretrained``, or a GGUF file (``gguf.read``: the config from its
    metadata, its tensors dequantized to float32, its tokenizer): what ``gpt2.load`` and
    ``llama.load`` run.

    config.json and the tokenizer are read and checked first; then the config against the
    weights' header (names, shapes, dtypes, ``family.prefix`` stripped) on a model built on the
    meta device, so a wrong config allocates nothing; then the model is built and the weights
    assigned by ``family.names`` (never a partial load: ``family.unused`` and a tied output
    layer saved anyway are the only tensors left over).

    Args:
        family: the decoder family (``model``, ``config``, ``names``, ``prefix``, ``unused``).
        path: the folder, or a ``.gguf`` file of an architecture in ``gguf.ARCHITECTURES``.
        dtype: parameter dtype (checkpoints stored in bf16 are converted).
        weights: None (the linear layers in ``dtype``), or a weight-only format for the
            linear layers with float32 activations: "bf16" (half the bytes), "int8" (a
            quarter; one float32 scale per output channel) or "w8a16" (int8's bytes, each
            product's activations rounded to int16 per row so the kernel sums integers:
            faster where the CPU has AVX512-VNNI, ``modules/quant.py``). Decoding reads every
            weight once per token, so fewer bytes decode faster; the cost in quality is measured by
            ``multihead.bench.decode.quality``. Needs ``dtype=torch.float32``.

    Returns:
        The model in eval mode, in the decoding layout (float32 linear layers become
        ``RowsLinear``, or ``PackedLinear`` with ``weights``: ``modules/few_rows.py``,
        ``modules/quant.py``), with
        ``.tokenizer`` (or None) and ``.path`` (the folder or the GGUF file).

    Raises:
        FileNotFoundError: the folder, config.json or the weights are missing.
        ValueError: ``weights`` other than None, "bf16", "int8" or "w8a16" (or with a dtype other
            than float32), a config value the family does not implement (the field is named),
            an empty or corrupt file (the file is named), or weights that do not fit the config
            (missing, misshapen or left-over tensors: never a partial load); for a GGUF
            file, also an architecture other than llama or a tensor type ``gguf.read`` does
            not read.
    """
    from .. import folder_reading

    check_weights(weights, dtype)
    if gguf.is_gguf(path):
        folder, source = Path(path), Path(path).name
        raw, stored = gguf.read(folder)
        config = family.config.from_dict(raw, source=source)
        tokenizer = gguf.tokenizer(folder)
    else:
        folder, source = folder_reading.model_folder(path), "config.json"
        config = family.config.from_dict(folder_reading.read_config(folder))
        tokenizer = folder_reading.read_tokenizer(folder, required=False)
        stored = folder_reading.weights(folder)
    stored = stored.renamed(lambda k: k.removeprefix(family.prefix))
    tied = config.tie_word_embeddings

    def unused(name: str) -> bool:  # a tied output layer saved anyway is the embeddings again
        return name.endswith(family.unused) or (tied and name == "lm_head.weight")

    skeleton = folder_reading.build_on_meta(lambda: family.model(config), stored, source=source)
    names_of = family.names(config, tied)  # after the meta build, which stops absurd layer counts
    if skeleton is not None:
        own = skeleton.state_dict()
        folder_reading.match(own, stored.header, names_of, weights=stored, unused=unused)
        folder_reading.check_unstored(skeleton, stored, source=source)
    model = family.model(config)
    folder_reading.assign(model, stored.read(), names_of, weights=stored, unused=unused)
    model.to(dtype).eval()
    if dtype == torch.float32:
        quant.prepare_linears(model, weights)
    decode_layout(model)
    model.tokenizer, model.path = tokenizer, folder
    return model


def check_token_ids(config: Any, source: str = "config.json") -> None:
    """``bos_token_id``, ``eos_token_id`` (an id or a list) and ``pad_token_id`` of a decoder
    config must be ids of its vocabulary: an id past ``vocab_size`` can never be generated
    (so it never stops a row) and would pad the output with a token the model cannot embed.

    Raises:
        ValueError: naming the field, its value and ``vocab_size``.
    """
    v = config.vocab_size
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(config, name)
        ids = [] if value is None else [value] if isinstance(value, int) else list(value)
        bad = [i for i in ids if not 0 <= i < v]
        if bad:
            raise ValueError(
                f"{source}: {name} must be a token id in [0, vocab_size={v}) (set it to an id "
                f"of the vocabulary, or to null). Received: {name}={value!r}"
            )


def check_weights(weights: str | None, dtype: torch.dtype) -> None:
    """Refuse a ``weights=`` value that is not None, "bf16", "int8" or "w8a16", or one combined
    with a ``dtype`` other than float32 (packed weights take float32 activations)."""
    if weights is not None and weights not in quant.WEIGHT_FORMATS:
        raise ValueError(
            "weights must be None (the weights in dtype), 'bf16', 'int8' or 'w8a16' (weight-only "
            "formats for the linear layers, float32 activations). Received: "
            f"weights={weights!r}"
        )
    if weights is not None and dtype != torch.float32:
        raise ValueError(
            f"weights={weights!r} packs the linear layers for float32 activations; pass "
            f"dtype=torch.float32 (the default) with it. Received: dtype={dtype}"
        )


def _save_tokenizer(model: CausalLM, folder: Path) -> None:
    if model.tokenizer is not None:
        model.tokenizer.save(str(folder / "tokenizer.json"))


def _restore_tokenizer(model: CausalLM, folder: Path) -> None:
    if (folder / "tokenizer.json").is_file():
        from .. import folder_reading

        model.tokenizer = folder_reading.read_tokenizer(folder, required=False)
    model.path = folder


def register_decoder(family: Family) -> None:
    """Register a decoder family: openable by ``multihead.models.load`` through its
    ``model_type`` (a family registered from outside under the same name stays), and
    saveable by ``multihead.save`` (its config as data plus the weights under this library's
    names; the tokenizer, when the model has one, beside them as tokenizer.json). A model
    loaded from a ``multihead.save`` folder keeps the decoding layout of ``decode_layout``."""
    from .. import io

    def build(args: dict[str, Any]) -> CausalLM:
        config = family.config.from_dict(args["config"], source="config.json model.args")
        model = family.model(config)
        quant.prepare_linears(model, None)
        decode_layout(model)
        return model.eval()

    io.register(
        family.model,
        name=family.saved_class,
        describe=lambda model: {"config": asdict(model.config)},
        build=build,
        files=_save_tokenizer,
        restore=_restore_tokenizer,
    )
    register_builtin(family)
