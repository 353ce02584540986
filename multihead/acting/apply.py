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

from dataclasses import replace

import torch
from torch import Tensor

from ..backends import registry
from ..backends._tensors import stat_dtype
from ..backends.call import Call
from ..functional import check_heads
from ..masks.knockout import reaches, shifted
from ..stats import Reducer
from .blocks import Capture, Edit, Plan

__all__ = ["head_output", "pattern", "run_plan"]


def run_plan(plan: Plan, call: Call, *, key_offset: int = 0) -> tuple[Tensor, Tensor | None]:
    """``call`` with what ``plan`` asks, in one run through the registry.

    Args:
        plan: what the active blocks ask of this call (``plan_for(module)``).
        call: the call as its module would run it (``backends.call.prepare``): its
            ``return_weights`` and ``heads`` say which weights the caller reads.
        key_offset: the position of the call's first key column (a sliding-window cache
            that has slid holds positions from there on): knockouts name positions.

    Returns:
        (output (B, H, L, D_v), weights (B, H | len(heads), L, S) when the call asks for
        them, else None). The capture's records are filled on the way.

    Raises:
        ValueError: a patch whose captured weights do not fit this call (both shapes named),
            capture heads outside [0, H), and every error ``multihead.attention`` raises.
    """
    out, seen = pattern(plan, call, key_offset)
    return head_output(plan, out, call), seen


def pattern(plan: Plan, call: Call, key_offset: int = 0) -> tuple[Tensor, Tensor | None]:
    """The point where a plan acts on the weights: knockouts joined to the mask, and the
    one registry call that also gives the capture its weights or statistics. Returns (output,
    the weights the caller reads or None)."""
    call = _knocked_out(plan, call, key_offset)
    cap = plan.capture
    if cap is None:
        return _ran(call)
    heads = None if cap.heads is None else tuple(check_heads(cap.heads, call.shape[1]))
    if not call.return_weights and cap.stat_names and call.dropout_p == 0:
        out, found = _ran(
            replace(call, stats=tuple(cap.stat_names), window=cap.window, heads=heads)
        )
        cap.record_stats(plan.layer, found)  # type: ignore[arg-type]
        return out, None
    if not call.return_weights:  # the capture's heads alone are computed with weights
        out, part = _ran(replace(call, return_weights=True, heads=heads))
        assert part is not None
        _keep(cap, plan.layer, part, call.value)
        return out, None
    out, every = _ran(replace(call, heads=None))
    assert every is not None
    _keep(cap, plan.layer, every if heads is None else every[:, list(heads)], call.value)
    return out, every if call.heads is None else every[:, list(call.heads)]


def head_output(plan: Plan, out: Tensor, call: Call) -> Tensor:
    """The point where a plan acts on each head's output (B, H, L, D_v): patched heads get
    their captured weights times this call's values, ablated heads their scale."""
    for block in plan.patches:
        out = _patched(out, block, plan.layer, call.query, call.key, call.value)
    for scale in plan.scales:
        out = out * scale.to(out.device, out.dtype)[None, :, None, None]
    return out


def _ran(call: Call) -> tuple[Tensor, Tensor | None]:
    out, extra = registry.run(call, "auto")
    if out is None:
        raise RuntimeError("the attention backend returned no output; it must return it")
    return out, extra


def _knocked_out(plan: Plan, call: Call, key_offset: int) -> Call:
    """``call`` with every knockout's mask joined to its own (shifted where the call's keys
    start at ``key_offset``), checked against its shapes; each block notes whether the call
    held one of its pairs."""
    mask = call.mask
    b, h, _, length_q, length_k, _ = call.shape
    for block in plan.knockouts:
        assert block.mask is not None
        cut = block.mask if not key_offset else shifted(block.mask, key_offset)
        block.calls += 1
        block.reached = block.reached or reaches(cut, length_q, length_k)
        mask = cut if mask is None else mask & cut
    if mask is call.mask:
        return call
    assert mask is not None
    mask.check(b, h, length_q, length_k)
    return replace(call, mask=mask)


def _keep(cap: Capture, layer: int, weights: Tensor, values: Tensor) -> None:
    """Weights (and the call's values, where the capture keeps them), or statistics reduced
    from them, into the capture."""
    if not cap.stat_names:
        cap.record(layer, weights, values)
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
