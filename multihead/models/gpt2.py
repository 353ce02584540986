"""The GPT-2 family: its model on multihead's own decoder blocks, its config, the names of its
checkpoints' tensors, and its ``Family`` record.

``load(path)`` reads ``config.json``, the weights and ``tokenizer.json`` (when present) of a
``GPT2LMHeadModel`` / ``GPT2Model`` folder. Needs the ``pretrained`` extra.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .. import configs
from ..configs import Size
from ..modules import (
    FeedForward,
    LearnedPositionalEncoding,
    MultiHeadAttention,
    TransformerDecoder,
    TransformerDecoderLayer,
)
from .causal_lm import CausalLM, CausalLMOutput
from .families import Family
from .loading import check_token_ids, load_decoder, register_decoder

__all__ = ["FAMILY", "GPT2", "CausalLMOutput", "GPT2Config", "load"]

# Hugging Face ``activation_function`` -> our activation name
_HF_ACTIVATIONS = {
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu": "gelu",
    "relu": "relu",
}
# config fields that change the math, and the only values implemented
_FIXED = {
    "model_type": ("gpt2",),
    "scale_attn_weights": (True,),
    "scale_attn_by_inverse_layer_idx": (False,),
    "add_cross_attention": (False,),
}
# tensors older checkpoints saved that hold no weights: the causal-mask buffers
_UNUSED_SUFFIXES = (".attn.bias", ".attn.masked_bias")


@dataclass(frozen=True)
class GPT2Config:
    """The fields of a GPT-2 ``config.json`` that shape the model (Hugging Face names)."""

    vocab_size: Size
    n_positions: Size = 1024  # learned position table: the longest sequence
    n_embd: Size = 768
    n_layer: Size = 12
    n_head: Size = 12
    n_inner: Size | None = None  # feed-forward width; None means 4 * n_embd
    activation_function: str = "gelu_new"  # the tanh approximation of GELU
    layer_norm_epsilon: float = 1e-5
    tie_word_embeddings: bool = True  # the output layer reuses the token embeddings
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> GPT2Config:
        """Validate a parsed config; every error names the field."""
        config = configs.parse_config(
            cls,
            raw,
            source=source,
            fixed=_FIXED,
            choices={"activation_function": _HF_ACTIVATIONS},
        )
        if config.n_embd % config.n_head:
            raise ValueError(
                f"{source}: n_head must divide n_embd={config.n_embd}. "
                f"Received: n_head={config.n_head}"
            )
        check_token_ids(config, source)
        return config


class GPT2(CausalLM):
    """GPT-2 (Radford et al. 2019): token + learned position embeddings, pre-norm decoder
    layers with GELU feed-forwards, a final LayerNorm, and an output layer tied to the token
    embeddings. See ``CausalLM`` for ``forward``, ``run`` and ``generate``."""

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.config = config
        e, eps = config.n_embd, config.layer_norm_epsilon
        self.wte = nn.Embedding(config.vocab_size, e)
        self.wpe = LearnedPositionalEncoding(config.n_positions, e)
        activation = _HF_ACTIVATIONS[config.activation_function]
        layers = [
            TransformerDecoderLayer(
                MultiHeadAttention(e, config.n_head),
                FeedForward(e, config.n_inner or 4 * e, activation=activation),
                norm1=nn.LayerNorm(e, eps=eps),
                norm2=nn.LayerNorm(e, eps=eps),
            )
            for _ in range(config.n_layer)
        ]
        self.decoder = TransformerDecoder(layers, norm=nn.LayerNorm(e, eps=eps))
        self.lm_head = nn.Linear(e, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.wte.weight
        self.vocab_size = config.vocab_size
        self.max_positions = config.n_positions
        eos = config.eos_token_id
        self.eos_token_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        # GPT-2 has no padding token; like transformers, pad with end-of-text
        pad = config.pad_token_id
        self.pad_token_id = pad if pad is not None else (self.eos_token_ids or [0])[0]

    def embed(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        return self.wpe(self.wte(input_ids), positions)


def _hf_names(config: GPT2Config, tied: bool) -> dict[str, Any]:
    """Our state-dict key -> checkpoint name, or (name, convert) for GPT-2's Conv1D layers,
    which store (in, out) matrices and fuse the query, key and value projections."""
    e = config.n_embd

    def part(i: int):
        return lambda t: t[..., i * e : (i + 1) * e].T if t.dim() == 2 else t[i * e : (i + 1) * e]

    def transposed(t: Tensor) -> Tensor:
        return t.T

    names: dict[str, Any] = {
        "wte.weight": "wte.weight",
        "wpe.embedding.weight": "wpe.weight",
        "decoder.norm.weight": "ln_f.weight",
        "decoder.norm.bias": "ln_f.bias",
        "lm_head.weight": "wte.weight" if tied else "lm_head.weight",
    }
    for i in range(config.n_layer):
        ours, theirs = f"decoder.layers.{i}", f"h.{i}"
        for p in ("weight", "bias"):
            names[f"{ours}.norm1.{p}"] = f"{theirs}.ln_1.{p}"
            names[f"{ours}.norm2.{p}"] = f"{theirs}.ln_2.{p}"
            for j, proj in enumerate(("q_proj", "k_proj", "v_proj")):
                names[f"{ours}.self_attn.{proj}.{p}"] = (f"{theirs}.attn.c_attn.{p}", part(j))
            convert = transposed if p == "weight" else None
            for mine, hf in (
                ("self_attn.out_proj", "attn.c_proj"),
                ("feed_forward.linear1", "mlp.c_fc"),
                ("feed_forward.linear2", "mlp.c_proj"),
            ):
                source = f"{theirs}.{hf}.{p}"
                names[f"{ours}.{mine}.{p}"] = (source, convert) if convert else source
    return names


def load(
    path: str | Path, *, dtype: torch.dtype = torch.float32, weights: str | None = None
) -> GPT2:
    """A GPT-2 folder (``GPT2LMHeadModel`` / ``GPT2Model``): ``loading.load_decoder`` for
    ``FAMILY``, whose docstring gives the arguments, the result and the errors."""
    return load_decoder(FAMILY, path, dtype=dtype, weights=weights)


def _sized(*, vocab_size: int, context: int, width: int, layers: int, heads: int,
           kv_heads: int, **token_ids: int) -> GPT2Config:  # fmt: skip
    """A GPT-2 config of these sizes (GPT-2 has no grouped-query attention: ``kv_heads`` is
    not used)."""
    return GPT2Config(vocab_size=vocab_size, n_positions=context, n_embd=width, n_layer=layers,
                      n_head=heads, **token_ids)  # fmt: skip


FAMILY = Family(
    model_type="gpt2",
    description="a GPT-2 decoder",
    model=GPT2,
    load=load,
    config=GPT2Config,
    causal=True,
    transformers="GPT2LMHeadModel",
    names=_hf_names,
    prefix="transformer.",
    unused=_UNUSED_SUFFIXES,
    sized=_sized,
)
register_decoder(FAMILY)
