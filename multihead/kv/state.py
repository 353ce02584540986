"""One layer's compressed cache: the kept keys and values, the original position of each slot,
and the scores a policy keeps ranking by. transformers' caches (``multihead.hf.compress``) and
the library's ``KVCache`` hold one per layer; both ask the same questions of it.

Keys are cached after the rotary embedding, so a kept key keeps its position; new tokens are
appended at the positions the uncompressed sequence gives them (``total`` counts them), and a
mask made for the uncompressed sequence is read at the kept positions (``slot_mask``). The
tensors are gathered into smaller ones when keys are evicted: the memory is freed, not masked.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .policies import Policy
from .select import select, sink_bound

__all__ = ["LayerState", "causal_band", "grouped", "request"]

# evicted slots hidden in place before a decoding cache is gathered anew: the gather copies
# the whole layer, so it runs once every this many evictions rather than at every step
_SLACK = 32


def request(policy: Policy, state: LayerState | None, rows: int) -> tuple[str, int | None] | None:
    """The protocol's first verb: the statistic a call of ``rows`` query rows computes for
    ``policy``, as ``(name, window)`` (what ``multihead.attention_stats`` takes), or None.

    A call that fills the cache (``state`` None: the prompt, or its first chunk) or adds
    several tokens to it (a later chunk) computes the policy's own statistic: SnapKV the
    attention of its last ``window`` rows (the chunk's last rows), TOVA of the last row, H2O
    of every row. A decoding step (one row) computes one only for the policies that evict as
    they decode (H2O: its row's mass, TOVA: its row); StreamingLLM never needs one.
    """
    stat = policy.prompt_stat
    if stat is None:
        return None
    filling = state is None or rows > 1
    if not filling and not policy.evicts_while_decoding:
        return None
    if stat == "key_mass":
        return ("key_mass", None)
    window = getattr(policy, "window", 1) if filling else 1
    return ("window_mass", max(1, min(int(window), rows)))


def causal_band(seen: Tensor) -> bool:
    """Whether a slot mask (B|1, H|1, L, n) bool is the bottom-right causal band: each query
    sees every slot before the call's own keys and those up to itself (a chunk over kept
    slots that all precede it). Its callers then hand the kernel the causal mask, whose tiles
    are known, instead of a dense one."""
    length_q, n = seen.shape[-2:]
    if length_q > n:
        return False
    band = torch.ones(length_q, n, dtype=torch.bool, device=seen.device).tril(n - length_q)
    return bool((seen == band).all())


def grouped(scores: Tensor, kv_heads: int) -> Tensor:
    """(B, H, S) per query head -> (B, H_kv, S) summed over each KV head's group (query head h
    reads KV head h // (H // H_kv))."""
    b, h, s = scores.shape
    return scores.reshape(b, kv_heads, h // kv_heads, s).sum(2)


class LayerState:
    """The compressed cache of one layer.

    Attributes:
        policy: the policy it follows.
        budget: the keys each KV head keeps (on average, with adaptive budgets): a token
            budget as given, a fraction of every token seen so far (prompt, chunks and
            decoded tokens), so that ``keep=1.0`` never evicts.
        keys, values: (B, H_kv, n, D) and (B, H_kv, n, D_v), the kept slots.
        positions: (B, H_kv, n) int64, the original position of each slot.
        ok: (B, H_kv, n) bool, False at slots a head does not use (heads that keep fewer than
            n), or None when every slot is used.
        scores: (B, H_kv, n) float64, what the policy ranks by (H2O: accumulated attention;
            TOVA: the newest row's), or None.
        sinks_end: (B,) positions below it are each row's sinks.
        ends: (B,) each row's uncompressed length: its next token takes this position.
        total: the longest row's uncompressed length (every position so far is below it).
        place: (this layer's index, the model's number of layers), for policies whose
            budget differs between layers (``Policy.per_layer``), or None.
    """

    def __init__(
        self,
        policy: Policy,
        keys: Tensor,
        values: Tensor,
        positions: Tensor,
        sinks_end: Tensor,
        ends: Tensor,
        scores: Tensor | None = None,
        ok: Tensor | None = None,
        place: tuple[int, int] | None = None,
    ) -> None:
        if policy.per_layer and place is None:
            raise ValueError(
                "a policy with per-layer budgets needs each layer's place (its index, the "
                f"number of layers). Received: {policy!r} without place"
            )
        self.policy, self.place = policy, place
        self.keys, self.values, self.positions = keys, values, positions
        self.sinks_end, self.ends = sinks_end, ends
        self.total = int(ends.max()) if ends.numel() else 0
        self.scores, self.ok = scores, ok

    @classmethod
    def from_prompt(
        cls,
        policy: Policy,
        keys: Tensor,
        values: Tensor,
        scores: Tensor | None,
        valid: Tensor,
        ends: Tensor | None = None,
        place: tuple[int, int] | None = None,
    ) -> LayerState:
        """The prompt's cache compressed to the policy's budget.

        Args:
            keys, values: (B, H_kv, S, D) the whole prompt's, slot s holding position s.
            scores: (B, H_kv, S) what the policy ranks by (None for StreamingLLM).
            valid: (B, S) bool, the keys a later token can see (False for padding).
            ends: (B,) where each row's next token goes (default S for every row: left
                padding, as transformers pads; right-padded rows pass their lengths).
            place: (layer index, number of layers), needed by per-layer budgets.
        """
        b, kv_heads, length = keys.shape[:3]
        positions = torch.arange(length, device=keys.device).expand(b, kv_heads, length)
        sinks_end = sink_bound(valid, policy.sinks)
        if ends is None:
            ends = torch.full((b,), length, dtype=torch.long, device=keys.device)
        state = cls(policy, keys, values, positions, sinks_end, ends, place=place)
        state.scores = None if scores is None else scores.to(torch.float64)
        valid_slots = valid[:, None, :].expand(b, kv_heads, length)
        state._keep(valid_slots, force=not bool(valid.all()))
        return state

    @property
    def budget(self) -> int:
        """Keys each KV head keeps now: the policy's budget of every token seen so far (this
        layer's, with per-layer budgets)."""
        if self.place is None:
            return self.policy.budget_for(self.total)
        return self.policy.budget_for(self.total, *self.place)

    @property
    def length(self) -> int:
        """Slots per KV head."""
        return self.keys.shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes of the kept keys and values."""
        return self.keys.nbytes + self.values.nbytes

    def append(
        self, keys: Tensor, values: Tensor, counts: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Add the new tokens' keys and values (B, H_kv, L, D) at the next positions; returns
        the whole cache. ``counts`` (B,): the real new tokens of each row, the first of its L
        (right padding: the rest are hidden slots, given back at the next shrink); default L
        for every row."""
        b, kv_heads, new = keys.shape[:3]
        ar = torch.arange(new, device=keys.device)
        fresh = self.ends[:, None] + ar  # (B, L)
        real = None if counts is None else ar[None] < counts[:, None]
        if real is not None:
            fresh = torch.where(real, fresh, 0)  # a padding slot holds no position
        if self.ok is not None or real is not None:
            added = (
                torch.ones(b, kv_heads, new, dtype=torch.bool, device=keys.device)
                if real is None
                else real[:, None].expand(b, kv_heads, new)
            )
            self.ok = torch.cat([self._valid(), added], dim=2)
        self.keys = torch.cat([self.keys, keys], dim=2)
        self.values = torch.cat([self.values, values], dim=2)
        self.positions = torch.cat([self.positions, fresh[:, None].expand(b, kv_heads, new)], 2)
        if self.scores is not None:
            self.scores = torch.cat([self.scores, self.scores.new_zeros(b, kv_heads, new)], 2)
        if counts is None:  # a decoding step: no read of the device
            self.ends, self.total = self.ends + new, self.total + new
        else:
            self.ends = self.ends + counts.to(self.ends.device)
            self.total = int(self.ends.max()) if self.ends.numel() else 0
        return self.keys, self.values

    def observe(self, scores: Tensor | None, rows: int = 1) -> None:
        """The protocol's second verb: a call's scores over the slots (B, H_kv, n), or None
        where ``request`` asked for none, taken in (added up for H2O, in place of the last
        for SnapKV and TOVA), then the cache cut back to its budget after a call of several
        rows (the prompt's chunks) and after every decoding step of a policy that evicts as
        it decodes."""
        if scores is not None:
            step = scores.to(torch.float64)
            if self.policy.prompt_stat == "key_mass" and self.scores is not None:
                self.scores = self.scores + step
            else:
                self.scores = step
        if rows > 1 or self.policy.evicts_while_decoding:
            self.shrink(whole=rows > 1)

    def shrink(self, *, whole: bool = False) -> None:
        """Evict down to the budget. While decoding an evicted slot is hidden at once
        (``ok``) and its memory given back when ``_SLACK`` slots are hidden: one gather of the
        cache every ``_SLACK`` steps rather than at every step; ``whole`` (after a chunk)
        gives the memory back at once."""
        valid = self._valid()
        if int(valid.sum(-1).max()) <= self.budget:
            if whole and self.ok is not None and not bool(self.ok.all()):
                self._keep(valid, force=True)  # the chunk's padding slots
            return
        chosen = select(
            self.policy, scores=self.scores, positions=self.positions, valid=valid,
            sinks_end=self.sinks_end, ends=self.ends, budget=self.budget,
        )  # fmt: skip
        used = torch.ones_like(chosen.index, dtype=torch.bool) if chosen.ok is None else chosen.ok
        keep = torch.zeros_like(valid).scatter_(2, chosen.index, used) & valid
        if whole or self.length - self.budget >= _SLACK:
            self._keep(keep, force=True)
        else:
            self.ok = keep

    def _valid(self) -> Tensor:
        if self.ok is not None:
            return self.ok
        return torch.ones(self.positions.shape, dtype=torch.bool, device=self.keys.device)

    def _keep(self, valid: Tensor, *, force: bool) -> None:
        if self.length <= self.budget and not force:
            return
        chosen = select(
            self.policy, scores=self.scores, positions=self.positions, valid=valid,
            sinks_end=self.sinks_end, ends=self.ends, budget=self.budget,
        )  # fmt: skip
        index = chosen.index
        self.positions = self.positions.gather(2, index)
        self.keys = _gather_rows(self.keys, index)
        self.values = _gather_rows(self.values, index)
        if self.scores is not None:
            self.scores = self.scores.gather(2, index)
        ok = valid.gather(2, index)
        if chosen.ok is not None:
            ok = ok & chosen.ok
        self.ok = None if bool(ok.all()) else ok

    def slot_mask(self, dense: Tensor | None, heads: int) -> Tensor | None:
        """What a call's queries may see of the slots: ``dense`` (broadcastable to
        (B, H, L, total), the mask made for the uncompressed sequence, or None: everything)
        read at each slot's position, and unused slots hidden. (B, H, L, n) bool, or None when
        every slot is visible."""
        if dense is None and self.ok is None:
            return None
        b, kv_heads, n = self.positions.shape
        group = heads // kv_heads
        if dense is None:
            assert self.ok is not None
            return self.ok.repeat_interleave(group, dim=1)[:, :, None, :]
        length_q = dense.shape[-2]
        full = dense.expand(b, heads, length_q, dense.shape[-1])
        where = self.positions.repeat_interleave(group, dim=1)[:, :, None, :]
        seen = full.gather(3, where.expand(b, heads, length_q, n))
        if self.ok is not None:
            seen = seen & self.ok.repeat_interleave(group, dim=1)[:, :, None, :]
        return seen

    def slot_mask_of(self, mod: Callable[..., Tensor], heads: int, rows: int) -> Tensor | None:
        """``slot_mask`` from a predicate ``mod(b, h, q_idx, kv_idx) -> bool`` (a mask's
        ``mask_mod`` for the call's rows over the uncompressed sequence, the same for every
        query head) evaluated at the kept positions alone: (B, H, L, n) bool without the
        (L, total) dense mask, or None when every slot is visible. It is evaluated once per KV
        head (at its group's first query head), one block of rows at a time, so that its
        integer intermediates stay near the size of the bool result."""
        b, kv_heads, n = self.positions.shape
        group = heads // kv_heads
        device = self.positions.device
        where = self.positions[:, :, None, :]  # (B, H_kv, 1, n)
        batch = torch.arange(b, device=device)[:, None, None, None]
        first = (torch.arange(kv_heads, device=device) * group)[None, :, None, None]
        seen = torch.empty(b, kv_heads, rows, n, dtype=torch.bool, device=device)
        step = max(1, (1 << 22) // max(1, b * kv_heads * n))
        for top in range(0, rows, step):
            q = torch.arange(top, min(top + step, rows), device=device)[None, None, :, None]
            seen[:, :, top : top + step] = mod(batch, first, q, where)
        if self.ok is not None:
            seen &= self.ok[:, :, None, :]
        elif bool(seen.all()):
            return None
        return seen.repeat_interleave(group, dim=1)

    def kept(self) -> Tensor | list[list[Tensor]]:
        """The positions each KV head keeps, ascending: (B, H_kv, n), or where heads keep
        different numbers (adaptive budgets, padded rows) a list over batch rows of lists over
        KV heads of 1-D tensors."""
        if self.ok is None:
            return self.positions.sort(dim=2).values
        counts = self.ok.sum(-1)
        hidden = torch.iinfo(torch.long).max  # sorts after every position
        ordered = torch.where(self.ok, self.positions, hidden).sort(dim=2).values
        if bool((counts == counts.flatten()[0]).all()):
            return ordered[..., : int(counts.flatten()[0])]
        return [[ordered[r, h][: int(counts[r, h])] for h in range(ordered.shape[1])]
                for r in range(ordered.shape[0])]  # fmt: skip


def _gather_rows(tensor: Tensor, index: Tensor) -> Tensor:
    """tensor (B, H_kv, m, D) at slots index (B, H_kv, n) -> (B, H_kv, n, D), contiguous."""
    return tensor.gather(2, index[..., None].expand(*index.shape, tensor.shape[-1]))
