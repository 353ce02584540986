"""Geometry shared by masks and score modifiers: diagonal alignment, bands and crops.

Both ``multihead.masks`` and ``multihead.bias`` place query i of an (L, S) problem at position
``i + offset`` (``offset = S - L`` bottom-right, 0 top-left) and cut shards out of a longer
problem; the rules live here once so the two can never disagree.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["ALIGNS", "TileKind", "Window", "band_kind", "check_align", "offset"]

ALIGNS = ("bottom_right", "top_left")


class TileKind(enum.Enum):
    """How much of a (query tile) x (key range) rectangle is visible."""

    EMPTY = "empty"  # nothing visible: the tile costs nothing
    PARTIAL = "partial"  # some entries visible: apply the mask block
    FULL = "full"  # every entry visible: no mask needed


def check_align(align: object) -> str:
    """``align`` when it is one of ``ALIGNS``, else a ValueError naming both."""
    if align not in ALIGNS:
        raise ValueError(f"align must be 'bottom_right' or 'top_left'. Received: align={align!r}")
    return align


def offset(align: str, length_q: int, length_k: int) -> int:
    """Where query 0 sits among the keys: S - L bottom-right (the last query sees the last key,
    as in KV-cache decoding), 0 top-left (PyTorch's ``is_causal``)."""
    return length_k - length_q if align == "bottom_right" else 0


def band_kind(band: tuple[int | None, int | None], q0: int, q1: int, k0: int, k1: int) -> TileKind:
    """How much of queries [q0, q1) x keys [k0, k1) a band (query i sees key j iff
    lo <= j - i <= hi; None = unbounded) shows, exactly: the rectangle's distances j - i fill
    the whole interval [k0 - (q1 - 1), (k1 - 1) - q0]."""
    lo, hi = band
    d_min, d_max = k0 - (q1 - 1), (k1 - 1) - q0
    if (hi is not None and d_min > hi) or (lo is not None and d_max < lo):
        return TileKind.EMPTY
    if (lo is None or d_min >= lo) and (hi is None or d_max <= hi):
        return TileKind.FULL
    return TileKind.PARTIAL


@dataclass(frozen=True)
class Window:
    """Queries [q0, q1) and keys [k0, k1) of an (L, S) problem: one shard of a longer sequence
    (context parallelism), seen as a (q1 - q0, k1 - k0) problem of its own."""

    length_q: int
    length_k: int
    q0: int
    q1: int
    k0: int
    k1: int

    def __post_init__(self) -> None:
        if not (
            0 <= self.q0 <= self.q1 <= self.length_q and 0 <= self.k0 <= self.k1 <= self.length_k
        ):
            raise ValueError(
                f"a crop must lie inside (L, S)={self.size}. "
                f"Received: queries [{self.q0}, {self.q1}), keys [{self.k0}, {self.k1})"
            )

    @property
    def size(self) -> tuple[int, int]:
        """(L, S) of the whole problem."""
        return self.length_q, self.length_k

    @property
    def shape(self) -> tuple[int, int]:
        """(L, S) of the shard."""
        return self.q1 - self.q0, self.k1 - self.k0

    @property
    def shift(self) -> int:
        """j - i in the whole is (j' - i') + shift in the shard's own indices."""
        return self.k0 - self.q0

    def check_shape(self, what: str, length_q: int, length_k: int) -> None:
        """Raise ValueError unless (L, S) is this shard's shape; ``what`` names the object."""
        if (length_q, length_k) != self.shape:
            raise ValueError(
                f"this cropped {what} is for (L, S)={self.shape}. "
                f"Received: (L, S)={(length_q, length_k)}"
            )

    def outer(self, q0: int, q1: int, k0: int, k1: int) -> tuple[int, int, int, int]:
        """A rectangle in the shard's indices, in the whole problem's indices."""
        return self.q0 + q0, self.q0 + q1, self.k0 + k0, self.k0 + k1

    def inner(self, q0: int, q1: int, k0: int, k1: int) -> tuple[int, int, int, int] | None:
        """A rectangle of the whole, clipped to the shard, in the shard's indices (None when
        nothing of it lies inside)."""
        q0, q1, k0, k1 = max(q0, self.q0), min(q1, self.q1), max(k0, self.k0), min(k1, self.k1)
        if q0 >= q1 or k0 >= k1:
            return None
        return q0 - self.q0, q1 - self.q0, k0 - self.k0, k1 - self.k0

    def key(self) -> tuple[object, ...]:
        """A hashable description, for structure keys."""
        return (self.size, self.q0, self.q1, self.k0, self.k1)

    def describe(self) -> str:
        return f"queries [{self.q0}, {self.q1}) and keys [{self.k0}, {self.k1})"
