"""The Llama family: its model on multihead's own decoder blocks, its config, the names of its
checkpoints' tensors, and its ``Family`` record.

``load(path)`` reads ``config.json``, the weights (single or sharded safetensors, or
``pytorch_model.bin``) and ``tokenizer.json`` when present, of a ``LlamaForCausalLM`` folder,
or a llama GGUF file (llama.cpp's format: ``models/gguf.py``).
Grouped-query attention, rotary embeddings (the default RoPE), RMSNorm and SwiGLU are built from
this library's modules. Needs the ``pretrained`` extra.
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
    GatedFeedForward,
    MultiHeadAttention,
    RMSNorm,
    RotaryEmbedding,
    TransformerDecoder,
    TransformerDecoderLayer,
)
from .causal_lm import CausalLM, CausalLMOutput
from .families import Family
from .loading import check_token_ids, load_decoder, register_decoder

__all__ = ["FAMILY", "CausalLMOutput", "Llama", "LlamaConfig", "load"]

_FIXED = {"model_type": ("llama",), "hidden_act": ("silu",), "pretraining_tp": (1,)}
# buffers older checkpoints saved: the rotary frequencies, recomputed here
_UNUSED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class LlamaConfig:
    """The fields of a Llama ``config.json`` that shape the model (Hugging Face names)."""

    vocab_size: Size
    hidden_size: Size
    intermediate_size: Size  # SwiGLU hidden width
    num_hidden_layers: Size
    num_attention_heads: Size
    num_key_value_heads: Size | None = None  # H_kv for grouped-query attention; None means H
    head_dim: Size | None = None  # D; None means hidden_size / num_attention_heads
    max_position_embeddings: Size = 2048  # the trained context: inputs and generation stop here
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0  # older configs; newer ones use rope_parameters
    rope_parameters: dict | None = None  # {"rope_type": "default", "rope_theta": ...}
    rope_scaling: dict | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> LlamaConfig:
        """Validate a parsed config; every error names the field."""
        config = configs.parse_config(
            cls,
            raw,
            source=source,
            fixed=_FIXED,
        )
        h, e = config.num_attention_heads, config.hidden_size
        if config.head_dim is None and e % h:
            raise ValueError(
                f"{source}: num_attention_heads must divide hidden_size={e} when head_dim is "
                f"not given. Received: num_attention_heads={h}"
            )
        if config.head_dim is not None and config.head_dim % 2:
            raise ValueError(
                f"{source}: head_dim must be even (rotary embeddings rotate pairs). "
                f"Received: head_dim={config.head_dim}"
            )
        h_kv = config.num_key_value_heads
        if h_kv is not None and h % h_kv:
            raise ValueError(
                f"{source}: num_key_value_heads must divide num_attention_heads={h}. "
                f"Received: num_key_value_heads={h_kv}"
            )
        rope = config.rope_parameters or config.rope_scaling or {}
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            raise ValueError(
                f"{source}: rope_type must be 'default' (scaled RoPE variants are not "
                f"implemented). Received: rope_type={kind!r}"
            )
        theta = config.theta
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
            raise ValueError(
                f"{source}: rope_theta must be a positive number. Received: rope_theta={theta!r}"
            )
        check_token_ids(config, source)
        return config

    @property
    def theta(self) -> float:
        """The RoPE base, from ``rope_parameters`` when present."""
        return (self.rope_parameters or {}).get("rope_theta", self.rope_theta)


class Llama(CausalLM):
    """Llama (Touvron et al. 2023): token embeddings, pre-RMSNorm decoder layers with rotary
    grouped-query attention and SwiGLU feed-forwards, a final RMSNorm and an output layer.
    See ``CausalLM`` for ``forward``, ``run`` and ``generate``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        e, h = config.hidden_size, config.num_attention_heads
        d = config.head_dim or e // h
        eps = config.rms_norm_eps
        self.embed_tokens = nn.Embedding(config.vocab_size, e)
        layers = [
            TransformerDecoderLayer(
                MultiHeadAttention(
                    e,
                    h,
                    num_kv_heads=config.num_key_value_heads,
                    bias=config.attention_bias,
                    head_dim=d,
                    rotary=RotaryEmbedding(d, base=config.theta),
                ),
                GatedFeedForward(e, config.intermediate_size, bias=config.mlp_bias),
                norm1=RMSNorm(e, eps=eps),
                norm2=RMSNorm(e, eps=eps),
            )
            for _ in range(config.num_hidden_layers)
        ]
        self.decoder = TransformerDecoder(layers, norm=RMSNorm(e, eps=eps))
        self.lm_head = nn.Linear(e, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.vocab_size = config.vocab_size
        # RoPE has no table to run out of, but the model was trained up to this length only
        self.max_positions = config.max_position_embeddings
        eos = config.eos_token_id
        self.eos_token_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        pad = config.pad_token_id
        self.pad_token_id = pad if pad is not None else (self.eos_token_ids or [0])[0]

    def embed(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        return self.embed_tokens(input_ids)


def _hf_names(config: LlamaConfig, tied: bool) -> dict[str, str]:
    """Our state-dict key -> checkpoint name (after the ``model.`` prefix is removed)."""
    names = {
        "embed_tokens.weight": "embed_tokens.weight",
        "decoder.norm.weight": "norm.weight",
        "lm_head.weight": "embed_tokens.weight" if tied else "lm_head.weight",
    }
    parts = {
        "self_attn.q_proj": "self_attn.q_proj",
        "self_attn.k_proj": "self_attn.k_proj",
        "self_attn.v_proj": "self_attn.v_proj",
        "self_attn.out_proj": "self_attn.o_proj",
        "feed_forward.gate_proj": "mlp.gate_proj",
        "feed_forward.up_proj": "mlp.up_proj",
        "feed_forward.down_proj": "mlp.down_proj",
    }
    for i in range(config.num_hidden_layers):
        ours, theirs = f"decoder.layers.{i}", f"layers.{i}"
        names[f"{ours}.norm1.weight"] = f"{theirs}.input_layernorm.weight"
        names[f"{ours}.norm2.weight"] = f"{theirs}.post_attention_layernorm.weight"
        for mine, hf in parts.items():
            names[f"{ours}.{mine}.weight"] = f"{theirs}.{hf}.weight"
            has_bias = config.mlp_bias if mine.startswith("feed") else config.attention_bias
            if has_bias:
                names[f"{ours}.{mine}.bias"] = f"{theirs}.{hf}.bias"
    return names


def load(
    path: str | Path, *, dtype: torch.dtype = torch.float32, weights: str | None = None
) -> Llama:
    """A Llama folder (``LlamaForCausalLM``) or GGUF file: ``loading.load_decoder`` for
    ``FAMILY``, whose docstring gives the arguments, the result and the errors. A GGUF file's
    tensors (F32, F16, BF16, Q8_0, Q4_1) are dequantized to float32, then held as ``dtype`` or
    ``weights`` asks::

        model = llama.load("SmolLM2-135M-Instruct.Q4_1.gguf", weights="int8")
    """
    return load_decoder(FAMILY, path, dtype=dtype, weights=weights)


def _sized(*, vocab_size: int, context: int, width: int, layers: int, heads: int,
           kv_heads: int, **token_ids: int) -> LlamaConfig:  # fmt: skip
    """A Llama config of these sizes: SwiGLU's hidden width 8/3 E (a multiple of 16), tied
    embeddings."""
    hidden = 16 * round(8 * width / 3 / 16)
    return LlamaConfig(vocab_size=vocab_size, hidden_size=width, intermediate_size=hidden,
                       num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=kv_heads, max_position_embeddings=context,
                       rms_norm_eps=1e-5, tie_word_embeddings=True, **token_ids)  # fmt: skip


FAMILY = Family(
    model_type="llama",
    description="a Llama decoder",
    model=Llama,
    load=load,
    config=LlamaConfig,
    causal=True,
    transformers="LlamaForCausalLM",
    names=_hf_names,
    prefix="model.",
    unused=_UNUSED_SUFFIXES,
    sized=_sized,
)
register_decoder(FAMILY)
