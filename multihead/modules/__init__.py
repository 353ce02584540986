"""Modules built on ``multihead.attention``: projections, head reshaping, blocks, decoding."""

from .attention import AttentionOutput, MultiHeadAttention, merge_heads, split_heads
from .cache import CacheStep, KVCache, LayerCache
from .decoder import TransformerDecoder, TransformerDecoderLayer
from .norms import RMSNorm
from .positional import LearnedPositionalEncoding, SinusoidalPositionalEncoding, sinusoidal_table
from .rotary import RotaryEmbedding
from .transformer import (
    FeedForward,
    GatedFeedForward,
    StackOutput,
    TransformerEncoder,
    TransformerEncoderLayer,
)

__all__ = [
    "AttentionOutput",
    "CacheStep",
    "FeedForward",
    "GatedFeedForward",
    "KVCache",
    "LayerCache",
    "LearnedPositionalEncoding",
    "MultiHeadAttention",
    "RMSNorm",
    "RotaryEmbedding",
    "SinusoidalPositionalEncoding",
    "StackOutput",
    "TransformerDecoder",
    "TransformerDecoderLayer",
    "TransformerEncoder",
    "TransformerEncoderLayer",
    "merge_heads",
    "sinusoidal_table",
    "split_heads",
]
