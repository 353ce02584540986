"""multihead: multi-head attention for PyTorch, correct and fast under every mask.

Shape legend, used in every docstring and comment:

    B batch · H query heads · H_kv key/value heads (divides H) · L query length ·
    S key length · D head dim (D_v for values when different) · E embedding dim

Kernels (``attention``) take (B, H, L, D) tensors like
``torch.nn.functional.scaled_dot_product_attention``; modules take batch-first (B, L, E).
Masks use one polarity everywhere: True = may attend.

The names below are imported on first use, so ``import multihead`` (and the ``multihead``
command's ``--help``) cost nothing until one is used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__

if TYPE_CHECKING:
    from . import masks, models
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
    from .stats import attention_stats

# public name -> the module that defines it (a module name alone: the submodule itself)
_WHERE = {
    "masks": "multihead.masks",
    "models": "multihead.models",
    "AttentionOutput": "multihead.functional",
    "attention": "multihead.functional",
    "attention_with_weights": "multihead.functional",
    "explain_backend": "multihead.functional",
    "attention_stats": "multihead.stats",
    "save": "multihead.io",
    "load": "multihead.models",
    **{
        name: "multihead.modules"
        for name in (
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
            "merge_heads",
            "split_heads",
        )
    },
}

__all__ = ["__version__", *sorted(_WHERE)]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'multihead' has no attribute {name!r}")
    module = importlib.import_module(_WHERE[name])
    value = module if module.__name__ == f"multihead.{name}" else getattr(module, name)
    globals()[name] = value  # once imported, an ordinary attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE})
