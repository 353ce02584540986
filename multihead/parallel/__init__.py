"""Attention across processes over ``torch.distributed``.

``context_attention`` splits one long sequence into contiguous shards, one per rank, and
computes exact attention over the whole: key/value shards travel around a ring of processes and
partial results merge through their log-sum-exp. ``visible_shards`` says which (query shard,
key shard) pairs a mask lets through, i.e. which shards each rank computes and which it only
forwards.
"""

from __future__ import annotations

from .context import ProcessGroupError, context_attention, visible_shards

__all__ = ["ProcessGroupError", "context_attention", "visible_shards"]
