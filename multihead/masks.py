"""Attention masks as composable data, with one polarity everywhere: True = may attend.

A mask is a small object, not an L x S tensor. Each mask can

* lower any rectangular block of itself to a bool tensor (``block``; ``to_dense`` is the whole
  (L, S) block), and
* answer, for a tile of query rows and one batch entry, which contiguous key range can be visible
  and whether that tile is fully visible, partly visible or empty (``tile``), without building
  the block. The fast backends use the second answer to skip work.

Masks combine with ``&`` (visible in both) and ``|`` (visible in either)::

    m = masks.causal() & masks.lengths(torch.tensor([3, 2]))

Structured masks (``causal``, ``sliding_window``) know nothing about sizes; the sizes come from
the tensors they are used with. Masks built from tensors (``lengths``, ``key_padding``,
``documents``, ``dense``) fix the batch size B, and ``dense`` may fix the head count H.
"""

from __future__ import annotations

import bisect
import enum
import functools
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from . import _validation as V

__all__ = [
    "Mask",
    "Tile",
    "TileKind",
    "TorchMasks",
    "causal",
    "dense",
    "documents",
    "from_keras",
    "from_torch",
    "key_padding",
    "lengths",
    "sliding_window",
]

_ALIGNS = ("bottom_right", "top_left")

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


class TileKind(enum.Enum):
    """How much of a (query tile) x (key range) rectangle is visible."""

    EMPTY = "empty"  # nothing visible: the tile costs nothing
    PARTIAL = "partial"  # some entries visible: apply the mask block
    FULL = "full"  # every entry visible: no mask needed


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
    * hints for planners: ``tile_rows``, ``blocks``, ``torch_is_causal``, ``arbitrary``.

    Subclasses implement ``check``, ``mask_mod``, ``block`` and ``tile``; the hints have safe
    defaults. A new mask kind is one subclass: no backend changes.
    """

    batch_size: int | None = None  # B fixed by the mask's tensors, None = any
    num_heads: int | None = None  # H fixed by the mask's tensor, None = any
    align: str | None = None  # "bottom_right" / "top_left" for masks tied to the diagonal
    arbitrary: bool = False  # an unstructured tensor: little to skip, dense kernels suit it

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
        raise NotImplementedError

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
        raise NotImplementedError

    def tile(self, length_q: int, length_k: int, q0: int, q1: int, *, batch: int = 0) -> Tile:
        """Visible key range and kind for query rows ``[q0, q1)`` of batch entry ``batch``."""
        raise NotImplementedError

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

        The default is exact for bands (``visible_distances``) and otherwise conservative,
        from ``tile``; masks that can answer exactly and cheaply override it.
        """
        if q1 <= q0 or k1 <= k0:
            return TileKind.EMPTY
        band = self.visible_distances(length_q, length_k)
        if band is not None:
            return _band_kind(band, q0, q1, k0, k1)
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
        least = self._least_size()
        length_q = natural[0] if natural[0] is not None else max(_DRAW_L, least[0])
        length_k = natural[1] if natural[1] is not None else max(_DRAW_S, least[1], length_q)
        rows, cols = min(length_q, _DRAW_MAX_L), min(length_k, _DRAW_MAX_S)
        chosen = " (any; chosen for the picture)"
        size = f"L={length_q}{chosen if natural[0] is None else ''}, S={length_k}"
        size += chosen if natural[1] is None else ""
        if natural == (None, None):
            size = f"e.g. L={length_q}, S={length_k}"
        if (rows, cols) != (length_q, length_k):
            size += f"; top-left corner, the first {rows} queries and {cols} keys"
        picture = self.to_string(length_q, length_k, rows=rows, cols=cols)
        text += f"\n  {size} (# = may attend, batch 0, head 0):\n  "
        return text + picture.replace("\n", "\n  ")


# the picture in repr(mask): a mask whose tensors fix no size is drawn at 4 x 6; a larger one
# is drawn as its top-left corner of at most 24 queries x 48 keys
_DRAW_L, _DRAW_S = 4, 6
_DRAW_MAX_L, _DRAW_MAX_S = 24, 48


def _as_mask(m: object) -> Mask:
    if isinstance(m, Mask):
        return m
    if isinstance(m, Tensor):
        return dense(m)
    raise TypeError(
        "masks combine only with other masks or bool tensors. "
        f"Received: an object of type {type(m).__name__}"
    )


def _band_kind(band: tuple[int | None, int | None], q0: int, q1: int, k0: int, k1: int) -> TileKind:
    """Exact rect_kind of a band (query i sees key j iff lo <= j - i <= hi): the rectangle's
    distances j - i fill the whole interval [k0 - (q1 - 1), (k1 - 1) - q0]."""
    lo, hi = band
    d_min, d_max = k0 - (q1 - 1), (k1 - 1) - q0
    if (hi is not None and d_min > hi) or (lo is not None and d_max < lo):
        return TileKind.EMPTY
    if (lo is None or d_min >= lo) and (hi is None or d_max <= hi):
        return TileKind.FULL
    return TileKind.PARTIAL


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


class _Band(Mask):
    """Query i sees key j when ``-before <= j - (i + offset) <= after``.

    ``offset`` is S - L for bottom-right alignment and 0 for top-left; None means unbounded.
    """

    def __init__(self, before: int | None, after: int | None, align: str, name: str) -> None:
        if align not in _ALIGNS:
            raise ValueError(
                f"align must be 'bottom_right' or 'top_left'. Received: align={align!r}"
            )
        for label, value in (("before", before), ("after", after)):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{label} must be an int. Received: {label}={value!r}")
            if value < 0:
                raise ValueError(f"{label} must be >= 0. Received: {label}={value}")
        self.before, self.after, self.align, self._name = before, after, align, name

    @property
    def is_causal(self) -> bool:
        return self.before is None and self.after == 0

    @property
    def structure_key(self) -> Hashable:
        return ("band", self.before, self.after, self.align)

    def tile_rows(self, length_q, length_k):
        if self.before is None or self.after is None:
            return None
        # one tile per window width: its keys split into two triangles
        return max(32, min(512, self.before + self.after))

    def torch_is_causal(self, length_q, length_k):
        return self.is_causal and (self.align == "top_left" or length_q == length_k)

    def visible_distances(self, length_q, length_k):
        off = self._offset(length_q, length_k)
        return (
            None if self.before is None else off - self.before,
            None if self.after is None else off + self.after,
        )

    def mask_mod(self, length_q, length_k, *, device=None):
        off, before, after = self._offset(length_q, length_k), self.before, self.after

        def mod(b, h, q_idx, kv_idx):
            d = kv_idx - (q_idx + off)
            keep = d == d  # all True, in the broadcast shape
            if before is not None:
                keep = keep & (d >= -before)
            if after is not None:
                keep = keep & (d <= after)
            return keep

        return mod

    def _offset(self, length_q: int, length_k: int) -> int:
        return length_k - length_q if self.align == "bottom_right" else 0

    def check(self, batch: int, heads: int, length_q: int, length_k: int) -> None:
        return None

    def block(self, length_q, length_k, q0, q1, k0, k1, *, batch=None, device=None):
        d = _arange(k0, k1, device)[None, :] - _arange(q0, q1, device)[:, None]
        d = d - self._offset(length_q, length_k)
        keep = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool, device=device)
        if self.before is not None:
            keep &= d >= -self.before
        if self.after is not None:
            keep &= d <= self.after
        return keep[None, None]

    def tile(self, length_q, length_k, q0, q1, *, batch=0):
        if q1 <= q0:
            return _EMPTY
        off = self._offset(length_q, length_k)
        start, stop, full = 0, length_k, True
        if self.before is not None:
            start = max(0, q0 + off - self.before)
            # every row's lowest visible key must be at or left of start
            full &= q1 - 1 + off - self.before <= start
        if self.after is not None:
            stop = min(length_k, q1 - 1 + off + self.after + 1)
            # every row's highest visible key must reach stop - 1
            full &= q0 + off + self.after >= stop - 1
        return _tile(start, stop, full)

    def _describe(self):
        if self._name == "causal":
            return f"causal(align={self.align!r})"
        return f"sliding_window(before={self.before}, after={self.after}, align={self.align!r})"


def causal(*, align: str = "bottom_right") -> Mask:
    """Causal mask: a query sees keys at or before its own position.

    ``align="bottom_right"`` (default; FlashAttention and KV-cache decoding): query i sees keys
    j <= i + S - L, so the last query sees every key. ``align="top_left"`` (PyTorch's
    ``is_causal``): query i sees keys j <= i. They agree when L == S. For L=2, S=5::

        bottom_right      top_left
        # # # # .         # . . . .
        # # # # #         # # . . .

    With bottom-right alignment and L > S the first L - S queries see no key; their output
    is exactly 0.
    """
    return _Band(None, 0, align, "causal")


def sliding_window(before: int, after: int = 0, *, align: str = "bottom_right") -> Mask:
    """Local attention: query i sees keys j with ``c - before <= j <= c + after``.

    ``c = i + S - L`` (bottom-right, default) or ``c = i`` (top-left), the same alignment as
    ``causal``. ``sliding_window(2)`` for L = S = 5::

        # . . . .
        # # . . .
        # # # . .
        . # # # .
        . . # # #
    """
    if before is None:
        raise TypeError("before must be an int; for no lower bound use causal(). Received: None")
    return _Band(before, after, align, "sliding_window")


class _Lengths(Mask):
    def __init__(self, valid_lens: Tensor, query_lens: Tensor | None) -> None:
        self.valid_lens = V.check_index_tensor("valid_lens", valid_lens, (1, 2), "(B,) or (B, L)")
        self.batch_size = self.valid_lens.shape[0]
        self._host = self.valid_lens.detach().cpu().tolist()
        self.query_lens = None
        self._host_q: list[int] | None = None
        if query_lens is not None:
            self.query_lens = V.check_index_tensor("query_lens", query_lens, (1,), "(B,)")
            if self.query_lens.shape[0] != self.batch_size:
                raise ValueError(
                    "query_lens must have one entry per batch element, like valid_lens. "
                    f"Received: query_lens.shape={tuple(self.query_lens.shape)}, "
                    f"valid_lens.shape={tuple(self.valid_lens.shape)}"
                )
            self._host_q = self.query_lens.detach().cpu().tolist()

    def check(self, batch, heads, length_q, length_k):
        if self.batch_size != batch:
            raise ValueError(
                f"valid_lens must have one entry per batch element, B={batch}. "
                f"Received: valid_lens.shape={tuple(self.valid_lens.shape)}"
            )
        if self.valid_lens.dim() == 2 and self.valid_lens.shape[1] != length_q:
            raise ValueError(
                f"per-query valid_lens must have shape (B, L)={(batch, length_q)}. "
                f"Received: valid_lens.shape={tuple(self.valid_lens.shape)}"
            )
        flat = torch.as_tensor(self._host).flatten()
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) > length_k):
            raise ValueError(
                f"valid_lens must be in [0, S] with S={length_k} keys. "
                f"Received: valid_lens min={int(flat.min())}, max={int(flat.max())}"
            )
        if self._host_q is not None and (min(self._host_q) < 0 or max(self._host_q) > length_q):
            raise ValueError(
                f"query_lens must be in [0, L] with L={length_q} queries. "
                f"Received: query_lens min={min(self._host_q)}, max={max(self._host_q)}"
            )

    def tile_rows(self, length_q, length_k):
        # one length per batch entry: every query row sees the same keys
        return max(length_q, 1) if self.valid_lens.dim() == 1 else None

    def mask_mod(self, length_q, length_k, *, device=None):
        lens = self.valid_lens.to(device)
        query_lens = None if self.query_lens is None else self.query_lens.to(device)

        def mod(b, h, q_idx, kv_idx):
            keep = kv_idx < (lens[b] if lens.dim() == 1 else lens[b, q_idx])
            if query_lens is not None:
                keep = keep & (q_idx < query_lens[b])
            return keep

        return mod

    def block(self, length_q, length_k, q0, q1, k0, k1, *, batch=None, device=None):
        lens = _batch_slice(self.valid_lens, batch).to(device)
        if lens.dim() == 1:
            lens = lens[:, None, None, None]  # [b, 1, 1, 1]
        else:
            lens = lens[:, None, q0:q1, None]  # [b, 1, l, 1]
        keep = _arange(k0, k1, lens.device)[None, None, None, :] < lens
        if self.query_lens is not None:
            ql = _batch_slice(self.query_lens, batch).to(lens.device)[:, None, None, None]
            keep = keep & (_arange(q0, q1, lens.device)[None, None, :, None] < ql)
        return keep

    def tile(self, length_q, length_k, q0, q1, *, batch=0):
        if self._host_q is not None:
            if q0 >= self._host_q[batch]:
                return _EMPTY
            if q1 > self._host_q[batch]:  # the tile runs into query padding
                inner = self.tile(length_q, length_k, q0, self._host_q[batch], batch=batch)
                return _tile(inner.start, inner.stop, False)
        if q1 <= q0:
            return _EMPTY
        row = self._host[batch]
        if isinstance(row, int):
            return _tile(0, row, True)
        window = row[q0:q1]
        return _tile(0, max(window), min(window) == max(window))

    def rect_kind(self, length_q, length_k, q0, q1, k0, k1, *, batch=0):
        if self._host_q is not None:
            q_stop = self._host_q[batch]
            padded = q1 > q_stop  # some rows are query padding: they see nothing
            q1 = min(q1, q_stop)
        else:
            padded = False
        if q1 <= q0 or k1 <= k0:
            return TileKind.EMPTY
        row = self._host[batch]
        if not isinstance(row, int):  # one length per query row
            row = row[q0:q1]
        shortest, longest = (row, row) if isinstance(row, int) else (min(row), max(row))
        # a row sees keys j < its length
        return _kind(longest > k0, shortest >= k1 and not padded)

    def _describe(self):
        extra = "" if self._host_q is None else f", query_lens={self._host_q}"
        return f"lengths(valid_lens={self._host}{extra})"

    def _natural_size(self):
        return (self.valid_lens.shape[1] if self.valid_lens.dim() == 2 else None), None

    def _least_size(self):
        flat = torch.as_tensor(self._host).flatten()
        most_keys = int(flat.max()) if flat.numel() else 0
        return (max(self._host_q) if self._host_q else 0), most_keys


def lengths(valid_lens: Tensor, query_lens: Tensor | None = None) -> Mask:
    """Key-length mask (d2l's ``valid_lens``): keys at positions >= the valid length are hidden.

    Args:
        valid_lens: integer tensor (B,) (one length per batch entry, every query) or (B, L)
            (one length per query). Values in [0, S]; 0 hides every key, so those rows output 0.
        query_lens: optional integer tensor (B,): queries at positions >= it are padding and see
            no key (they output 0 and cost nothing). For a padded self-attention batch pass
            the same lengths twice: ``lengths(n, query_lens=n)``. For ``lengths([3, 2])`` and
            L = S = 4, batch entry 1, with and without ``query_lens=[3, 2]``::

                # # . .        # # . .
                # # . .        # # . .
                # # . .        . . . .
                # # . .        . . . .
    """
    return _Lengths(valid_lens, query_lens)


class _KeyPadding(Mask):
    def __init__(self, keep: Tensor) -> None:
        if not isinstance(keep, Tensor):
            raise TypeError(f"keep must be a bool tensor (B, S). Received: {type(keep).__name__}")
        V.check_mask_tensor_dtype("keep", keep)
        if keep.dim() != 2:
            raise ValueError(
                "key_padding(keep) takes a (B, S) bool tensor. "
                f"Received: keep.shape={tuple(keep.shape)}"
            )
        self.keep = keep
        self.batch_size = keep.shape[0]
        host = keep.detach().cpu()
        self._spans = []
        for row in host:
            idx = torch.nonzero(row).flatten()
            if idx.numel() == 0:
                self._spans.append((0, 0, False))
                continue
            first, last = int(idx[0]), int(idx[-1]) + 1
            self._spans.append((first, last, idx.numel() == last - first))

    def check(self, batch, heads, length_q, length_k):
        if tuple(self.keep.shape) != (batch, length_k):
            raise ValueError(
                f"key_padding(keep) must have shape (B, S)={(batch, length_k)}. "
                f"Received: keep.shape={tuple(self.keep.shape)}"
            )

    def tile_rows(self, length_q, length_k):
        return max(length_q, 1)  # every query row sees the same keys

    def mask_mod(self, length_q, length_k, *, device=None):
        keep = self.keep.to(device)
        return lambda b, h, q_idx, kv_idx: keep[b, kv_idx] & (q_idx == q_idx)

    def block(self, length_q, length_k, q0, q1, k0, k1, *, batch=None, device=None):
        return _batch_slice(self.keep, batch)[:, None, None, k0:k1].to(device)

    def tile(self, length_q, length_k, q0, q1, *, batch=0):
        if q1 <= q0:
            return _EMPTY
        return _tile(*self._spans[batch])

    def rect_kind(self, length_q, length_k, q0, q1, k0, k1, *, batch=0):
        if q1 <= q0 or k1 <= k0:
            return TileKind.EMPTY
        seen = self._visible_before[batch]  # seen[j] = visible keys among [0, j)
        count = int(seen[k1] - seen[k0])
        return _kind(count > 0, count == k1 - k0)

    @functools.cached_property
    def _visible_before(self) -> Tensor:
        keep = self.keep.detach().cpu().long()
        return torch.nn.functional.pad(keep.cumsum(dim=1), (1, 0))  # [B, S + 1]

    def _describe(self):
        return f"key_padding(keep of shape {tuple(self.keep.shape)})"

    def _natural_size(self):
        return None, self.keep.shape[1]


def key_padding(keep: Tensor) -> Mask:
    """Per-key visibility shared by every query.

    Args:
        keep: bool tensor (B, S); True = this key may be attended. (``nn.MultiheadAttention``'s
            ``key_padding_mask`` has the opposite polarity: use ``from_torch``.)
    """
    return _KeyPadding(keep)


class _Documents(Mask):
    def __init__(self, query_ids: Tensor, key_ids: Tensor | None) -> None:
        self.query_ids = V.check_index_tensor("query_ids", query_ids, (1, 2), "(L,) or (B, L)")
        self.key_ids = (
            self.query_ids
            if key_ids is None
            else V.check_index_tensor("key_ids", key_ids, (1, 2), "(S,) or (B, S)")
        )
        self._separate_keys = key_ids is not None
        q = self.query_ids if self.query_ids.dim() == 2 else self.query_ids[None]
        k = self.key_ids if self.key_ids.dim() == 2 else self.key_ids[None]
        self._q, self._k = q, k
        if q.shape[0] != 1 or k.shape[0] != 1:
            if q.shape[0] != 1 and k.shape[0] != 1 and q.shape[0] != k.shape[0]:
                raise ValueError(
                    "query_ids and key_ids must have the same batch size. "
                    f"Received: query_ids.shape={tuple(query_ids.shape)}, "
                    f"key_ids.shape={tuple(key_ids.shape)}"
                )
            self.batch_size = max(q.shape[0], k.shape[0])
        self._host_q = q.detach().cpu()
        # per batch row of keys: id -> (first, last + 1, count)
        self._key_spans: list[dict[int, tuple[int, int, int]]] = []
        for row in k.detach().cpu():
            ids, inverse, counts = torch.unique(row, return_inverse=True, return_counts=True)
            pos = torch.arange(row.numel())
            first = torch.full((ids.numel(),), row.numel()).scatter_reduce(0, inverse, pos, "amin")
            last = torch.full((ids.numel(),), -1).scatter_reduce(0, inverse, pos, "amax")
            self._key_spans.append(
                {
                    int(i): (int(f), int(x) + 1, int(c))
                    for i, f, x, c in zip(ids, first, last, counts)
                }
            )

    def runs(self, batch: int = 0) -> list[tuple[int, int, tuple[int, int, int] | None]]:
        """Maximal runs of equal query ids in one batch row: (q0, q1, key span of that id as
        (first, last + 1, count), or None when no key has it)."""
        row = self._host_q[batch if self._q.shape[0] > 1 else 0]
        ids, counts = torch.unique_consecutive(row, return_counts=True)
        stops = torch.cumsum(counts, 0).tolist()
        spans = self._key_spans[batch if self._k.shape[0] > 1 else 0]
        return [
            (stop - count, stop, spans.get(i))
            for i, count, stop in zip(ids.tolist(), counts.tolist(), stops)
        ]

    def check(self, batch, heads, length_q, length_k):
        for name, t, want in (("query_ids", self._q, length_q), ("key_ids", self._k, length_k)):
            _check_batch(name, t.shape[0], batch)
            if t.shape[1] != want:
                letter = "L" if name == "query_ids" else "S"
                hint = (
                    "; pass key_ids= when keys differ from queries"
                    if name == "key_ids" and not self._separate_keys
                    else ""
                )
                raise ValueError(
                    f"{name} must have length {letter}={want}{hint}. "
                    f"Received: {name}.shape={tuple(t.shape)}"
                )

    def blocks(self, length_q, length_k, *, batch=0):
        rects = []
        for q0, q1, span in self.runs(batch):
            if span is None:
                continue  # no key shares this id: the rows see nothing
            first, stop, count = span
            if count != stop - first:
                return None  # this document's keys are interleaved with another's
            rects.append((q0, q1, first, stop))
        return rects

    def mask_mod(self, length_q, length_k, *, device=None):
        q_ids, k_ids = self._q.to(device), self._k.to(device)
        qb, kb = q_ids.shape[0] > 1, k_ids.shape[0] > 1

        def mod(b, h, q_idx, kv_idx):
            zero = b * 0  # batch index 0 where the ids are shared by every batch entry
            return q_ids[b if qb else zero, q_idx] == k_ids[b if kb else zero, kv_idx]

        return mod

    def block(self, length_q, length_k, q0, q1, k0, k1, *, batch=None, device=None):
        q = _batch_slice(self._q, batch)[:, None, q0:q1, None].to(device)
        k = _batch_slice(self._k, batch)[:, None, None, k0:k1].to(device)
        return q == k

    def tile(self, length_q, length_k, q0, q1, *, batch=0):
        if q1 <= q0:
            return _EMPTY
        ids = torch.unique(self._host_q[batch if self._q.shape[0] > 1 else 0, q0:q1]).tolist()
        spans_of = self._key_spans[batch if self._k.shape[0] > 1 else 0]
        spans = [spans_of[i] for i in ids if i in spans_of]
        if not spans:
            return _EMPTY
        start = min(s[0] for s in spans)
        stop = max(s[1] for s in spans)
        # full only when the whole tile is one document whose keys are contiguous
        full = len(ids) == 1 and spans[0][2] == spans[0][1] - spans[0][0]
        return _tile(start, stop, full)

    def rect_kind(self, length_q, length_k, q0, q1, k0, k1, *, batch=0):
        if q1 <= q0 or k1 <= k0:
            return TileKind.EMPTY
        starts, runs = self._runs_of(batch)
        first = max(bisect.bisect_right(starts, q0) - 1, 0)
        spans = []  # per run of equal query ids among rows [q0, q1): its key span or None
        for r0, _, span in runs[first:]:
            if r0 >= q1:
                break
            spans.append(span)
        known = [x for x in spans if x is not None]
        if any(count != stop - start for start, stop, count in known):
            # a document's keys are interleaved with another's: compare the ids themselves
            rows = self._host_q[batch if self._q.shape[0] > 1 else 0, q0:q1]
            cols = self._host_k[batch if self._k.shape[0] > 1 else 0, k0:k1]
            hit = torch.isin(cols, rows)
            return _kind(bool(hit.any()), bool((rows == rows[0]).all() & hit.all()))
        # contiguous key spans of different documents are disjoint
        return _kind(
            any(min(stop, k1) > max(start, k0) for start, stop, _ in known),
            len(known) == len(spans) and all(a <= k0 and k1 <= b for a, b, _ in known),
        )

    def _runs_of(self, batch: int) -> tuple[list[int], list]:
        """``runs(batch)`` and their first rows, cached per batch row (for bisection)."""
        row = batch if self._q.shape[0] > 1 or self._k.shape[0] > 1 else 0
        if row not in self._runs_cache:
            runs = self.runs(row)
            self._runs_cache[row] = ([r[0] for r in runs], runs)
        return self._runs_cache[row]

    @functools.cached_property
    def _runs_cache(self) -> dict[int, tuple[list[int], list]]:
        return {}

    @functools.cached_property
    def _host_k(self) -> Tensor:
        return self._k.detach().cpu()

    def _describe(self):
        return f"documents(query_ids of shape {tuple(self.query_ids.shape)})"

    def _natural_size(self):
        return self._q.shape[1], self._k.shape[1]


def documents(query_ids: Tensor, key_ids: Tensor | None = None) -> Mask:
    """Packed sequences: a query sees only keys with the same document id (block diagonal).

    Args:
        query_ids: integer tensor (L,) or (B, L), the document id of every query position.
        key_ids: integer tensor (S,) or (B, S); defaults to ``query_ids`` (self-attention).

    Ids need not be sorted; tiles are cheapest when each document is contiguous. Combine with
    ``causal()`` for packed causal language modelling. For ids [0, 0, 1, 1, 1]::

        # # . . .
        # # . . .
        . . # # #
        . . # # #
        . . # # #
    """
    return _Documents(query_ids, key_ids)


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
        self.keep = keep
        if keep.shape[0] != 1:
            self.batch_size = keep.shape[0]
        if keep.shape[1] != 1:
            self.num_heads = keep.shape[1]
        self._host = keep.detach().cpu()

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
        return super().rect_kind(length_q, length_k, q0, q1, k0, k1, batch=batch)

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
        if not (0 <= q0 <= q1 <= length_q and 0 <= k0 <= k1 <= length_k):
            raise ValueError(
                f"a crop must lie inside (L, S)={(length_q, length_k)}. "
                f"Received: queries [{q0}, {q1}), keys [{k0}, {k1})"
            )
        self.parent, self.size = parent, (length_q, length_k)
        self.q0, self.q1, self.k0, self.k1 = q0, q1, k0, k1
        self.batch_size, self.num_heads = parent.batch_size, parent.num_heads
        self.arbitrary = parent.arbitrary

    def check(self, batch, heads, length_q, length_k):
        if (length_q, length_k) != (self.q1 - self.q0, self.k1 - self.k0):
            raise ValueError(
                f"this cropped mask is for (L, S)={(self.q1 - self.q0, self.k1 - self.k0)}. "
                f"Received: (L, S)={(length_q, length_k)}"
            )
        self.parent.check(batch, heads, *self.size)

    def block(self, length_q, length_k, q0, q1, k0, k1, *, batch=None, device=None):
        return self.parent.block(
            *self.size,
            self.q0 + q0,
            self.q0 + q1,
            self.k0 + k0,
            self.k0 + k1,
            batch=batch,
            device=device,
        )

    def tile(self, length_q, length_k, q0, q1, *, batch=0):
        t = self.parent.tile(*self.size, self.q0 + q0, self.q0 + q1, batch=batch)
        if t.kind == TileKind.EMPTY:
            return _EMPTY
        start, stop = max(t.start, self.k0), min(t.stop, self.k1)
        return _tile(start - self.k0, stop - self.k0, t.kind == TileKind.FULL)

    def mask_mod(self, length_q, length_k, *, device=None):
        mod, q0, k0 = self.parent.mask_mod(*self.size, device=device), self.q0, self.k0
        return lambda b, h, q_idx, kv_idx: mod(b, h, q_idx + q0, kv_idx + k0)

    @property
    def structure_key(self):
        key = self.parent.structure_key
        return None if key is None else ("crop", key, self.size, self.q0, self.q1, self.k0, self.k1)

    def tile_rows(self, length_q, length_k):
        return self.parent.tile_rows(*self.size)

    def blocks(self, length_q, length_k, *, batch=0):
        rects = self.parent.blocks(*self.size, batch=batch)
        if rects is None:
            return None
        out = []
        for a, b, c, d in rects:
            a, b = max(a, self.q0), min(b, self.q1)
            c, d = max(c, self.k0), min(d, self.k1)
            if a < b and c < d:
                out.append((a - self.q0, b - self.q0, c - self.k0, d - self.k0))
        return out

    def visible_distances(self, length_q, length_k):
        band = self.parent.visible_distances(*self.size)
        if band is None:
            return None
        shift = self.k0 - self.q0  # j - i in the whole is (j' - i') + shift
        return tuple(None if x is None else x - shift for x in band)

    def torch_is_causal(self, length_q, length_k):
        return self.visible_distances(length_q, length_k) == (None, 0)

    def rect_kind(self, length_q, length_k, q0, q1, k0, k1, *, batch=0):
        if q1 <= q0 or k1 <= k0:
            return TileKind.EMPTY
        return self.parent.rect_kind(
            *self.size, self.q0 + q0, self.q0 + q1, self.k0 + k0, self.k0 + k1, batch=batch
        )

    def _describe(self):
        return (
            f"crop of {self.parent._describe()} to queries [{self.q0}, {self.q1}) and keys "
            f"[{self.k0}, {self.k1}) of (L, S)={self.size}"
        )

    def _natural_size(self):
        return self.q1 - self.q0, self.k1 - self.k0


def _merge_size(what: str, x: int | None, y: int | None) -> int | None:
    if x is not None and y is not None and x != y:
        raise ValueError(f"cannot combine masks with different {what}s. Received: {x} and {y}")
    return x if x is not None else y


class TorchMasks(NamedTuple):
    """What ``from_torch`` returns: a mask (True = may attend) and an additive bias."""

    mask: Mask | None
    bias: Tensor | None


def from_torch(
    *args: object,
    attn_mask: Tensor | None = None,
    key_padding_mask: Tensor | None = None,
    num_heads: int | None = None,
) -> TorchMasks:
    """Convert ``torch.nn.MultiheadAttention`` masks to this library's convention.

    In torch a bool ``True`` means *blocked* and a float mask is *added* to the scores. Here a
    bool True means *may attend* and additive terms travel separately as ``bias``. A float
    ``-inf`` becomes a masked position; other float values become the bias.

    Args:
        attn_mask: (L, S) or (B * H, L, S), bool or float. The 3-D form needs ``num_heads``.
        key_padding_mask: (B, S), bool (True = padding) or float (added to every query row).
        num_heads: H, needed to unpack a 3-D ``attn_mask``.

    Returns:
        ``TorchMasks(mask, bias)``; either may be None. Pass it whole where a mask is taken
        (``attention(q, k, v, masks.from_torch(...))``, ``mha(x, mask=masks.from_torch(...))``)
        or unpack it: ``m, bias = masks.from_torch(...); attention(q, k, v, m, bias=bias)``.

    Raises:
        TypeError: positional arguments. Both masks are keyword-only because a (B, S)
            ``key_padding_mask`` passed first would be read as an (L, S) ``attn_mask``.
    """
    if args:
        raise TypeError(
            "from_torch takes keyword arguments only: from_torch(attn_mask=..., "
            "key_padding_mask=...), because a (B, S) key_padding_mask and an (L, S) attn_mask "
            f"are easy to swap. Received: {len(args)} positional argument(s)"
        )
    parts: list[Mask] = []
    biases: list[Tensor] = []
    if attn_mask is not None:
        if not isinstance(attn_mask, Tensor) or attn_mask.dim() not in (2, 3):
            shape = tuple(attn_mask.shape) if isinstance(attn_mask, Tensor) else type(attn_mask)
            raise ValueError(
                f"attn_mask must be a 2-D (L, S) or 3-D (B * H, L, S) tensor. Received: {shape}"
            )
        if attn_mask.dim() == 3:
            if num_heads is None:
                raise ValueError(
                    "a 3-D attn_mask is laid out (B * H, L, S); pass num_heads=H to unpack it. "
                    f"Received: attn_mask.shape={tuple(attn_mask.shape)}, num_heads=None"
                )
            if attn_mask.shape[0] % num_heads:
                raise ValueError(
                    "the first dimension of a 3-D attn_mask must be B * num_heads. "
                    f"Received: attn_mask.shape={tuple(attn_mask.shape)}, num_heads={num_heads}"
                )
            attn_mask = attn_mask.reshape(-1, num_heads, *attn_mask.shape[1:])
        else:
            attn_mask = attn_mask[None, None]
        parts, biases = _split_torch_mask(attn_mask, "attn_mask", parts, biases)
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, Tensor) or key_padding_mask.dim() != 2:
            raise ValueError(
                "key_padding_mask must be a 2-D (B, S) tensor. "
                f"Received: {getattr(key_padding_mask, 'shape', type(key_padding_mask))}"
            )
        if key_padding_mask.dtype == torch.bool:
            parts.append(key_padding(~key_padding_mask))
        else:
            parts, biases = _split_torch_mask(
                key_padding_mask[:, None, None, :], "key_padding_mask", parts, biases
            )
    mask = None
    for p in parts:
        mask = p if mask is None else mask & p
    bias = None
    for b in biases:
        bias = b if bias is None else bias + b
    return TorchMasks(mask, bias)


def _split_torch_mask(
    t: Tensor, name: str, parts: list[Mask], biases: list[Tensor]
) -> tuple[list[Mask], list[Tensor]]:
    if t.dtype == torch.bool:
        return parts + [dense(~t)], biases
    if not t.is_floating_point():
        raise TypeError(
            f"{name} must be bool (True = blocked) or float (additive), as in "
            f"torch.nn.MultiheadAttention. Received: {name}.dtype={t.dtype}"
        )
    if torch.isnan(t).any() or torch.isposinf(t).any():
        raise ValueError(f"{name} may hold finite values and -inf only. Received: NaN or +inf")
    blocked = torch.isneginf(t)
    if blocked.any():
        parts = parts + [dense(~blocked)]
    return parts, biases + [torch.where(blocked, torch.zeros((), dtype=t.dtype), t)]


def from_keras(attention_mask: Tensor) -> Mask:
    """Convert a Keras mask (True / 1 = attend) to a mask.

    Args:
        attention_mask: Keras ``MultiHeadAttention``'s ``attention_mask`` (B, L, S), or a
            (B, S) padding mask such as an ``Embedding(mask_zero=True)`` produces, which
            becomes ``key_padding`` (every query sees the same keys).
    """
    if not isinstance(attention_mask, Tensor):
        attention_mask = torch.as_tensor(attention_mask)
    if attention_mask.dim() not in (2, 3):
        raise ValueError(
            "a Keras mask has shape (B, L, S) (attention_mask) or (B, S) (padding). "
            f"Received: attention_mask.shape={tuple(attention_mask.shape)}"
        )
    if attention_mask.is_floating_point():
        raise TypeError(
            "a Keras attention_mask must be bool or integer (1 = attend). "
            f"Received: attention_mask.dtype={attention_mask.dtype}"
        )
    if attention_mask.dim() == 2:
        return key_padding(attention_mask != 0)
    return dense((attention_mask != 0)[:, None])
