"""``run_plan``: one attention call with what a ``Plan`` asks, the one function both readers
of plans call (``MultiHeadAttention`` and the transformers bridge's attention function).

A plan acts at two points of a call, named here once (TransformerLens' ``hook_pattern`` and
``hook_z``):

* **the pattern**, the softmax weights (B, H, L, S): ``knockout`` hides entries inside the
  kernel (its mask joins the call's), ``capture`` reads the weights of its heads or
  statistics of them from the same kernel call, and ``patch`` puts captured weights in
  place of a head's (as their product with this call's values);
* **a head's output**, its weighted sum of values (B, H, L, D_v) before the heads are merged
  and projected: ``ablate`` multiplies it by the head's scale.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..backends._tensors import stat_dtype
from ..functional import attention, attention_with_weights
from ..masks import Mask, TorchMasks, dense
from ..stats import Reducer, attention_stats
from .blocks import Capture, Edit, Plan

__all__ = ["head_output", "pattern", "run_plan"]


def run_plan(
    plan: Plan,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Mask | Tensor | None,
    *,
    bias: Any = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    weights: bool = False,
    heads: list[int] | None = None,
) -> tuple[Tensor, Tensor | None]:
    """``attention(query, key, value, mask, ...)`` with what ``plan`` asks, in one kernel call.

    Args:
        plan: what the active blocks ask of this call (``plan_for(module)``).
        query: (B, H, L, D).
        key: (B, H_kv, S, D).
        value: (B, H_kv, S, D_v).
        mask: the call's own mask, as ``multihead.attention`` takes it.
        bias, scale, dropout_p: as ``multihead.attention`` takes them.
        weights: the caller reads the weights too (``output_attentions``, a module's ``run``).
        heads: with ``weights``, the query heads whose weights the caller reads (None: all).

    Returns:
        (output (B, H, L, D_v), weights (B, H | len(heads), L, S) when ``weights``, else
        None). The capture's records are filled on the way.

    Raises:
        ValueError: a patch whose captured weights do not fit this call (both shapes named),
            and every error ``multihead.attention`` raises.
    """
    common: dict[str, Any] = {"bias": bias, "scale": scale, "dropout_p": float(dropout_p)}
    out, seen = pattern(plan, query, key, value, mask, common, weights, heads)
    return head_output(plan, out, query, key, value), seen


def pattern(
    plan: Plan,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Mask | Tensor | None,
    common: dict[str, Any],
    wants: bool,
    heads: list[int] | None,
) -> tuple[Tensor, Tensor | None]:
    """The point where a plan acts on the weights: knockouts joined to the mask, and the
    kernel call that also gives the capture its weights or statistics. Returns (output,
    the weights the caller reads or None)."""
    for block in plan.knockouts:
        assert block.mask is not None
        mask = _joined(mask, block.mask)
    cap = plan.capture
    if cap is None:
        if wants:
            return attention_with_weights(query, key, value, mask, heads=heads, **common)
        return attention(query, key, value, mask, **common), None
    if not wants and cap.stat_names and common["dropout_p"] == 0:
        out, found = attention_stats(
            query, key, value, mask, stats=cap.stat_names, window=cap.window, heads=cap.heads,
            bias=common["bias"], scale=common["scale"],
        )  # fmt: skip
        cap.record_stats(plan.layer, found)
        return out, None
    if not wants:  # the capture's heads alone are computed with weights
        out, part = attention_with_weights(query, key, value, mask, heads=cap.heads, **common)
        _keep(cap, plan.layer, part)
        return out, None
    out, every = attention_with_weights(query, key, value, mask, **common)
    _keep(cap, plan.layer, every if cap.heads is None else every[:, cap.heads])
    return out, every if heads is None else every[:, heads]


def head_output(plan: Plan, out: Tensor, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
    """The point where a plan acts on each head's output (B, H, L, D_v): patched heads get
    their captured weights times this call's values, ablated heads their scale."""
    for block in plan.patches:
        out = _patched(out, block, plan.layer, query, key, value)
    for scale in plan.scales:
        out = out * scale.to(out.device, out.dtype)[None, :, None, None]
    return out


def _joined(mask: Any, cut: Mask) -> Any:
    """The call's mask, in any form ``attention`` takes (a ``Mask``, a bool tensor, what
    ``masks.from_torch`` returns, None), with a knockout joined to it, in the same form."""
    if isinstance(mask, TorchMasks):  # from masks.from_torch: the additive part stays apart
        return TorchMasks(_joined(mask.mask, cut), mask.bias)
    if isinstance(mask, Tensor):
        mask = dense(mask)
    return cut if mask is None else mask & cut


def _keep(cap: Capture, layer: int, weights: Tensor) -> None:
    """Weights, or statistics reduced from them, into the capture."""
    if not cap.stat_names:
        cap.record(layer, weights)
        return
    b, h, length_q, length_k = weights.shape
    reducer = Reducer(cap.stat_names, cap.window, (b, h, length_q, length_k),
                      stat_dtype(weights.dtype), weights.device)  # fmt: skip
    reducer.add(weights, 0)
    cap.record_stats(layer, reducer.result())


def _patched(
    out: Tensor, block: Edit, layer: int, query: Tensor, key: Tensor, value: Tensor
) -> Tensor:
    """``out`` with the block's heads replaced by captured weights times this call's values."""
    assert block.source is not None and block.heads is not None
    captured = block.source.weights[layer]
    _check_patch(captured, layer, query, key)
    index = torch.tensor(block.heads, device=out.device)
    group = query.shape[1] // value.shape[1]
    values = value[:, index // group]  # (B, h, S, D_v): the key/value head each one reads
    mixed = torch.matmul(captured.to(values.dtype), values)
    out = out.clone()
    out[:, index] = mixed.to(out.dtype)
    return out


def _shape(t: Tensor) -> str:
    return str(tuple(t.shape))


def _check_patch(weights: Tensor, layer: int, query: Tensor, key: Tensor) -> None:
    b, length_q, length_k = query.shape[0], query.shape[2], key.shape[2]
    if weights.shape[0] != b or tuple(weights.shape[2:]) != (length_q, length_k):
        raise ValueError(
            f"patch: the captured weights of layer {layer} have shape {_shape(weights)} "
            f"(B, heads, L, S), this call needs B={b}, L={length_q}, S={length_k}; patch "
            "inputs of the captured batch size and length. Received: captured "
            f"{_shape(weights)}, call (B, L, S)=({b}, {length_q}, {length_k})"
        )
