"""KV-cache compression chosen by the kernel's own attention statistics.

A policy is a small record (``SnapKV(keep=0.25)``, ``H2O``, ``TOVA``, ``StreamingLLM``); one
selection function (``select``) turns a policy, its scores and a cache's slots into the kept
positions; ``LayerState`` is one layer's compressed cache. ``multihead.hf.compress`` applies a
policy to a transformers model's cache, ``KVCache(policy=...)`` and
``generate(..., compress=...)`` to the library's own decoders. See the guide "Long inputs in
bounded memory".
"""

from __future__ import annotations

from .policies import H2O, POLICIES, TOVA, Policy, SnapKV, StreamingLLM, policy
from .select import Selection, select, sink_bound
from .state import LayerState, grouped

__all__ = [
    "H2O",
    "POLICIES",
    "TOVA",
    "LayerState",
    "Policy",
    "Selection",
    "SnapKV",
    "StreamingLLM",
    "grouped",
    "policy",
    "select",
    "sink_bound",
]
