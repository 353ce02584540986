"""The ground truth: readable eager attention that returns weights and works in float64.

Half-precision inputs are computed in float32 and cast back, so the reference is never the
least accurate contender.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._tensors import dense_keep, drop_dead_keys, repeat_kv, stat_dtype
from .call import Call
from .protocol import LAST, LEADS, PREFERRED, Backend, Capabilities, Rank


def rank(call: Call) -> Rank:
    if call.exported:
        return Rank(LEADS, "an exported graph needs plain ops without data-dependent branches")
    if call.return_weights and call.traced:
        return Rank(
            PREFERRED,
            "inside a compiled graph its plain ops give the weights without host reads "
            "(Inductor fuses them)",
        )
    return Rank(LAST, "it is the readable ground truth and builds the whole (B, H, L, S) scores")


def run(call: Call) -> tuple[Tensor, Tensor | None]:
    h = call.query.shape[1]
    dtype = call.query.dtype
    work = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    q, k, v = (t.to(work) for t in (call.query, call.key, call.value))
    keep = dense_keep(call)
    if keep is not None:
        k, v = drop_dead_keys(keep, k, v)
    k, v = repeat_kv(k, h // k.shape[1]), repeat_kv(v, h // v.shape[1])

    scores = (q @ k.transpose(-2, -1)) * call.scale  # [B, H, L, S]
    if call.softcap is not None:
        scores = call.softcap * torch.tanh(scores / call.softcap)
    if call.bias is not None:
        scores = scores + call.dense_bias(stat_dtype(work))
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
        # a row with no visible key would be softmax(all -inf) = NaN: give it finite scores,
        # then zero its weights below
        scores = torch.where(keep.any(dim=-1, keepdim=True), scores, 0.0)
    if call.sinks is None:
        weights = torch.softmax(scores, dim=-1)
    else:  # one more logit per row, with no value: it only enlarges the denominator
        b, _, length_q, _ = scores.shape
        sink = call.sinks.to(scores.dtype)[None, :, None, None].expand(b, h, length_q, 1)
        weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    if keep is not None:
        weights = torch.where(keep, weights, 0.0)

    dropped = weights
    if call.dropout_p > 0.0:
        dropped = torch.nn.functional.dropout(weights, p=call.dropout_p)
    out = dropped @ v  # [B, H, L, D_v]
    return out.to(dtype), (weights.to(dtype) if call.return_weights else None)


BACKEND = Backend(
    run=run,
    rank=rank,
    capabilities=Capabilities(
        label="the reference backend", weights=True, dropout=True, softcap=True, sinks=True
    ),
)
