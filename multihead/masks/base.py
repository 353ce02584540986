"""The mask protocol (``Mask``, ``Tile``, ``TileKind``), the ``&`` / ``|`` algebra, crops and
``dense``, the kind every mask can lower to.

``Mask`` answers every question a backend asks (``block``, ``tile``, ``rect_kind``) from its
predicate ``mask_mod`` alone; a kind overrides an answer only where it knows a faster one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch
from torch import Tensor

from .. import _geometry as G
from .. import _validation as V
from .._cache import Bounded
from .._geometry import TileKind

__all__ = ["Mask", "MaskMod", "Tile", "TileKind", "dense"]

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class Tile:
    """The answer for one query tile: keys ``[start, stop)`` hold every visible key.

    ``FULL`` means every (query, key) pair of the tile x ``[start, stop)`` is visible for every
    head; ``EMPTY`` means no query of the tile sees any key (then ``start == stop``).
    """

    start: int
    stop: int
    kind: TileKind


_EMPTY = Tile(0, 0, TileKind.EMPTY)


def _tile(start: int, stop: int, full: bool) -> Tile:
    if stop <= start:
        return _EMPTY
    return Tile(start, stop, TileKind.FULL if full else TileKind.PARTIAL)


class Mask:
    """Base class of every mask.

    A mask describes itself, so backends never ask which class they were given:

    * ``mask_mod(L, S)``: the predicate (b, h, q_idx, kv_idx) -> bool, in the form of
      FlexAttention's ``mask_mod`` (index tensors broadcast against each other);
    * ``block`` / ``to_dense``: any rectangle lowered to a bool tensor;
    * ``tile``: per query tile, the visible key range and whether it is empty, partial or full;
    * ``rect_kind``: whether any rectangle (queries x keys) is empty, partial or full;
    * ``structure_key``: a hashable key when the mask's pattern depends only on (L, S) (plans
      can be cached under it), else None;
    * hints for planners: ``tile_rows``, ``blocks``, ``torch_is_causal``, ``arbitrary``,
      ``rows_alike``.

    A subclass states its rule once, in ``mask_mod``: ``block`` evaluates it on index grids,
    and ``tile`` / ``rect_kind`` come from a summary of it computed tile by tile once per
    (L, S) and cached (never holding L x S at once). A kind overrides an answer only where it
    knows a faster one; the hints have safe defaults. A new mask kind is one subclass (or one
    ``masks.predicate(fn)``): no backend changes.
    """

    batch_size: int | None = None  # B fixed by the mask's tensors, None = any
    num_heads: int | None = None  # H fixed by the mask's tensor, None = any
    align: str | None = None  # "bottom_right" / "top_left" for masks tied to the diagonal
    arbitrary: bool = False  # an unstructured tensor: little to skip, dense kernels suit it
    # every query row sees the same keys, for any number of rows L (padding of the keys): a
    # call may stack more query rows under the same mask (decoding folds grouped heads so)
    rows_alike: bool = False
    _home: torch.device | None = None  # where the mask's own tensors live (None: anywhere)

    def mask_mod(
        self, length_q: int, length_k: int, *, device: torch.device | str | None = None
    ) -> MaskMod:
        """The predicate ``(b, h, q_idx, kv_idx) -> bool`` (True = may attend) for (L, S).

        Arguments are integer tensors on ``device`` that broadcast against each other (as
        FlexAttention passes them); the result has their broadcast shape.
        """
        raise NotImplementedError

    @property
    def structure_key(self) -> Hashable | None:
        """A hashable description of the pattern when it depends only on (L, S), else None."""
        return None

    def tile_rows(self, length_q: int, length_k: int) -> int | None:
        """Query rows per tile that suit this mask (None: no preference)."""
        return None

    def blocks(
        self, length_q: int, length_k: int, *, batch: int = 0
    ) -> list[tuple[int, int, int, int]] | None:
        """The visible set of batch entry ``batch`` as disjoint fully visible rectangles
        ``(q0, q1, k0, k1)`` when it is exactly that (packed documents), else None."""
        return None

    def torch_is_causal(self, length_q: int, length_k: int) -> bool:
        """True when the mask is exactly torch's ``is_causal=True`` (top-left) for (L, S)."""
        return False

    def visible_distances(
        self, length_q: int, length_k: int
    ) -> tuple[int | None, int | None] | None:
        """``(lo, hi)`` when query i sees key j exactly if lo <= j - i <= hi (None: unbounded)
        for every batch entry and head, as for causal and sliding-window bands; else None."""
        return None

    def crop(self, length_q: int, length_k: int, q0: int, q1: int, k0: int, k1: int) -> Mask:
        """The part of this mask for queries [q0, q1) and keys [k0, k1) of an (L, S) problem,
        as a mask of its own for a (q1 - q0, k1 - k0) problem: one shard of a longer sequence
        (context parallelism) sees exactly what it sees in the whole."""
        return _Crop(self, length_q, length_k, q0, q1, k0, k1)

    def check(self, batch: int, heads: int, length_q: int, length_k: int) -> None:
        """Raise ValueError if this mask cannot be used with (B, H, L, S)."""
        for what, letter, fixed, got in (
            ("batch size", "B", self.batch_size, batch),
            ("head count", "H", self.num_heads, heads),
        ):
            if fixed is not None and fixed not in (1, got):
                raise ValueError(
                    f"this mask is built for a {what} of {fixed} but the inputs have "
                    f"{letter}={got}; build it for {letter}={got}. Received: {letter}={got}"
                )

    def block(
        self,
        length_q: int,
        length_k: int,
        q0: int,
        q1: int,
        k0: int,
        k1: int,
        *,
        batch: int | None = None,
        device: torch.device | str | None = None,
    ) -> Tensor:
        """Bool tensor for queries ``[q0, q1)`` x keys ``[k0, k1)``.

        Shape broadcastable to (B, H, q1 - q0, k1 - k0): dimensions the mask does not depend on
        have size 1. With ``batch=b`` only batch entry b is returned (batch dimension 1).
        """
        device = device if device is not None else self._home
        if self.batch_size is None:
            b = torch.zeros(1, dtype=torch.long, device=device)
        elif batch is None:
            b = torch.arange(self.batch_size, device=device)
        else:
            b = torch.tensor([batch], device=device)
        heads = self.num_heads or 1
        h = torch.arange(heads, device=device)
        shape = (b.numel(), heads, q1 - q0, k1 - k0)
        mod = self.mask_mod(length_q, length_k, device=device)
        return _evaluate(mod, b, h, _arange(q0, q1, device), _arange(k0, k1, device), shape)

    def tile(self, length_q: int, length_k: int, q0: int, q1: int, *, batch: int = 0) -> Tile:
        """Visible key range and kind for query rows ``[q0, q1)`` of batch entry ``batch``."""
        if q1 <= q0:
            return _EMPTY
        s = self._summary(length_q, length_k, batch)
        rows = slice(q0 // _CELL, -(-q1 // _CELL))
        start, stop = int(s.first[rows].min()), int(s.last[rows].max()) + 1
        if stop <= start:
            return _EMPTY
        # cells that are wholly visible make every sub-rectangle of them visible
        full = bool(s.every[rows, start // _CELL : -(-stop // _CELL)].all())
        return _tile(start, stop, full)

    def rect_kind(
        self,
        length_q: int,
        length_k: int,
        q0: int,
        q1: int,
        k0: int,
        k1: int,
        *,
        batch: int = 0,
    ) -> TileKind:
        """How much of queries ``[q0, q1)`` x keys ``[k0, k1)`` of batch entry ``batch`` is
        visible, over every head, without lowering the rectangle.

        ``EMPTY``: no (query, key) pair is visible; ``FULL``: every pair is; ``PARTIAL``: some
        are, or the mask cannot tell cheaply. The answer is never wrong in the direction that
        matters: a rectangle called EMPTY holds nothing visible and one called FULL nothing
        hidden (block-sparse kernels skip the first and drop the mask on the second).

        The default is exact for bands (``visible_distances``) and otherwise exact to the cells
        of the cached summary of ``mask_mod``; masks that can answer exactly and cheaply
        override it.
        """
        if q1 <= q0 or k1 <= k0:
            return TileKind.EMPTY
        band = self.visible_distances(length_q, length_k)
        if band is not None:
            return G.band_kind(band, q0, q1, k0, k1)
        s = self._summary(length_q, length_k, batch)
        cells = (slice(q0 // _CELL, -(-q1 // _CELL)), slice(k0 // _CELL, -(-k1 // _CELL)))
        return _kind(bool(s.some[cells].any()), bool(s.every[cells].all()))

    def _rect_from_tile(
        self, length_q: int, length_k: int, q0: int, q1: int, k0: int, k1: int, batch: int
    ) -> TileKind:
        """A conservative rect_kind from ``tile`` alone (no evaluation of the predicate)."""
        if q1 <= q0 or k1 <= k0:
            return TileKind.EMPTY
        t = self.tile(length_q, length_k, q0, q1, batch=batch)
        if t.kind == TileKind.EMPTY or k1 <= t.start or k0 >= t.stop:
            return TileKind.EMPTY
        if t.kind == TileKind.FULL and t.start <= k0 and k1 <= t.stop:
            return TileKind.FULL
        return TileKind.PARTIAL

    def to_dense(
        self, length_q: int, length_k: int, *, device: torch.device | str | None = None
    ) -> Tensor:
        """The whole mask as a bool tensor broadcastable to (B, H, L, S)."""
        return self.block(length_q, length_k, 0, length_q, 0, length_k, device=device)

    def to_string(
        self,
        length_q: int,
        length_k: int,
        *,
        batch: int = 0,
        head: int = 0,
        rows: int | None = None,
        cols: int | None = None,
    ) -> str:
        """Draw the mask for one batch entry and head: ``#`` may attend, ``.`` may not.

        ``rows`` and ``cols`` limit the drawing to the top-left corner of the (L, S) mask
        (the first ``rows`` queries and ``cols`` keys); by default the whole mask is drawn.
        """
        rows = length_q if rows is None else min(rows, length_q)
        cols = length_k if cols is None else min(cols, length_k)
        keep = self.block(length_q, length_k, 0, rows, 0, cols, batch=batch)
        keep = keep[0, min(head, keep.shape[1] - 1)].expand(rows, cols)
        return "\n".join("".join("#" if x else "." for x in row) for row in keep.tolist())

    def memo(self, namespace: str, size: int) -> Bounded:
        """The table ``namespace`` of state derived from this mask (plans, summaries, decoding
        routes), kept on the mask itself: made on first use with room for ``size`` entries
        (the least recently used forgotten first), collected with the mask. A mask does not
        change once made, so what is kept is never stale. Values may refer to the mask.

        Raises:
            ValueError: ``namespace`` was made with another ``size``.
        """
        memos = self.__dict__.get("_memos")
        if memos is None:
            memos = self.__dict__["_memos"] = {}
        table = memos.get(namespace)
        if table is None:
            table = memos[namespace] = Bounded(size)
        elif table.maxsize != size:
            raise ValueError(
                f"the memo {namespace!r} of this mask holds {table.maxsize} entries; ask for it "
                f"with that size. Received: size={size}"
            )
        return table

    def _summary(self, length_q: int, length_k: int, batch: int) -> _Summary:
        """The summary of ``mask_mod`` for (L, S) and one batch entry (memoized)."""
        key = (length_q, length_k, batch if self.batch_size not in (None, 1) else 0)
        return self.memo("summaries", _CACHED_SHAPES).make(
            key, lambda: _summarize(self, length_q, length_k, key[2])
        )

    def __and__(self, other: Mask) -> Mask:
        return _Combine(self, _as_mask(other), "&")

    def __or__(self, other: Mask) -> Mask:
        return _Combine(self, _as_mask(other), "|")

    def _describe(self) -> str:
        raise NotImplementedError

    def _natural_size(self) -> tuple[int | None, int | None]:
        """The (L, S) this mask's own tensors fix, None for an axis they leave free."""
        return None, None

    def _least_size(self) -> tuple[int, int]:
        """The smallest (L, S) this mask is valid for (lengths bound them from below)."""
        return 0, 0

    def __repr__(self) -> str:
        text = self._describe()
        try:
            natural = self._natural_size()
        except ValueError as err:  # combined masks whose tensors disagree on L or S
            return f"{text}\n  (not drawn: {err})"
        length_q, length_k = _picture_size(natural, self._least_size())
        # the whole mask, each character standing for a step_q x step_k block when it is larger
        # than the picture: a corner of a large mask is often all visible and shows nothing
        step_q, step_k = -(-length_q // _DRAW_MAX_L), -(-length_k // _DRAW_MAX_S)
        chosen = " (any; chosen for the picture)"
        size = f"L={length_q}{chosen if natural[0] is None else ''}, S={length_k}"
        size += chosen if natural[1] is None else ""
        if natural == (None, None):
            size = f"e.g. L={length_q}, S={length_k}"
        legend = "# = may attend"
        if (step_q, step_k) != (1, 1):
            size += f"; one character per {step_q} queries x {step_k} keys"
            legend = "# = all may attend, + = some, . = none"
        head = "head 0" if (self.num_heads or 1) == 1 else f"head 0 of {self.num_heads}"
        batches = self.batch_size or 1
        if batches == 1:
            picture = _picture(self, length_q, length_k, 0, step_q, step_k)
            text += f"\n  {size} ({legend}, batch 0, {head}):\n  "
            return text + picture.replace("\n", "\n  ")
        shown = min(batches, _DRAW_BATCHES)
        which = "" if shown == batches else f", the first {shown} of {batches} batch entries"
        text += f"\n  {size} ({legend}, {head}{which}):"
        for b in range(shown):
            picture = _picture(self, length_q, length_k, b, step_q, step_k)
            text += f"\n  batch {b}:\n  " + picture.replace("\n", "\n  ")
        return text


def _picture_size(
    natural: tuple[int | None, int | None], least: tuple[int, int]
) -> tuple[int, int]:
    """The (L, S) repr draws: the sizes the mask's tensors fix; a free L is S (a square
    picture: the diagonal of bottom-right masks then starts in the corner) when S is longer than
    the small example, else the small example's."""
    if natural[0] is not None:
        length_q = natural[0]
        return length_q, natural[1] if natural[1] is not None else max(_DRAW_S, least[1], length_q)
    length_k = natural[1] if natural[1] is not None else max(_DRAW_S, least[1])
    if length_k > _DRAW_S:
        length_q = max(least[0], min(length_k, _DRAW_SQUARE))
    else:
        length_q = max(_DRAW_L, least[0])
    return length_q, length_k if natural[1] is not None else max(length_k, length_q)


def _picture(mask: Mask, length_q: int, length_k: int, batch: int, step_q: int, step_k: int) -> str:
    """Batch entry ``batch``, head 0, one character per ``step_q`` x ``step_k`` block: ``#``
    every pair visible, ``.`` none, ``+`` some (one block of queries lowered at a time)."""
    lines = []
    pad = -length_k % step_k
    for q0 in range(0, length_q, step_q):
        q1 = min(q0 + step_q, length_q)
        keep = mask.block(length_q, length_k, q0, q1, 0, length_k, batch=batch)
        keep = keep[0, 0].expand(q1 - q0, length_k).cpu()
        grid = (q1 - q0, (length_k + pad) // step_k, step_k)
        some = torch.nn.functional.pad(keep, (0, pad), value=False).view(grid).any(2).any(0)
        every = torch.nn.functional.pad(keep, (0, pad), value=True).view(grid).all(2).all(0)
        lines.append(
            "".join("#" if e else "+" if s else "." for s, e in zip(some.tolist(), every.tolist()))
        )
    return "\n".join(lines)


# the picture in repr(mask): a mask whose tensors fix no size is drawn at 4 x 6, one whose
# tensors fix S > 6 and leave L free at L = S (at most 256); a larger one than 16 x 48
# characters is drawn whole, scaled down; at most 2 batch entries are drawn
_DRAW_L, _DRAW_S = 4, 6
_DRAW_MAX_L, _DRAW_MAX_S = 16, 48
_DRAW_SQUARE = 256
_DRAW_BATCHES = 2

# a summary answers per cell of _CELL queries x _CELL keys: finer than any backend tile, coarse
# enough that L = S = 32k is 4M cells per batch entry
_CELL = 16
# most (head, query, key) entries of the predicate evaluated at once, so memory stays flat in
# L x S; and how many (L, S) summaries a mask keeps (decoding grows S by one per step)
_BUDGET = 1 << 20
_CACHED_SHAPES = 8


@dataclass(frozen=True)
class _Summary:
    """What ``mask_mod`` shows for one (L, S) and batch entry, per cell of _CELL x _CELL:
    ``some`` / ``every`` entry visible over every head; per row of cells the ``first`` and
    ``last`` visible key (S and -1 when none)."""

    some: Tensor  # [ceil(L / _CELL), ceil(S / _CELL)] bool
    every: Tensor  # same shape
    first: Tensor  # [ceil(L / _CELL)] long
    last: Tensor


def _evaluate(
    mod: MaskMod, b: Tensor, h: Tensor, q: Tensor, k: Tensor, shape: tuple[int, ...]
) -> Tensor:
    """``mod`` on 1-D index tensors laid out as (B, H, L, S), checked, with size 1 kept on the
    dimensions it does not depend on."""
    keep = mod(
        b[:, None, None, None],
        h[None, :, None, None],
        q[None, None, :, None],
        k[None, None, None, :],
    )
    if not isinstance(keep, Tensor) or keep.dtype != torch.bool:
        got = f"dtype {keep.dtype}" if isinstance(keep, Tensor) else type(keep).__name__
        raise TypeError(
            "a mask predicate must return a bool tensor (True = may attend), e.g. "
            f"lambda b, h, q, k: k <= q. Received: {got}"
        )
    if keep.dim() < 4:  # a result that ignores the leading index tensors
        keep = keep[(None,) * (4 - keep.dim())]
    # g != 1 and g != w, not g not in (1, w): dynamo cannot test a symbolic size's membership
    if keep.dim() != 4 or any(g != 1 and g != w for g, w in zip(keep.shape, shape)):
        raise ValueError(
            "a mask predicate must combine its index tensors elementwise (as FlexAttention's "
            f"mask_mod), giving a result that broadcasts to {shape}. "
            f"Received: shape {tuple(keep.shape)}"
        )
    return keep


def _summarize(mask: Mask, length_q: int, length_k: int, batch: int) -> _Summary:
    """Evaluate ``mask.mask_mod`` one row of cells at a time, at most _BUDGET entries at once."""
    device = mask._home
    rows, cols = -(-length_q // _CELL), -(-length_k // _CELL)
    some = torch.zeros(rows, cols, dtype=torch.bool)
    every = torch.ones(rows, cols, dtype=torch.bool)
    first = torch.full((rows,), length_k, dtype=torch.long)
    last = torch.full((rows,), -1, dtype=torch.long)
    heads = mask.num_heads or 1
    b, h = torch.tensor([batch], device=device), torch.arange(heads, device=device)
    mod = mask.mask_mod(length_q, length_k, device=device)
    width = max(1, _BUDGET // (heads * _CELL * _CELL)) * _CELL  # keys per evaluation
    for i, q0 in enumerate(range(0, length_q, _CELL)):
        q = _arange(q0, min(q0 + _CELL, length_q), device)
        for k0 in range(0, length_k, width):
            k1 = min(k0 + width, length_k)
            shape = (1, heads, q.numel(), k1 - k0)
            keep = _evaluate(mod, b, h, q, _arange(k0, k1, device), shape).expand(shape)[0].cpu()
            seen = torch.nonzero(keep.any(dim=0).any(dim=0)).flatten()
            if seen.numel():
                first[i] = min(int(first[i]), k0 + int(seen[0]))
                last[i] = max(int(last[i]), k0 + int(seen[-1]))
            pad, n = (-(k1 - k0)) % _CELL, -(-(k1 - k0) // _CELL)
            cells = slice(k0 // _CELL, k0 // _CELL + n)
            grid = (heads, q.numel(), n, _CELL)
            padded = torch.nn.functional.pad(keep, (0, pad), value=False)
            some[i, cells] = padded.view(grid).any(dim=3).any(dim=1).any(dim=0)
            padded = torch.nn.functional.pad(keep, (0, pad), value=True)
            every[i, cells] = padded.view(grid).all(dim=3).all(dim=1).all(dim=0)
    return _Summary(some, every, first, last)


def _as_mask(m: object) -> Mask:
    if isinstance(m, Mask):
        return m
    if isinstance(m, Tensor):
        return dense(m)
    raise TypeError(
        "masks combine only with other masks or bool tensors. "
        f"Received: an object of type {type(m).__name__}"
    )


def _kind(any_visible: bool, all_visible: bool) -> TileKind:
    if not any_visible:
        return TileKind.EMPTY
    return TileKind.FULL if all_visible else TileKind.PARTIAL


def _arange(a: int, b: int, device: torch.device | str | None) -> Tensor:
    return torch.arange(a, b, device=device)


def _batch_slice(t: Tensor, batch: int | None) -> Tensor:
    """Select batch entry ``batch`` (keeping the dim) unless the dim broadcasts (size 1)."""
    if batch is None or t.shape[0] == 1:
        return t
    return t[batch : batch + 1]


def _check_batch(name: str, got: int, want: int) -> None:
    if got not in (1, want):
        raise ValueError(
            f"{name} has batch size {got} but the inputs have B={want}; build the mask from "
            f"a tensor with B rows. Received: batch size {got}"
        )


class _Dense(Mask):
    def __init__(self, keep: Tensor) -> None:
        if not isinstance(keep, Tensor):
            raise TypeError(
                "dense(keep) takes a bool tensor. "
                f"Received: an object of type {type(keep).__name__}"
            )
        V.check_mask_tensor_dtype("mask", keep)
        if keep.dim() == 2:
            keep = keep[None, None]
            self._exact = True
        elif keep.dim() == 4:
            self._exact = False
        else:
            hint = (
                " For nn.MultiheadAttention's (B * H, L, S) masks use masks.from_torch(..., "
                "num_heads=H); for Keras's (B, L, S) masks use masks.from_keras(...); or add the "
                "head dimension with keep[:, None]."
                if keep.dim() == 3
                else " For a per-key mask of shape (B, S) use masks.key_padding(keep)."
            )
            raise ValueError(
                "a dense mask must be 2-D (L, S) or 4-D (B or 1, H or 1, L or 1, S or 1)."
                f"{hint} Received: mask.shape={tuple(keep.shape)}"
            )
        self.keep, self._home = keep, keep.device
        if keep.shape[0] != 1:
            self.batch_size = keep.shape[0]
        if keep.shape[1] != 1:
            self.num_heads = keep.shape[1]

    @functools.cached_property
    def _host(self) -> Tensor:
        """The tensor on the host, for tile answers (copied on first use by a planner)."""
        return self.keep.detach().cpu()

    def check(self, batch, heads, length_q, length_k):
        shape = tuple(self.keep.shape)
        if self._exact:
            if shape[2:] != (length_q, length_k):
                hint = (
                    " A (B, S) tensor marks keys per batch entry: use masks.key_padding(keep)."
                    if shape[2] == batch and shape[3] == length_k
                    else ""
                )
                raise ValueError(
                    f"a 2-D mask must have shape exactly (L, S)={(length_q, length_k)}.{hint} "
                    f"Received: mask.shape={shape[2:]}"
                )
            return
        want = (batch, heads, length_q, length_k)
        if not V._fits(shape, want, allow_one=True):
            raise ValueError(
                f"a 4-D mask must broadcast to (B, H, L, S)={want}, each dimension equal or 1. "
                f"Received: mask.shape={shape}"
            )

    arbitrary = True

    def mask_mod(self, length_q, length_k, *, device=None):
        keep = self.keep.to(device)

        def mod(b, h, q_idx, kv_idx):
            # index 0 along dimensions the tensor broadcasts (size 1)
            idx = [i if n > 1 else i * 0 for i, n in zip((b, h, q_idx, kv_idx), keep.shape)]
            return keep[idx[0], idx[1], idx[2], idx[3]]

        return mod

    def block(self, length_q, length_k, q0, q1, k0, k1, *, batch=None, device=None):
        keep = _batch_slice(self.keep, batch)
        if keep.shape[2] != 1:
            keep = keep[:, :, q0:q1]
        if keep.shape[3] != 1:
            keep = keep[:, :, :, k0:k1]
        return keep.to(device)

    def tile(self, length_q, length_k, q0, q1, *, batch=0):
        if q1 <= q0:
            return _EMPTY
        keep = self._host[batch if self._host.shape[0] > 1 else 0]  # [h, l|1, s|1]
        if keep.shape[1] != 1:
            keep = keep[:, q0:q1]
        keep = keep.expand(-1, -1, length_k)
        cols = torch.nonzero(keep.any(dim=1).any(dim=0)).flatten()
        if cols.numel() == 0:
            return _EMPTY
        start, stop = int(cols[0]), int(cols[-1]) + 1
        return _tile(start, stop, bool(keep[:, :, start:stop].all()))

    def rect_kind(self, length_q, length_k, q0, q1, k0, k1, *, batch=0):
        if q1 <= q0 or k1 <= k0:
            return TileKind.EMPTY
        keep = self._host[batch if self._host.shape[0] > 1 else 0]  # [H|1, L|1, S|1]
        rows = slice(q0, q1) if keep.shape[1] > 1 else slice(None)  # size 1 broadcasts
        cols = slice(k0, k1) if keep.shape[2] > 1 else slice(None)
        keep = keep[:, rows, cols]
        return _kind(bool(keep.any()), bool(keep.all()))

    def _describe(self):
        shape = tuple(self.keep.shape[2:]) if self._exact else tuple(self.keep.shape)
        return f"dense(keep of shape {shape})"

    def _natural_size(self):
        length_q, length_k = self.keep.shape[2:]  # a size-1 axis broadcasts: it fixes nothing
        return (length_q if length_q > 1 else None), (length_k if length_k > 1 else None)


def dense(keep: Tensor) -> Mask:
    """An arbitrary bool mask, True = may attend.

    Args:
        keep: (L, S) exactly, or 4-D (B or 1, H or 1, L or 1, S or 1). Other ranks are rejected
            so a (B, S) padding mask cannot pass for an (L, S) one by accident.
    """
    return _Dense(keep)


class _Combine(Mask):
    def __init__(self, a: Mask, b: Mask, op: str) -> None:
        self.a, self.b, self.op = a, b, op
        self.batch_size = _merge_size("batch size", a.batch_size, b.batch_size)
        self.num_heads = _merge_size("head count", a.num_heads, b.num_heads)
        self.arbitrary = a.arbitrary or b.arbitrary
        self.rows_alike = a.rows_alike and b.rows_alike
        self._home = a._home if a._home is not None else b._home

    @property
    def structure_key(self):
        a, b = self.a.structure_key, self.b.structure_key
        return None if a is None or b is None else (self.op, a, b)

    def visible_distances(self, length_q, length_k):
        x = self.a.visible_distances(length_q, length_k)
        y = self.b.visible_distances(length_q, length_k)
        if self.op != "&" or x is None or y is None:
            return None
        lo = [v for v in (x[0], y[0]) if v is not None]
        hi = [v for v in (x[1], y[1]) if v is not None]
        return (max(lo) if lo else None, min(hi) if hi else None)

    def mask_mod(self, length_q, length_k, *, device=None):
        x = self.a.mask_mod(length_q, length_k, device=device)
        y = self.b.mask_mod(length_q, length_k, device=device)
        if self.op == "&":
            return lambda b, h, q_idx, kv_idx: x(b, h, q_idx, kv_idx) & y(b, h, q_idx, kv_idx)
        return lambda b, h, q_idx, kv_idx: x(b, h, q_idx, kv_idx) | y(b, h, q_idx, kv_idx)

    def check(self, batch, heads, length_q, length_k):
        self.a.check(batch, heads, length_q, length_k)
        self.b.check(batch, heads, length_q, length_k)

    def block(self, length_q, length_k, q0, q1, k0, k1, *, batch=None, device=None):
        # one device for both sides: a causal mask (anywhere) & lengths on a GPU must not
        # give a CPU block and a GPU block
        device = device if device is not None else self._home
        x = self.a.block(length_q, length_k, q0, q1, k0, k1, batch=batch, device=device)
        y = self.b.block(length_q, length_k, q0, q1, k0, k1, batch=batch, device=device)
        return (x & y) if self.op == "&" else (x | y)

    def tile(self, length_q, length_k, q0, q1, *, batch=0):
        x = self.a.tile(length_q, length_k, q0, q1, batch=batch)
        y = self.b.tile(length_q, length_k, q0, q1, batch=batch)
        full = TileKind.FULL
        if self.op == "&":
            if TileKind.EMPTY in (x.kind, y.kind):
                return _EMPTY
            return _tile(max(x.start, y.start), min(x.stop, y.stop), x.kind == y.kind == full)
        if x.kind == TileKind.EMPTY:
            return y
        if y.kind == TileKind.EMPTY:
            return x
        start, stop = min(x.start, y.start), max(x.stop, y.stop)
        covers = any(t.kind == full and t.start == start and t.stop == stop for t in (x, y))
        # two fully visible ranges that touch or overlap leave no gap
        joined = x.kind == y.kind == full and max(x.start, y.start) <= min(x.stop, y.stop)
        return _tile(start, stop, covers or joined)

    def rect_kind(self, length_q, length_k, q0, q1, k0, k1, *, batch=0):
        if self.visible_distances(length_q, length_k) is not None:  # two bands: exact
            return super().rect_kind(length_q, length_k, q0, q1, k0, k1, batch=batch)
        x = self.a.rect_kind(length_q, length_k, q0, q1, k0, k1, batch=batch)
        y = self.b.rect_kind(length_q, length_k, q0, q1, k0, k1, batch=batch)
        empty, full = TileKind.EMPTY, TileKind.FULL
        if self.op == "&":
            if empty in (x, y):
                return empty
            if x == y == full:
                return full
        else:
            if full in (x, y):
                return full
            if x == y == empty:
                return empty
        # two partial answers may still not meet: the combined tile range can tell
        return self._rect_from_tile(length_q, length_k, q0, q1, k0, k1, batch)

    def _describe(self):
        return f"({self.a._describe()} {self.op} {self.b._describe()})"

    def _natural_size(self):
        (qa, ka), (qb, kb) = self.a._natural_size(), self.b._natural_size()
        return _merge_size("query length", qa, qb), _merge_size("key length", ka, kb)

    def _least_size(self):
        (qa, ka), (qb, kb) = self.a._least_size(), self.b._least_size()
        return max(qa, qb), max(ka, kb)


class _Crop(Mask):
    def __init__(self, parent: Mask, length_q, length_k, q0, q1, k0, k1) -> None:
        self.parent, self.window = parent, G.Window(length_q, length_k, q0, q1, k0, k1)
        self.size = self.window.size
        self.batch_size, self.num_heads = parent.batch_size, parent.num_heads
        self.arbitrary, self._home = parent.arbitrary, parent._home

    def check(self, batch, heads, length_q, length_k):
        self.window.check_shape("mask", length_q, length_k)
        self.parent.check(batch, heads, *self.size)

    def block(self, length_q, length_k, q0, q1, k0, k1, *, batch=None, device=None):
        rect = self.window.outer(q0, q1, k0, k1)
        return self.parent.block(*self.size, *rect, batch=batch, device=device)

    def tile(self, length_q, length_k, q0, q1, *, batch=0):
        w = self.window
        t = self.parent.tile(*self.size, w.q0 + q0, w.q0 + q1, batch=batch)
        if t.kind == TileKind.EMPTY:
            return _EMPTY
        start, stop = max(t.start, w.k0), min(t.stop, w.k1)
        return _tile(start - w.k0, stop - w.k0, t.kind == TileKind.FULL)

    def mask_mod(self, length_q, length_k, *, device=None):
        mod, q0, k0 = (
            self.parent.mask_mod(*self.size, device=device),
            self.window.q0,
            self.window.k0,
        )
        return lambda b, h, q_idx, kv_idx: mod(b, h, q_idx + q0, kv_idx + k0)

    @property
    def structure_key(self):
        key = self.parent.structure_key
        return None if key is None else ("crop", key, *self.window.key())

    def tile_rows(self, length_q, length_k):
        return self.parent.tile_rows(*self.size)

    def blocks(self, length_q, length_k, *, batch=0):
        rects = self.parent.blocks(*self.size, batch=batch)
        if rects is None:
            return None
        inside = (self.window.inner(*rect) for rect in rects)
        return [rect for rect in inside if rect is not None]

    def visible_distances(self, length_q, length_k):
        band = self.parent.visible_distances(*self.size)
        if band is None:
            return None
        shift = self.window.shift
        return tuple(None if x is None else x - shift for x in band)

    def torch_is_causal(self, length_q, length_k):
        return self.visible_distances(length_q, length_k) == (None, 0)

    def rect_kind(self, length_q, length_k, q0, q1, k0, k1, *, batch=0):
        if q1 <= q0 or k1 <= k0:
            return TileKind.EMPTY
        return self.parent.rect_kind(*self.size, *self.window.outer(q0, q1, k0, k1), batch=batch)

    def _describe(self):
        return (
            f"crop of {self.parent._describe()} to {self.window.describe()} of (L, S)={self.size}"
        )

    def _natural_size(self):
        return self.window.shape


def _merge_size(what: str, x: int | None, y: int | None) -> int | None:
    if x is not None and y is not None and x != y:
        raise ValueError(f"cannot combine masks with different {what}s. Received: {x} and {y}")
    return x if x is not None else y
