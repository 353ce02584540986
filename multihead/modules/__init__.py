"""Modules built on ``multihead.attention``: projections, head reshaping, blocks."""

from .attention import MultiHeadAttention, merge_heads, split_heads

__all__ = ["MultiHeadAttention", "merge_heads", "split_heads"]
