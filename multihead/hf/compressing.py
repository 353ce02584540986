"""The calls of a layer whose cache ``compress`` keeps (``multihead.hf.compress``), as the
bridge's attention function hands them to the block (``attend``): one prepared ``Call`` each.

The prompt's call computes the policy's statistic in its own pass (a statistics request of the
call, ``Call.stats``) and compresses the cache at once; a call over the compressed cache reads
the mask (made for the uncompressed sequence) at the kept positions and, for policies that
evict as they decode, reads its scores from the same pass.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor, nn

from .. import acting, decode_route
from ..backends import registry
from ..backends.call import Call, prepare
from ..bias import ScoreModifier
from ..masks import Mask, dense
from . import kv_cache

__all__ = ["attend", "check", "run"]


def attend(
    plan: acting.Plan,
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Mask | None,
    bias: ScoreModifier | None,
    scale: float | None,
    dropout: float,
) -> Tensor:
    """A call of a layer that a ``compress`` block covers, as the bridge's attention function
    hands it over (``Compression.layer_calls``), in transformers' layout (B, L, H, D_v). ``mask``
    is made for the uncompressed sequence, so the call is checked without it."""
    call = prepare(query, key, value, None, bias, scale, dropout, False)
    check(plan, call)
    return run(plan, module, call, mask)


def check(plan: acting.Plan, call: Call) -> None:
    """Refuse what ``compress`` cannot combine with: other blocks on the layer, and scores
    added per (row, key), which cannot be read at the kept positions."""
    others = plan.capture is not None or plan.scales or plan.knockouts or plan.patches
    if others:
        raise ValueError(
            "compress does not combine with capture, ablate, knockout or patch on the same "
            "layer: run them in separate blocks. Received: another block acting on layer "
            f"{plan.layer} inside compress"
        )
    if call.bias is not None:
        raise ValueError(
            "compress reads the mask at the kept positions, which it cannot do for an additive "
            "position bias or a float attention mask. Received: an additive bias "
            f"({getattr(call.bias, 'label', type(call.bias).__name__)})"
        )


def run(plan: acting.Plan, module: nn.Module, call: Call, mask: Mask | None) -> Tensor:
    """A call of a layer whose cache ``compress`` keeps, in transformers' layout
    (B, L, H, D_v): the prompt's call compresses the cache; a later one attends over it.
    ``call`` comes without its mask: ``mask`` is made for the uncompressed sequence."""
    block = plan.compress
    assert block is not None and block.policy is not None
    state = kv_cache.state_of(block, module, plan.layer)
    if state is None:  # the call that filled the cache: the prompt, as long as its mask
        if mask is not None:
            b, h, _, length_q, length_k, _ = call.shape
            mask.check(b, h, length_q, length_k)
        return _prompt(block, plan.layer, module, replace(call, mask=mask))
    policy = block.policy
    heads, length_q, stat = call.query.shape[1], call.query.shape[2], policy.prompt_stat
    dense_full = (
        None if mask is None else mask.to_dense(length_q, state.total, device=call.key.device)
    )
    if dense_full is not None and bool(dense_full.all()):
        dense_full = None  # a causal band over the whole cache: nothing to read per slot
    seen = state.slot_mask(dense_full, heads)
    call = replace(call, mask=None if seen is None else dense(seen))
    if policy.evicts_while_decoding and stat is not None:
        step = "key_mass" if stat == "key_mass" else "window_mass"
        out, found = _with_stat(call, step, 1)
        state.observe(kv_cache.grouped(found[step], call.key.shape[1]))
        return out.transpose(1, 2).contiguous()
    plain = call.mask is None and call.sinks is None and call.dropout_p == 0
    if plain and decode_route.applies(call.query, call.key, call.value):
        out = decode_route.attend(call.query, call.key, call.value, None, call.scale, call.softcap)
    else:
        out = _output(call).transpose(1, 2).contiguous()
    state.shrink()
    return out


def _prompt(block: acting.Compression, layer: int, module: nn.Module, call: Call) -> Tensor:
    """The call that filled a layer's cache (the prompt): its output, with the policy's
    statistic from the same pass, and the cache replaced by its compressed form."""
    policy = block.policy
    assert policy is not None
    b, _, _, length_q, length_k, _ = call.shape
    stat, scores = policy.prompt_stat, None
    if stat is None:
        out = _output(call)
    else:
        out, found = _with_stat(call, stat, getattr(policy, "window", 1))
        scores = found[stat]
    visible = _last_row_visible(call.mask, b, length_q, length_k, call.key.device)
    kv_cache.start(block, module, layer, call.key, call.value, scores, visible)
    return out.transpose(1, 2).contiguous()


def _with_stat(call: Call, stat: str, rows: int) -> tuple[Tensor, dict[str, Tensor]]:
    """The output and one statistic of every head. ``key_mass`` comes from the statistics
    pass over every row; ``window_mass`` of the last ``rows`` of a longer call from the plain
    pass over every row and the statistics pass over those rows alone (the same rows'
    weights, at the cost of ``rows`` rows: SnapKV's 32 of a 4,000-token prompt)."""
    _, _, _, length_q, length_k, _ = call.shape
    if stat != "window_mass" or rows >= length_q or call.sinks is not None:
        window = rows if stat == "window_mass" else None
        out, found = registry.run(replace(call, stats=(stat,), window=window), "auto")
        assert out is not None and isinstance(found, dict)
        return out, found
    out = _output(call)
    first = length_q - rows  # the window's rows, every key; a soft-cap holds for any rows
    crop = (length_q, length_k, first, length_q, 0, length_k)
    window_rows = replace(
        call,
        query=call.query[:, :, first:],
        mask=None if call.mask is None else call.mask.crop(*crop),
        stats=(stat,),
        window=rows,
    )
    _, found = registry.run(window_rows, "auto")
    assert isinstance(found, dict)
    return out, found


def _output(call: Call) -> Tensor:
    out = registry.run(call, "auto")[0]
    assert out is not None
    return out


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
