"""torch.nn.functional.scaled_dot_product_attention, given the mask in the form it needs.

Structured masks are lowered to a dense (B, H, L, S) tensor here, except a causal mask that
torch's ``is_causal`` expresses exactly. Rows with no visible key are handled here rather than
trusted to the kernel: they are shown every key (finite softmax), then zeroed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ._call import Call, dense_keep, drop_dead_keys, stat_dtype


def unsupported(call: Call) -> str | None:
    if call.return_weights:
        return "torch's scaled_dot_product_attention does not return attention weights"
    return None


def is_plain_causal(call: Call) -> bool:
    """True when torch's ``is_causal`` expresses the mask exactly."""
    _, _, _, length_q, length_k, _ = call.shape
    return (
        call.mask is not None
        and call.bias is None
        and call.mask.torch_is_causal(length_q, length_k)
    )


def run(call: Call) -> tuple[Tensor, Tensor | None]:
    q, k, v = call.query, call.key, call.value
    common = dict(dropout_p=call.dropout_p, scale=call.scale)
    if call.mask is None or is_plain_causal(call):
        attn = call.dense_bias(stat_dtype(q.dtype))  # float32 beside half: torch accepts it
        causal = call.mask is not None
        if causal and q.shape[2] < k.shape[2]:
            # top-left causal with L < S: keys L.. are hidden from every query; never read
            # them (a preallocated cache may hold garbage there)
            k, v = k[:, :, : q.shape[2]], v[:, :, : q.shape[2]]
        gqa = q.shape[1] != k.shape[1]
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn, is_causal=causal, enable_gqa=gqa, **common
        )
        return out, None

    keep = dense_keep(call)
    k, v = drop_dead_keys(keep, k, v)
    row_any = keep.any(dim=-1, keepdim=True)  # [B|1, H|1, L, 1]
    shown = keep | ~row_any
    if call.bias is None:
        attn: Tensor = shown
    else:
        attn = call.dense_bias(stat_dtype(q.dtype)).masked_fill(~shown, float("-inf"))
    gqa = q.shape[1] != k.shape[1]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn, enable_gqa=gqa, **common)
    return torch.where(row_any, out, 0.0), None
