"""torch.nn.functional.scaled_dot_product_attention, given the mask in the form it needs.

Structured masks are lowered to a dense (B, H, L, S) tensor here, except a causal mask that
torch's ``is_causal`` expresses exactly. Rows with no visible key are handled here rather than
trusted to the kernel: they are shown every key (finite softmax), then zeroed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ._tensors import dense_keep, drop_dead_keys, stat_dtype
from .call import Call, plain_causal
from .protocol import FALLBACK, PREFERRED, Backend, Capabilities, Rank


def rank(call: Call) -> Rank:
    if call.exported:
        return Rank(FALLBACK, "it runs torch's own op, which exports")
    if call.traced:
        return Rank(
            PREFERRED,
            "inside a compiled graph it takes the mask as a tensor computed on the device from "
            "the mask's rule: no host reads, so no graph break",
        )
    if call.device_type != "cpu":
        return Rank(PREFERRED, "torch's fused kernels lead on accelerators")
    if call.bias is not None and call.bias.computed:
        return Rank(FALLBACK, "it takes the score modifier as a dense (B, H, L, S) tensor")
    if call.mask is None:
        return Rank(PREFERRED, "with no mask there is nothing to skip")
    if plain_causal(call):
        return Rank(PREFERRED, "torch's is_causal kernel skips the same tiles")
    if call.mask.arbitrary:
        return Rank(PREFERRED, "an arbitrary dense mask has little to skip")
    return Rank(FALLBACK, "it lowers the mask to a dense (B, H, L, S) tensor")


def run(call: Call) -> tuple[Tensor, Tensor | None]:
    q, k, v = call.query, call.key, call.value
    common = dict(dropout_p=call.dropout_p, scale=call.scale)
    if call.mask is None or plain_causal(call):
        attn = call.dense_bias(stat_dtype(q.dtype))  # float32 beside half: torch accepts it
        causal = call.mask is not None
        if causal and q.shape[2] < k.shape[2]:
            # top-left causal with L < S: keys L.. are hidden from every query; never read
            # them (a preallocated cache may hold garbage there)
            k, v = k[:, :, : q.shape[2]], v[:, :, : q.shape[2]]
        gqa = _gqa(q, k)
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
    gqa = _gqa(q, k)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn, enable_gqa=gqa, **common)
    return torch.where(row_any, out, 0.0), None


def _gqa(q: Tensor, k: Tensor) -> bool:
    """Whether query and key head counts differ, as the plain bool torch's op demands: under
    torch.compile(dynamic=True) the counts may be symbolic, and a branch turns their
    comparison into a guard where ``bool()`` would leave it symbolic."""
    if q.shape[1] != k.shape[1]:  # noqa: SIM103  the branch is the point (see above)
        return True
    return False


BACKEND = Backend(
    run=run,
    rank=rank,
    capabilities=Capabilities(
        label="torch's scaled_dot_product_attention", weights=False, dropout=True
    ),
)
