"""Modules built on ``multihead.attention``: projections, head reshaping, blocks, decoding."""

from .attention import MultiHeadAttention, merge_heads, split_heads
from .cache import CacheStep, KVCache, LayerCache
from .decoder import DecoderOutput, TransformerDecoder, TransformerDecoderLayer
from .norms import RMSNorm
from .positional import LearnedPositionalEncoding, SinusoidalPositionalEncoding, sinusoidal_table
from .rotary import RotaryEmbedding
from .transformer import (
    EncoderOutput,
    FeedForward,
    GatedFeedForward,
    TransformerEncoder,
    TransformerEncoderLayer,
)

__all__ = [
    "CacheStep",
    "DecoderOutput",
    "EncoderOutput",
    "FeedForward",
    "GatedFeedForward",
    "KVCache",
    "LayerCache",
    "LearnedPositionalEncoding",
    "MultiHeadAttention",
    "RMSNorm",
    "RotaryEmbedding",
    "SinusoidalPositionalEncoding",
    "TransformerDecoder",
    "TransformerDecoderLayer",
    "TransformerEncoder",
    "TransformerEncoderLayer",
    "merge_heads",
    "sinusoidal_table",
    "split_heads",
]
