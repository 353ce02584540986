"""GGUF files (llama.cpp's format) as a source of a Llama's weights: the config from the file's
metadata, every tensor dequantized to float32 under transformers' names (the query and key rows
put back from llama.cpp's rotary layout) and the tokenizer from the file's vocabulary.

``models.llama.load("model.gguf")`` reads one through ``loading.load_decoder``, which checks
the config against the tensors as it does for a folder. The ``gguf`` package reads the file
(the ``llm`` extra); transformers builds the tokenizer from its metadata.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .. import folder_reading
from .._cache import Bounded
from .._extras import require

__all__ = [
    "ARCHITECTURES",
    "TENSOR_TYPES",
    "architecture",
    "is_gguf",
    "one_reading",
    "read",
    "tokenizer",
]

ARCHITECTURES = ("llama",)  # general.architecture values read here
TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_1")  # the ggml types read here

# llama.cpp's metadata key (after "llama.") -> the config.json field, as transformers maps them
_CONFIG = {
    "block_count": "num_hidden_layers",
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.dimension_count": "head_dim",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
}
_TOKEN_IDS = {
    "tokenizer.ggml.bos_token_id": "bos_token_id",
    "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.padding_token_id": "pad_token_id",
}
# llama.cpp's tensor names -> transformers' (per layer: "blk.N.<key>" -> "model.layers.N.<value>")
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_MODEL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` names a GGUF file (by its ``.gguf`` suffix, existing or not)."""
    return Path(path).suffix.lower() == ".gguf"


# a file's parsed header, by what identifies its bytes: building a GGUFReader parses every
# metadata field (SmolLM2's 49,152-token vocabulary: ~6 s on a 2-core EPYC; Gemma 3's 262,144:
# ~24 s), and a load asks for it several times (config, weights, tokenizer, and transformers
# once more for each of its own readings). A reader only memory-maps the file and is never
# written to; the few kept here hold mappings, not copies.
_READERS: Bounded[tuple[str, int, int, str], Any] = Bounded(4)
_TOKENIZERS: Bounded[tuple[str, int, int, str], str] = Bounded(4)  # each as tokenizer.json


def _key(path: str | os.PathLike[str], mode: str = "r") -> tuple[str, int, int, str]:
    stat = os.stat(path)
    return (os.path.realpath(path), stat.st_size, stat.st_mtime_ns, mode)


def _shared(reader: type, path: str | os.PathLike[str], mode: str = "r") -> Any:
    """``reader(path, mode)`` (the gguf package's GGUFReader), built once per file's bytes (a
    changed file is parsed again)."""
    return _READERS.make(_key(path, mode), lambda: reader(path, mode))


@contextlib.contextmanager
def one_reading() -> Iterator[None]:
    """Inside, ``gguf.GGUFReader`` is the shared reader above, so that transformers' GGUF
    loader (which builds a reader for the config, another for the tokenizer and a third for
    the weights) parses each file once; the real class is put back on the way out."""
    gguf = require("gguf", "llm", "reading a GGUF file")
    real = gguf.GGUFReader

    def reader(path: str | os.PathLike[str], mode: str = "r") -> Any:
        return _shared(real, path, mode)  # what transformers calls: GGUFReader(path)

    setattr(gguf, "GGUFReader", reader)  # noqa: B010  (a function where mypy sees a class)
    try:
        yield
    finally:
        setattr(gguf, "GGUFReader", real)  # noqa: B010


def _reader(path: Path) -> Any:
    gguf = require("gguf", "llm", "reading a GGUF file")
    if not path.is_file():
        raise FileNotFoundError(f"the GGUF file {path} does not exist. Received: '{path}'")
    try:
        return _shared(gguf.GGUFReader, path)
    except (ValueError, IndexError, OSError) as err:
        raise ValueError(
            f"{path} could not be read as a GGUF file ({err}); it is truncated or not a GGUF "
            f"file. Received: {path.stat().st_size} bytes"
        ) from None


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _architecture(reader: Any, path: Path) -> str:
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"{path.name} holds a model of the architecture {arch!r}; multihead reads GGUF "
            f"files of the architectures {', '.join(ARCHITECTURES)}. "
            f"Received: general.architecture={arch!r}"
        )
    return arch


def architecture(path: str | Path) -> str:
    """The GGUF file's ``general.architecture``, which names the family that opens it.

    Raises:
        ValueError: an architecture other than those in ``ARCHITECTURES``, or not a GGUF file.
        FileNotFoundError: no such file.
    """
    return _architecture(_reader(Path(path)), Path(path))


def _config(reader: Any, arch: str) -> dict[str, Any]:
    """config.json's fields from the metadata (what transformers' GGUF loader derives)."""
    raw: dict[str, Any] = {"model_type": arch}
    for key, name in _CONFIG.items():
        value = _field(reader, f"{arch}.{key}")
        if value is not None:
            raw[name] = value
    for key, name in _TOKEN_IDS.items():
        value = _field(reader, key)
        if value is not None:
            raw[name] = value
    if "vocab_size" not in raw and "tokenizer.ggml.tokens" in reader.fields:
        raw["vocab_size"] = len(reader.fields["tokenizer.ggml.tokens"].data)
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):  # the config refuses scaled RoPE, naming the type
        raw["rope_scaling"] = {"rope_type": scaling}
    raw["tie_word_embeddings"] = all(t.name != "output.weight" for t in reader.tensors)
    return raw


def _hf_name(name: str) -> str:
    """transformers' name of llama.cpp's tensor ``name``; an unknown name is kept, and the
    loader refuses it as a tensor the model does not use."""
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _MODEL_NAMES:
        return f"{_MODEL_NAMES[parts[0]]}.{parts[1]}"
    return name


def _rows_from_pairs(weight: Tensor, heads: int) -> Tensor:
    """Undo llama.cpp's permutation of a query or key projection (weight or bias): each head's
    rows from interleaved rotary pairs back to halves (transformers' ``rotate_half``)."""
    rows = weight.shape[0] // heads // 2
    return weight.reshape(heads, rows, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def read(path: str | Path) -> tuple[dict[str, Any], folder_reading.Weights]:
    """A GGUF file's config and weights: what ``loading.load_decoder`` reads from a folder's
    config.json and safetensors.

    Args:
        path: the ``.gguf`` file.

    Returns:
        ``(config, weights)``: config.json's fields (transformers' names: ``hidden_size``,
        ``num_key_value_heads``, ...; ``tie_word_embeddings`` when the file has no
        ``output.weight``), and the tensors under transformers' names with float32 meta
        tensors of their shapes as the header. ``weights.read()`` dequantizes every tensor to
        float32 and puts the query and key rows back into transformers' rotary layout.

    Raises:
        FileNotFoundError: no such file.
        ModuleNotFoundError: the ``gguf`` package is not installed (the message names the
            extra).
        ValueError: not a GGUF file, an architecture other than llama, or a tensor stored in a
            type other than those of ``TENSOR_TYPES`` (the tensor and its type are named).
    """
    file = Path(path)
    reader = _reader(file)
    raw = _config(reader, _architecture(reader, file))
    for t in reader.tensors:
        if t.tensor_type.name not in TENSOR_TYPES:
            raise ValueError(
                f"tensor {t.name} in {file.name} is stored as {t.tensor_type.name}; multihead "
                f"reads the tensor types {', '.join(TENSOR_TYPES)} (convert the file with "
                f"llama.cpp's llama-quantize). Received: {t.name}.type={t.tensor_type.name}"
            )
    shapes = {_hf_name(t.name): tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors}
    header = {
        name: torch.empty(shape, dtype=torch.float32, device="meta")
        for name, shape in shapes.items()
    }

    def read_all() -> dict[str, Tensor]:  # after the config's checks: the head counts are there
        from gguf import quants

        h = raw["num_attention_heads"]
        heads = {"q_proj": h, "k_proj": raw.get("num_key_value_heads") or h}
        state = {}
        for t in reader.tensors:
            name = _hf_name(t.name)
            values = quants.dequantize(t.data, t.tensor_type).reshape(shapes[name])
            tensor = torch.tensor(values, dtype=torch.float32)  # a copy: the file is mapped
            projection = name.split(".")[-2]
            if projection in heads:
                tensor = _rows_from_pairs(tensor, heads[projection])
            state[name] = tensor
        return state

    return raw, folder_reading.Weights(file, header, dict.fromkeys(header, file.name), read_all)


def tokenizer(path: str | Path) -> Any:
    """The GGUF file's tokenizer (its ``tokenizer.ggml.*`` metadata) as a
    ``tokenizers.Tokenizer`` with padding and truncation off: transformers' conversion
    (``AutoTokenizer.from_pretrained(folder, gguf_file=name).backend_tokenizer``); None when
    the file holds no vocabulary.

    Raises:
        ModuleNotFoundError: transformers is not installed (the message names the extra).
    """
    tokenizers = require("tokenizers", "llm", "reading a GGUF file's tokenizer")
    file = Path(path)
    if "tokenizer.ggml.tokens" not in _reader(file).fields:
        return None

    def converted() -> str:  # transformers' conversion walks the whole vocabulary
        transformers = require("transformers", "llm", "reading a GGUF file's tokenizer")
        with one_reading():
            auto = transformers.AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
        return auto.backend_tokenizer.to_str()

    # a copy of its own each time: a caller may set padding or truncation on it
    backend = tokenizers.Tokenizer.from_str(_TOKENIZERS.make(_key(file), converted))
    backend.no_padding()
    backend.no_truncation()
    return backend
