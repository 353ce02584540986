"""``knockout``: attention from chosen query positions to chosen key positions hidden, in
chosen heads; every other pair visible. Joined to a model's own mask with ``&``, the tiles it
empties are skipped like any hidden tile."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch import Tensor

from .. import _geometry as G
from .._validation import check_indices
from .base import _EMPTY, Mask, Tile, TileKind

__all__ = ["knockout", "positions", "reaches", "shifted"]


def positions(name: str, value: object) -> Tensor:
    """Positions as a sorted, distinct int64 tensor: from a list or 1-D tensor of indices,
    or a 1-D bool tensor (True at each chosen position)."""
    if isinstance(value, Tensor):
        if value.dim() != 1:
            raise ValueError(
                f"{name} must be a 1-D tensor of positions or of bools. "
                f"Received: {name} of shape {tuple(value.shape)}"
            )
        if value.dtype == torch.bool:
            return value.nonzero()[:, 0].cpu()
        if value.is_floating_point() or value.is_complex():
            raise TypeError(
                f"{name} must hold integer positions or bools. Received: {name}.dtype={value.dtype}"
            )
        items = value.tolist()
    elif isinstance(value, (list, tuple, range)):
        items = list(value)
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in items):
            raise ValueError(
                f"{name} must be a list of int positions. Received: {name}={value!r}"[:300]
            )
    else:
        raise TypeError(
            f"{name} must be a list of positions, a 1-D index tensor or a 1-D bool tensor. "
            f"Received: {name} of type {type(value).__name__}"
        )
    if not items:
        raise ValueError(f"{name} must name at least one position. Received: {name}={value!r}")
    negative = [x for x in items if x < 0]
    if negative:
        raise ValueError(
            f"{name} must be positions >= 0 (counted from the start of the input). "
            f"Received: {name} with negative entries {negative[:5]}"
        )
    if len(set(items)) != len(items):
        raise ValueError(f"{name} must not repeat a position. Received: {name}={items!r}"[:300])
    return torch.tensor(sorted(items), dtype=torch.long)


class _Knockout(Mask):
    """Pairs (query position in ``queries``, key position in ``keys``) hidden in ``heads``.

    Query row i of an (L, S) problem is position i + S - L (bottom-right alignment: a decoding
    step's one row is the newest position), key j is position j.
    """

    align = "bottom_right"

    def __init__(self, queries: Tensor, keys: Tensor, heads: Tensor | None, num_heads: int | None):
        self.queries, self.keys = queries, keys
        self.heads = heads  # sorted query-head indices, None: every head
        self.num_heads = num_heads

    @property
    def structure_key(self) -> Hashable:
        chosen = None if self.heads is None else tuple(self.heads.tolist())
        return ("knockout", tuple(self.queries.tolist()), tuple(self.keys.tolist()), chosen)

    def _count(self, chosen: Tensor, lo: int, hi: int) -> int:
        """How many chosen positions fall in [lo, hi)."""
        return int(torch.searchsorted(chosen, hi) - torch.searchsorted(chosen, lo))

    def mask_mod(self, length_q, length_k, *, device=None):
        off = G.offset("bottom_right", length_q, length_k)
        size = max(length_q + off, length_k, 1)
        q_hit = torch.zeros(size + 1, dtype=torch.bool, device=device)
        k_hit = torch.zeros(size + 1, dtype=torch.bool, device=device)
        q_hit[self.queries[self.queries < size].to(device)] = True
        k_hit[self.keys[self.keys < size].to(device)] = True
        h_hit = None
        if self.heads is not None:
            h_hit = torch.zeros(self.num_heads or 1, dtype=torch.bool, device=device)
            h_hit[self.heads.to(device)] = True

        def mod(b, h, q_idx, kv_idx):
            hidden = q_hit[(q_idx + off).clamp(0, size)] & k_hit[kv_idx.clamp(0, size)]
            if h_hit is not None:
                hidden = hidden & h_hit[h]
            return ~hidden

        return mod

    def check(self, batch, heads, length_q, length_k):
        if self.num_heads is not None and heads != self.num_heads:
            raise ValueError(
                f"this knockout was built for H={self.num_heads} query heads. "
                f"Received: a call with H={heads}"
            )

    def tile(self, length_q, length_k, q0, q1, *, batch=0):
        if q1 <= q0:
            return _EMPTY
        off = G.offset("bottom_right", length_q, length_k)
        hit_q = self._count(self.queries, q0 + off, q1 + off)
        if hit_q == 0:
            return Tile(0, length_k, TileKind.FULL) if length_k > 0 else _EMPTY
        every = self.heads is None and hit_q == q1 - q0
        if every and self._count(self.keys, 0, length_k) == length_k:
            return _EMPTY
        return Tile(0, length_k, TileKind.PARTIAL)

    def rect_kind(self, length_q, length_k, q0, q1, k0, k1, *, batch=0):
        if q1 <= q0 or k1 <= k0:
            return TileKind.EMPTY
        off = G.offset("bottom_right", length_q, length_k)
        hit_q = self._count(self.queries, q0 + off, q1 + off)
        hit_k = self._count(self.keys, k0, k1)
        if hit_q == 0 or hit_k == 0:
            return TileKind.FULL
        if self.heads is None and hit_q == q1 - q0 and hit_k == k1 - k0:
            return TileKind.EMPTY
        return TileKind.PARTIAL

    def _describe(self):
        heads = "" if self.heads is None else f", heads={self.heads.tolist()}"
        return f"knockout({len(self.queries)} queries, {len(self.keys)} keys{heads})"


def knockout(
    queries: Sequence[int] | Tensor,
    keys: Sequence[int] | Tensor,
    *,
    heads: Sequence[int] | None = None,
    num_heads: int | None = None,
) -> Mask:
    """Hide attention from the query positions ``queries`` to the key positions ``keys``.

    Every other pair stays visible, so ``model_mask & knockout(...)`` is the model's mask with
    that block removed (attention knockout). Query row i of an (L, S) call is position
    i + S - L, as with a KV cache, and key j is position j; for L == S both are the input's
    positions. A query row left with no visible key gives 0, as every hidden row does. For
    queries [1, 2] and keys [0] with L = S = 4::

        # . . .
        . # . .
        . # # .
        # # # #

    Args:
        queries: query positions: a list or 1-D tensor of ints, or a 1-D bool tensor.
        keys: key positions, likewise.
        heads: the query heads the block applies to (None: every head); needs ``num_heads``.
        num_heads: H of the calls the mask is used with (required with ``heads``).

    Raises:
        ValueError, TypeError: positions that are empty, negative, repeated or not integers;
            ``heads`` without ``num_heads`` or outside [0, num_heads).
    """
    q, k = positions("queries", queries), positions("keys", keys)
    chosen = None
    if heads is not None:
        if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
            raise ValueError(
                "heads needs num_heads, the query head count H of the calls the mask is used "
                f"with. Received: num_heads={num_heads!r}"
            )
        picked = check_indices(
            "heads", list(heads) if isinstance(heads, (tuple, range)) else heads, num_heads,
            kind="query-head", every="head", size=f"H={num_heads}",
        )  # fmt: skip
        chosen = torch.tensor(sorted(picked), dtype=torch.long)
    return _Knockout(q, k, chosen, num_heads if heads is not None else None)


def shifted(mask: Mask, offset: int) -> Mask:
    """A knockout for a call whose first key column is position ``offset`` (a sliding-window
    cache that has slid): its query and key positions moved down by ``offset``, those below
    it dropped (keys the cache no longer holds). Any other mask is returned unchanged."""
    if not isinstance(mask, _Knockout) or offset == 0:
        return mask
    q, k = mask.queries, mask.keys
    return _Knockout(q[q >= offset] - offset, k[k >= offset] - offset, mask.heads, mask.num_heads)


def reaches(mask: Mask, length_q: int, length_k: int) -> bool:
    """Whether a call of ``length_q`` query rows over ``length_k`` keys holds one of the
    knockout's query positions and one of its key positions (True for any other mask)."""
    if not isinstance(mask, _Knockout):
        return True
    off = G.offset("bottom_right", length_q, length_k)
    return bool(mask._count(mask.queries, off, off + length_q)) and bool(
        mask._count(mask.keys, 0, length_k)
    )
