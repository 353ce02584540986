"""The calls of a layer whose KV cache a policy keeps, in any world that hands the attention
its raw tensors (the transformers bridge's ``compress``): one entry, ``run``, that goes down
to the kernels once per call and back to no higher room.

A ``holder`` carries the layer's ``multihead.kv.LayerState`` (``holder.state``, None until the
call that fills the cache). The call that fills it computes the policy's statistic in the same
kernel pass as its output and sets ``holder.state`` to the compressed cache; a later call (a
chunk, a decoding step) reads the mask, made for the uncompressed sequence, at the kept
positions, computes what ``kv.request`` asks for and hands it to ``LayerState.observe``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from .. import decoding_routes as routes
from ..backends import registry
from ..backends.call import Call, prepare
from ..bias import ScoreModifier
from ..kv import LayerState, Policy, Reconstruction, causal_band, grouped, request
from ..masks import Mask, causal, dense

__all__ = ["run"]


def run(
    policy: Policy,
    holder: Any,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Mask | None,
    bias: ScoreModifier | None,
    scale: float | None,
    dropout: float,
) -> Tensor:
    """One call of a compressed layer, in transformers' layout (B, L, H, D_v). ``mask`` is
    made for the uncompressed sequence, so the call is checked without it. ``holder`` None:
    a layer the policy does not keep (no cache, or transformers' window cache): a plain call.

    The call that fills the cache (``holder.state`` None) runs as long as its mask, with the
    policy's statistic, and sets ``holder.state`` to the compressed cache; a later call (a
    chunk, a decoding step) runs over the kept slots with the mask read at their positions,
    and ``LayerState.observe`` takes its statistic. What the call runs with is settled here;
    ``_attend`` then goes down to the kernels once.

    Raises:
        ValueError: scores added per (row, key) (an additive position bias or float mask),
            which cannot be read at the kept positions.
    """
    state = None if holder is None else holder.state
    batch, heads, rows, _ = query.shape
    length_k = key.shape[2]
    visible = None
    if holder is None:
        used, need = mask, None
    elif state is None:  # the call that fills the cache: as long as its mask
        if isinstance(policy, Reconstruction):
            raise ValueError(
                "Reconstruction scores the context by a second reading of it, which a layer's "
                "call cannot run: compress the context with multihead.hf.compress_context("
                "model, ids, policy), then run questions on that cache under compress. "
                "Received: a prompt's call under compress(model, Reconstruction(...))"
            )
        if mask is not None:
            mask.check(batch, heads, rows, length_k)
        visible = _last_row_visible(mask, batch, rows, length_k, key.device)
        used, need = mask, request(policy, None, rows)
    else:
        seen = _seen(state, mask, heads, rows, key.device)
        used = None if seen is None else causal() if causal_band(seen) else dense(seen)
        need = request(policy, state, rows)
    out, scores = _attend(query, key, value, used, bias, scale, dropout, need)
    if holder is not None:
        kv_scores = None if scores is None else grouped(scores, key.shape[1])
        if state is None:
            assert visible is not None
            holder.state = LayerState.from_prompt(
                policy, key, value, kv_scores, visible, place=getattr(holder, "place", None)
            )
        else:
            state.observe(kv_scores, rows)
    return out.transpose(1, 2).contiguous()


def _seen(
    state: LayerState, mask: Mask | None, heads: int, rows: int, device: torch.device
) -> Tensor | None:
    """What the call's rows may see of the kept slots (``LayerState.slot_mask``): the mask's
    predicate evaluated at the kept positions alone (memory L x kept, not L x the whole
    sequence), or where a mask has none, its dense form read there."""
    if mask is None:
        return state.slot_mask(None, heads)
    per_head = mask.block(rows, state.total, 0, 1, 0, 1, device=device).shape[1] > 1
    try:
        mod = None if per_head else mask.mask_mod(rows, state.total, device=device)
    except NotImplementedError:
        mod = None
    if mod is None:  # a mask that differs between query heads, or one without a predicate
        full = mask.to_dense(rows, state.total, device=device)
        return state.slot_mask(None if bool(full.all()) else full, heads)
    return state.slot_mask_of(mod, heads, rows)


def _attend(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Mask | None,
    bias: ScoreModifier | None,
    scale: float | None,
    dropout: float,
    need: tuple[str, int | None] | None,
) -> tuple[Tensor, Tensor | None]:
    """The output (B, H, L, D_v) and the statistic ``need`` names ((B, H, S) or None), the
    call checked without its mask. ``key_mass`` comes from the statistics pass over every
    row; ``window_mass`` of the last rows of a longer call from the plain pass over every row
    and the statistics pass over those rows alone (the same rows' weights, at the cost of
    ``rows`` rows: SnapKV's 32 of a 4,000-token prompt). A one-row call without a statistic
    takes the decoding step's route."""
    call = replace(_checked(query, key, value, bias, scale, dropout), mask=mask)
    if need is None:
        plain = mask is None and call.sinks is None and call.dropout_p == 0
        if plain and routes.applies(call.query, call.key, call.value):
            return routes.run(call).transpose(1, 2), None
        whole = registry.run(call, "auto")[0]
        assert whole is not None
        return whole, None
    return _with_statistic(call, need[0], need[1] or 1)


def _checked(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    bias: ScoreModifier | None,
    scale: float | None,
    dropout: float,
) -> Call:
    """The call checked without its mask; an additive bias refused (the mask at the kept
    positions is what compress reads)."""
    call = prepare(query, key, value, None, bias, scale, dropout, False)
    if call.bias is not None:
        raise ValueError(
            "compress reads the mask at the kept positions, which it cannot do for an additive "
            "position bias or a float attention mask. Received: an additive bias "
            f"({getattr(call.bias, 'label', type(call.bias).__name__)})"
        )
    return call


def _with_statistic(call: Call, stat: str, rows: int) -> tuple[Tensor, Tensor]:
    """The output and the statistic ``stat`` of a checked call (``window_mass`` over its last
    ``rows`` rows)."""
    _, _, _, length_q, length_k, _ = call.shape
    if stat != "window_mass" or rows >= length_q or call.sinks is not None:
        window = rows if stat == "window_mass" else None
        out, found = registry.run(replace(call, stats=(stat,), window=window), "auto")
        assert out is not None and isinstance(found, dict)
        return out, found[stat]
    first = length_q - rows  # the window's rows, every key; a soft-cap holds for any rows
    crop = (length_q, length_k, first, length_q, 0, length_k)
    mask = call.mask
    window_rows = replace(
        call,
        query=call.query[:, :, first:],
        mask=None if mask is None else mask.crop(*crop),
        stats=(stat,),
        window=rows,
    )
    _, found = registry.run(window_rows, "auto")
    assert isinstance(found, dict)
    whole = registry.run(call, "auto")[0]
    assert whole is not None
    return whole, found[stat]


def _last_row_visible(
    mask: Mask | None, batch: int, length_q: int, length_k: int, device: torch.device
) -> Tensor:
    """(B, S) bool: the keys the prompt's last row may see in any head, which are the keys a
    later token may see (padding and keys past a sliding window are not)."""
    if mask is None:
        return torch.ones(batch, length_k, dtype=torch.bool, device=device)
    last = mask.crop(length_q, length_k, length_q - 1, length_q, 0, length_k)
    seen = last.to_dense(1, length_k, device=device)  # (B|1, H|1, 1, S)
    return seen.any(1)[:, 0].expand(batch, length_k)
