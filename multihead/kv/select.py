"""The one selection function: (policy, scores, the cache's slots) -> the slots each KV head
keeps. transformers' caches (``multihead.hf.compress``) and the library's ``KVCache`` both
call it, so a policy means the same thing in both worlds.

A cache's slots are described by the original position each holds (``positions``), whether
it may be kept at all (``valid``: False for padding and for keys no later query can see) and
the scores the policy ranks by. Every policy keeps, per batch row, the first ``sinks`` valid
positions and its recent window whatever the scores say; the rest of the budget goes to the
highest scores (StreamingLLM: to the newest positions).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .policies import Policy, SnapKV, StreamingLLM

__all__ = ["Selection", "select", "sink_bound"]

# AdaKV's safeguard: every head keeps at least this share of the uniform budget's scored part
# (Feng et al. 2024 use 0.2 in their experiments)
_ADAPTIVE_FLOOR = 0.2


class Selection:
    """The slots kept: ``index`` (B, H_kv, n) into the slot axis, ordered by position, and
    ``ok`` (B, H_kv, n) bool, False where a head keeps fewer than n (adaptive budgets, or a
    row with fewer valid keys than the budget); None when every slot of ``index`` is kept."""

    def __init__(self, index: Tensor, ok: Tensor | None) -> None:
        self.index, self.ok = index, ok


def sink_bound(valid: Tensor, sinks: int) -> Tensor:
    """(B,): one past the position of each row's ``sinks``-th valid key (positions below it are
    the row's sinks). ``valid``: (B, S) over positions 0..S-1."""
    if sinks == 0:
        return torch.zeros(valid.shape[0], dtype=torch.long, device=valid.device)
    counted = valid.long().cumsum(-1)  # (B, S)
    reached = counted >= sinks
    # the first position where the count reaches `sinks`, or S where it never does
    first = torch.where(reached.any(-1), reached.long().argmax(-1), valid.shape[-1] - 1)
    return first + 1


def select(
    policy: Policy,
    *,
    scores: Tensor | None,
    positions: Tensor,
    valid: Tensor,
    sinks_end: Tensor,
    ends: Tensor,
    budget: int,
) -> Selection:
    """The slots to keep of a cache with m slots per KV head.

    Args:
        policy: the policy (its ``window_size`` is the recent window kept whatever the
            scores; SnapKV's scores are max-pooled over ``pool`` neighbours first, then, with
            ``span`` > 1, ranked span by span (``_spans``) or, with ``spans="centred"``, summed
            over the heads and max-pooled over the span around each position (``_centred``)).
        scores: (B, H_kv, m) what the policy ranks by (higher: keep), or None for StreamingLLM.
            SnapKV's pooling reads neighbouring slots, so its slots must be in position order
            (the prompt's cache, before any eviction).
        positions: (B, H_kv, m) int64, the original position each slot holds.
        valid: (B, H_kv, m) bool, the slots that may be kept.
        sinks_end: (B,) int64, positions below it are the row's sinks (``sink_bound``).
        ends: (B,) int64, each row's uncompressed length (its positions are below it); the
            recent window is positions >= end - window.
        budget: keys kept per KV head (uniform), or on average per KV head (adaptive).

    Returns:
        A ``Selection``.
    """
    h, m = valid.shape[1:]
    forced = valid & (
        (positions < sinks_end[:, None, None])
        | (positions >= (ends - policy.window_size)[:, None, None])
    )
    if isinstance(policy, StreamingLLM) or scores is None:
        rank = positions.to(torch.float64)
    else:
        rank = scores.to(torch.float64)
        if isinstance(policy, SnapKV) and policy.pool > 1:
            rank = F.max_pool1d(rank, policy.pool, stride=1, padding=policy.pool // 2)
        if policy.span > 1 and policy.spans == "centred":
            rank = _centred(rank, positions, valid, policy.span)
        elif policy.span > 1:
            rank = _spans(rank, positions, valid, policy.span)
    budget = min(budget, m)
    if policy.budget == "adaptive" and h > 1 and scores is not None:
        keep = _adaptive(rank, forced, valid, budget)
    else:
        keep = _uniform(rank, forced, valid, budget)
    return _ordered(keep, positions)


def _spans(rank: Tensor, positions: Tensor, valid: Tensor, span: int) -> Tensor:
    """(B, H_kv, m): each slot ranked by its span's score, the mean of ``rank`` over the valid
    (KV head, slot) pairs of the row whose positions lie in the span (span c: positions
    c * span to c * span + span - 1). Every head of a row sees the same span scores, and the
    stable sort that follows keeps a span's slots together (equal ranks, in slot order), so
    the budget is filled span by span, the last one cut where the budget ends in it."""
    b = rank.shape[0]
    chunk = (positions // span).flatten(1)  # (B, H_kv * m)
    count = int(chunk.max()) + 1 if chunk.numel() else 1
    use = valid.flatten(1)
    total = rank.new_zeros(b, count).scatter_add_(
        1, chunk, torch.where(use, rank.flatten(1), torch.zeros_like(rank.flatten(1)))
    )
    seen = rank.new_zeros(b, count).scatter_add_(1, chunk, use.to(rank.dtype))
    mean = total / seen.clamp(min=1)
    return mean.gather(1, chunk).view_as(rank)


def _centred(rank: Tensor, positions: Tensor, valid: Tensor, span: int) -> Tensor:
    """(B, H_kv, m): the scores summed over the row's valid (KV head, slot) pairs at each
    position, then max-pooled over the ``span`` positions centred on it (``span + 1`` when
    even), the same in every head: each high score keeps the positions around it. Pooled by
    position, as ``_spans`` groups by position, so that after an eviction a score does not
    reach across the gap to kept keys far from it."""
    b = rank.shape[0]
    width = int(positions.max()) + 1 if positions.numel() else 1
    pos, use = positions.flatten(1), valid.flatten(1)
    zero = torch.zeros((), dtype=rank.dtype, device=rank.device)
    total = rank.new_zeros(b, width).scatter_add_(1, pos, torch.where(use, rank.flatten(1), zero))
    held = rank.new_zeros(b, width).scatter_add_(1, pos, use.to(rank.dtype)) > 0
    shared = torch.where(held, total, torch.full_like(total, -torch.inf))
    kernel = span | 1
    pooled = F.max_pool1d(shared[:, None], kernel, stride=1, padding=kernel // 2)[:, 0]
    return pooled.gather(1, pos).view_as(rank)


def _uniform(rank: Tensor, forced: Tensor, valid: Tensor, budget: int) -> Tensor:
    """(B, H_kv, m) bool: each head's forced slots and its highest-ranked others, ``budget`` in
    all (fewer where fewer are valid)."""
    priority = torch.where(valid, rank, torch.full_like(rank, -torch.inf))
    priority = torch.where(forced, torch.full_like(rank, torch.inf), priority)
    # a stable sort: among equal ranks the earlier slot (slots are in position order) wins
    top = priority.sort(dim=-1, descending=True, stable=True).indices[..., :budget]
    keep = torch.zeros_like(valid)
    keep.scatter_(-1, top, True)
    return keep & valid


def _adaptive(rank: Tensor, forced: Tensor, valid: Tensor, budget: int) -> Tensor:
    """(B, H_kv, m) bool: the forced slots, then a floor of each head's own best, then the
    layer's remaining budget to the highest scores across its heads, each head's scores
    normalized to sum 1 over its candidates (so a head whose mass sits on few keys needs few)."""
    b, m = valid.shape[0], valid.shape[2]
    candidate = valid & ~forced
    free = (budget - forced.sum(-1)).clamp(min=0)  # (B, H): the uniform scored share
    mass = torch.where(candidate, rank.clamp(min=0), torch.zeros_like(rank))
    norm = mass / mass.sum(-1, keepdim=True).clamp(min=1e-30)
    norm = torch.where(candidate, norm, torch.full_like(norm, -torch.inf))
    floor = (free.to(torch.float64) * _ADAPTIVE_FLOOR).floor().long()  # (B, H)
    order = norm.sort(dim=-1, descending=True, stable=True).indices
    ranks = torch.empty_like(order)
    ranks.scatter_(-1, order, torch.arange(m, device=order.device).expand_as(order))
    chosen = candidate & (ranks < floor[..., None])
    left = (free - floor).sum(-1)  # (B,): what the layer shares out across heads
    pooled = torch.where(chosen, torch.full_like(norm, -torch.inf), norm).flatten(1)
    for row in range(b):
        count = int(min(int(left[row]), int(torch.isfinite(pooled[row]).sum())))
        if count > 0:
            top = pooled[row].sort(descending=True, stable=True).indices[:count]
            chosen[row].view(-1)[top] = True
    return forced | (chosen & candidate)


def _ordered(keep: Tensor, positions: Tensor) -> Selection:
    """The kept slots as (B, H_kv, n) indices in position order, with ``ok`` where heads keep
    different numbers."""
    counts = keep.sum(-1)
    n = int(counts.max()) if counts.numel() else 0
    big = torch.iinfo(torch.long).max
    key = torch.where(keep, positions, torch.full_like(positions, big))
    order = key.argsort(-1)[..., :n]
    ok = None
    if bool((counts != n).any()):
        ok = torch.arange(n, device=keep.device) < counts[..., None]
    return Selection(order, ok)
