"""Tiny random-weight transformers models of many architectures, for the bridge's parity tests.

Each entry builds a config small enough to run in milliseconds, with the features the
architecture is known for switched on at sizes the test inputs reach (a sliding window shorter
than the inputs, soft-capping that bends the scores, attention sinks, GQA). Weights are drawn
with std 0.2 instead of transformers' 0.02, so attention is peaked rather than uniform and a
wrong mask or modifier shows in the outputs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import transformers as tf

VOCAB = 97
STD = 0.2


@dataclass(frozen=True)
class Arch:
    """One architecture: how to build it and what its forward takes."""

    name: str
    make: Callable[[], tf.PretrainedConfig]
    model: str  # the Auto class (or transformers class) name
    kind: str  # "decoder", "encoder", "seq2seq" or "vision"
    features: tuple[str, ...] = field(default_factory=tuple)  # for ids and docs


def _decoder(cls, **extra):
    base = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=STD,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    base.update(extra)
    return lambda: cls(**base)


def _encoder(cls, **extra):
    base = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        initializer_range=STD,
        pad_token_id=0,
    )
    base.update(extra)
    return lambda: cls(**base)


ARCHS: list[Arch] = [
    Arch("llama", _decoder(tf.LlamaConfig), "AutoModelForCausalLM", "decoder", ("gqa",)),
    Arch(
        "mistral",
        _decoder(tf.MistralConfig, sliding_window=5),
        "AutoModelForCausalLM",
        "decoder",
        ("gqa", "sliding window"),
    ),
    Arch(
        "mixtral",
        _decoder(tf.MixtralConfig, num_local_experts=4, num_experts_per_tok=2, sliding_window=6),
        "AutoModelForCausalLM",
        "decoder",
        ("gqa", "sliding window", "moe"),
    ),
    Arch(
        "qwen2",
        _decoder(
            tf.Qwen2Config,
            use_sliding_window=True,
            sliding_window=5,
            max_window_layers=1,
            layer_types=["full_attention", "sliding_attention"],
        ),
        "AutoModelForCausalLM",
        "decoder",
        ("gqa", "qkv bias", "sliding window"),
    ),
    Arch(
        "qwen3",
        _decoder(tf.Qwen3Config, head_dim=8),
        "AutoModelForCausalLM",
        "decoder",
        ("qk norm",),
    ),
    Arch(
        "gemma",
        _decoder(tf.GemmaConfig, head_dim=8),
        "AutoModelForCausalLM",
        "decoder",
        ("gqa",),
    ),
    Arch(
        "gemma2",
        _decoder(
            tf.Gemma2Config,
            head_dim=8,
            sliding_window=5,
            attn_logit_softcapping=1.5,
            final_logit_softcapping=30.0,
            query_pre_attn_scalar=8,
        ),
        "AutoModelForCausalLM",
        "decoder",
        ("softcap", "sliding window"),
    ),
    Arch(
        "gemma3",
        _decoder(
            tf.Gemma3TextConfig,
            head_dim=8,
            sliding_window=5,
            layer_types=["sliding_attention", "full_attention"],
            query_pre_attn_scalar=8,
        ),
        "AutoModelForCausalLM",
        "decoder",
        ("sliding window", "qk norm"),
    ),
    Arch(
        "phi3",
        _decoder(tf.Phi3Config, sliding_window=6),
        "AutoModelForCausalLM",
        "decoder",
        ("gqa", "sliding window", "fused qkv"),
    ),
    Arch(
        "gpt_neox",
        _decoder(tf.GPTNeoXConfig, num_key_value_heads=None, rotary_pct=0.5),
        "AutoModelForCausalLM",
        "decoder",
        ("partial rotary",),
    ),
    Arch(
        "gpt2",
        lambda: tf.GPT2Config(
            vocab_size=VOCAB,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=64,
            initializer_range=STD,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
        "AutoModelForCausalLM",
        "decoder",
        ("learned positions",),
    ),
    Arch("olmo2", _decoder(tf.Olmo2Config), "AutoModelForCausalLM", "decoder", ("qk norm",)),
    Arch(
        "starcoder2",
        _decoder(tf.Starcoder2Config, sliding_window=5),
        "AutoModelForCausalLM",
        "decoder",
        ("gqa", "sliding window"),
    ),
    Arch(
        "cohere2",
        _decoder(
            tf.Cohere2Config,
            sliding_window=5,
            layer_types=["sliding_attention", "full_attention"],
        ),
        "AutoModelForCausalLM",
        "decoder",
        ("sliding window", "parallel block"),
    ),
    Arch(
        "gpt_oss",
        _decoder(
            tf.GptOssConfig,
            head_dim=8,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=5,
            layer_types=["sliding_attention", "full_attention"],
        ),
        "AutoModelForCausalLM",
        "decoder",
        ("sinks", "sliding window", "moe"),
    ),
    Arch("bert", _encoder(tf.BertConfig), "AutoModel", "encoder", ("absolute positions",)),
    Arch("roberta", _encoder(tf.RobertaConfig, pad_token_id=1), "AutoModel", "encoder", ()),
    Arch("electra", _encoder(tf.ElectraConfig, embedding_size=32), "AutoModel", "encoder", ()),
    Arch(
        "modernbert",
        lambda: tf.ModernBertConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=3,
            num_attention_heads=4,
            max_position_embeddings=64,
            initializer_range=STD,
            local_attention=4,
            global_attn_every_n_layers=2,
            pad_token_id=0,
        ),
        "AutoModel",
        "encoder",
        ("bidirectional sliding window",),
    ),
    Arch(
        "distilbert",
        lambda: tf.DistilBertConfig(
            vocab_size=VOCAB,
            dim=32,
            hidden_dim=48,
            n_layers=2,
            n_heads=4,
            max_position_embeddings=64,
            initializer_range=STD,
            pad_token_id=0,
        ),
        "AutoModel",
        "encoder",
        (),
    ),
    Arch(
        "bart",
        lambda: tf.BartConfig(
            vocab_size=VOCAB,
            d_model=32,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=48,
            decoder_ffn_dim=48,
            max_position_embeddings=64,
            init_std=STD,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            decoder_start_token_id=2,
            forced_eos_token_id=None,
        ),
        "AutoModelForSeq2SeqLM",
        "seq2seq",
        ("cross attention",),
    ),
    Arch(
        "t5",
        lambda: tf.T5Config(
            vocab_size=VOCAB,
            d_model=32,
            d_kv=8,
            d_ff=48,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=16,
            initializer_factor=1.0,
            pad_token_id=0,
            eos_token_id=2,
            decoder_start_token_id=0,
        ),
        "AutoModelForSeq2SeqLM",
        "seq2seq",
        ("position bias", "cross attention"),
    ),
    Arch(
        "vit",
        lambda: tf.ViTConfig(
            image_size=16,
            patch_size=4,
            num_channels=3,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            initializer_range=STD,
        ),
        "AutoModel",
        "vision",
        ("patches",),
    ),
]

BY_NAME = {a.name: a for a in ARCHS}
