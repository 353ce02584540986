"""Tensor helpers the eager backends share: the statistics dtype, grouped-query expansion, the
mask lowered to a tensor, and keys no query sees zeroed before any product reads them."""

from __future__ import annotations

import torch
from torch import Tensor

from .call import Call

__all__ = ["dense_keep", "drop_dead_keys", "repeat_kv", "stat_dtype"]


def stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax statistics and biases: float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def sink_grad(sinks: Tensor, grad: Tensor, out: Tensor, lse: Tensor) -> Tensor:
    """Gradient of the sink logits (H,) from a finished call: each row gives its sink the weight
    exp(sink - lse) (``lse`` with the sink joined) times -sum(dO * O), the same row term every
    score's gradient subtracts, summed over batch and rows. Rows that see nothing (lse -inf)
    give none."""
    delta = (grad.to(lse.dtype) * out.to(lse.dtype)).sum(-1)  # [B, H, L]
    weight = torch.exp(sinks.detach().to(lse.dtype)[None, :, None] - lse)
    weight = torch.where(torch.isfinite(lse), weight, 0.0)
    return -(weight * delta).sum((0, 2)).to(sinks.dtype)


def repeat_kv(t: Tensor, groups: int) -> Tensor:
    """[B, H_kv, S, D] -> [B, H_kv * groups, S, D]; query head h reads kv head h // groups."""
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def dense_keep(call: Call) -> Tensor | None:
    """The mask as a bool tensor broadcastable to [B, H, L, S], or None when there is none."""
    if call.mask is None:
        return None
    _, _, _, length_q, length_k, _ = call.shape
    return call.mask.to_dense(length_q, length_k, device=call.query.device)


def drop_dead_keys(keep: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
    """Zero key/value rows that no query may see.

    Padding often holds garbage (even NaN); a weight of 0 times NaN is still NaN inside a matmul,
    so keys that are invisible to every query must not be read at all. When the mask differs
    per head, key/value are first expanded from H_kv to H heads so each head drops its own.
    """
    live = keep.any(dim=2)  # [B|1, H|1, S]
    # no early exit when every key is live: a data-dependent branch would stop torch.export
    if live.shape[1] not in (1, key.shape[1]):
        groups = live.shape[1] // key.shape[1]
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    live = live[..., None]  # [B|1, H|1, S, 1]
    zero = torch.zeros((), dtype=key.dtype, device=key.device)
    return torch.where(live, key, zero), torch.where(live, value, zero)
