"""multihead: multi-head attention for PyTorch, correct and fast under every mask.

Shape legend, used in every docstring and comment:

    B batch · H query heads · H_kv key/value heads (divides H) · L query length ·
    S key length · D head dim (D_v for values when different) · E embedding dim

Kernels (``attention``) take (B, H, L, D) tensors like
``torch.nn.functional.scaled_dot_product_attention``; modules take batch-first (B, L, E).
Masks use one polarity everywhere: True = may attend.
"""

from . import masks, models
from ._version import __version__
from .functional import (
    AttentionOutput,
    attention,
    attention_with_weights,
    explain_backend,
)
from .io import save
from .models import load
from .modules import (
    FeedForward,
    GatedFeedForward,
    KVCache,
    LearnedPositionalEncoding,
    MultiHeadAttention,
    RMSNorm,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
    StackOutput,
    TransformerDecoder,
    TransformerDecoderLayer,
    TransformerEncoder,
    TransformerEncoderLayer,
    merge_heads,
    split_heads,
)

__all__ = [
    "AttentionOutput",
    "FeedForward",
    "GatedFeedForward",
    "KVCache",
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
    "__version__",
    "attention",
    "attention_with_weights",
    "explain_backend",
    "load",
    "masks",
    "merge_heads",
    "models",
    "save",
    "split_heads",
]
