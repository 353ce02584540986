"""KV-cache compression chosen by the kernel's own attention statistics.

A policy is a small record (``SnapKV(keep=0.25)``, ``H2O``, ``TOVA``, ``StreamingLLM``,
``ChunkKV`` that keeps spans whole, ``SpanKV`` whose spans are centred on the high scores,
``PyramidKV`` with budgets per layer); one
selection function (``select``) turns a policy, its scores and a cache's slots into the kept
positions; ``LayerState`` is one layer's compressed cache.

The protocol, the same for the prompt, each of its chunks and each decoding step, in both
worlds: ``request(policy, state, rows)`` says which statistic the call computes (in the same
kernel pass as its output), and ``LayerState.observe(scores, rows)`` takes it and cuts the
layer back to its budget. ``multihead.hf.compress`` applies a
policy to a transformers model's cache, ``KVCache(policy=...)`` and
``generate(..., compress=...)`` to the library's own decoders. See the guide "Long inputs in
bounded memory".
"""

from __future__ import annotations

from .policies import (
    H2O,
    POLICIES,
    TOVA,
    ChunkKV,
    Policy,
    PyramidKV,
    Reconstruction,
    SnapKV,
    SpanKV,
    StreamingLLM,
    policy,
)
from .select import Selection, select, sink_bound
from .state import LayerState, causal_band, grouped, request

__all__ = [
    "H2O",
    "POLICIES",
    "TOVA",
    "ChunkKV",
    "LayerState",
    "Policy",
    "PyramidKV",
    "Reconstruction",
    "Selection",
    "SnapKV",
    "SpanKV",
    "StreamingLLM",
    "causal_band",
    "grouped",
    "policy",
    "request",
    "select",
    "sink_bound",
]
