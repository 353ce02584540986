"""Modules built on ``multihead.attention``: projections, head reshaping, blocks."""

from .attention import MultiHeadAttention, merge_heads, split_heads
from .positional import LearnedPositionalEncoding, SinusoidalPositionalEncoding, sinusoidal_table
from .transformer import EncoderOutput, FeedForward, TransformerEncoder, TransformerEncoderLayer

__all__ = [
    "EncoderOutput",
    "FeedForward",
    "LearnedPositionalEncoding",
    "MultiHeadAttention",
    "SinusoidalPositionalEncoding",
    "TransformerEncoder",
    "TransformerEncoderLayer",
    "merge_heads",
    "sinusoidal_table",
    "split_heads",
]
