"""The tiled backend's work list: which query tiles meet which key chunks, and how.

For every tile of query rows the mask reports the visible key range and whether it is empty,
fully visible or partly visible. A partly visible range is cut into key blocks the width of the
tile: fully visible blocks need no mask, exact triangles run on a causal kernel, empty blocks are
dropped, and only the rest keeps a bool block. The plan knows nothing about the kernels that
execute it; it only asks the mask (``tile``, ``rect_kind``, ``block``, ``blocks``,
``tile_rows``, ``structure_key``), never which kind of mask it is. A key block the mask can
call empty or fully visible (``rect_kind``) is never evaluated: a causal tile evaluates its
diagonal square, not every key it sees.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import Tensor

from .._cache import Bounded
from ..masks import Mask, TileKind
from .call import Call

__all__ = ["Chunk", "Item", "plan", "query_tile"]

_MIN_FULL_RUN = 32  # narrowest key block worth its own kernel call


@dataclass(frozen=True)
class Chunk:
    """Keys ``[start, stop)`` of one query tile; ``keep`` is None when fully visible."""

    start: int
    stop: int
    keep: Tensor | None  # bool [b|1, H|1, rows, stop - start]
    live: Tensor | None = None  # bool [b|1, H|1, stop - start, 1]: keys some row sees; None = all
    # "tril": a square lower triangle (row a sees columns <= a), which torch's flash kernel runs
    # with is_causal and no mask; "triu": the mirror image (columns >= a), run the same way on
    # rows and keys in reverse order
    pattern: str | None = None
    seen: Tensor | None = None  # bool [b|1, H|1, rows]: rows that see a key here; None = all


@dataclass(frozen=True)
class Item:
    """One query tile ``[q0, q1)`` of the batch entries ``batch`` (a slice).

    ``stack > 1``: the rows are that many equal documents back to back, each seeing exactly its
    own rows as keys (one chunk spans them all); a kernel may run them as one batched call.
    """

    batch: slice
    q0: int
    q1: int
    chunks: tuple[Chunk, ...]
    stack: int = 1

    def unstacked(self) -> list[Item]:
        """The documents of a stacked item as items of their own."""
        if self.stack == 1:
            return [self]
        n = (self.q1 - self.q0) // self.stack
        return [
            Item(self.batch, a, a + n, (Chunk(a, a + n, None),)) for a in range(self.q0, self.q1, n)
        ]


def query_tile(call: Call) -> int:
    """Rows per query tile: the mask's own preference (one tile for masks that treat every row
    alike, a window's width for bands), else 256, which amortizes the per-call cost."""
    _, _, _, length_q, length_k, _ = call.shape
    preferred = None if call.mask is None else call.mask.tile_rows(length_q, length_k)
    if preferred is not None:
        return preferred
    return 256 if length_q > 256 else max(length_q, 1)


def _pattern(block: Tensor) -> str | None:
    """'tril' / 'triu' when a shared square block is exactly that triangle, else None."""
    rows, cols = block.shape[-2:]
    if rows != cols or block.shape[0] != 1 or block.shape[1] != 1 or rows < _MIN_FULL_RUN:
        return None
    tri = torch.ones(rows, cols, dtype=torch.bool, device=block.device).tril()
    if torch.equal(block[0, 0], tri):
        return "tril"
    if torch.equal(block[0, 0], tri.T):
        return "triu"
    return None


def _kind(block: Tensor) -> str:
    """What a key block of a tile is: "empty", "full" (wide enough to run unmasked), a
    triangle ("tril", "triu") or "mask"."""
    if not bool(block.any()):
        return "empty"
    if bool(block.all()) and block.shape[-1] >= _MIN_FULL_RUN:
        return "full"
    return _pattern(block) or "mask"


Piece = tuple[int, int, str, "Tensor | None"]  # keys [k0, k1), its kind, its keep block


def _pieces(
    mask: Mask,
    batch: int | None,
    b: int,
    size: tuple[int, int],
    rows: tuple[int, int],
    keys: tuple[int, int],
    device,
) -> list[Piece]:
    """A partly visible key range of one query tile cut into key blocks the width of the tile,
    anchored at its right end (where a band's diagonal is), each with its kind ("full",
    "tril", "triu" or "mask"); empty blocks are left out. The mask is asked first
    (``rect_kind``: exact for bands, cheap for the other kinds); only the blocks it cannot
    call empty or fully visible are evaluated, so a band's tile evaluates its diagonal alone.
    A block comes as [b|1, H|1, rows, width], with one row for a mask that does not depend on
    the query (key padding), whose blocks are then the narrowest worth a kernel call; a fully
    visible one as None."""
    (length_q, length_k), (q0, q1), (start, stop) = size, rows, keys
    width = stop - start
    height = q1 - q0
    if height > 1:  # a two-row probe tells whether the mask depends on the query
        probe = mask.block(
            length_q, length_k, q0, q0 + 2, start, start + 1, batch=batch, device=device
        )
        height = height if probe.shape[2] > 1 else 1
    step = max(height, _MIN_FULL_RUN)
    edges = sorted({0, *range(width, 0, -step)})
    pieces: list[Piece] = []
    for a, z in itertools.pairwise([*edges, width]):
        k0, k1 = start + a, start + z
        known = mask.rect_kind(length_q, length_k, q0, q1, k0, k1, batch=b)
        if known == TileKind.EMPTY:
            continue
        if known == TileKind.FULL and k1 - k0 >= _MIN_FULL_RUN:
            pieces.append((k0, k1, "full", None))
            continue
        block = mask.block(length_q, length_k, q0, q1, k0, k1, batch=batch, device=device)
        # a mask that does not depend on the key gives a block one column wide: widen it, or
        # only the first key would be read
        block = block.expand(*block.shape[:2], height, k1 - k0)
        kind = _kind(block)
        if kind != "empty":
            pieces.append((k0, k1, kind, block))
    return pieces


def _seeing(pieces: list[Piece], rows: int) -> tuple[int, int] | None:
    """The first and one past the last of a tile's ``rows`` rows that see a key in ``pieces``;
    None when none does. Blocks of one row stand for every row."""
    if not pieces:
        return None
    if any(kind == "full" or block.shape[2] == 1 for _, _, kind, block in pieces):
        return 0, rows
    seeing = None
    for *_, block in pieces:
        assert block is not None  # only fully visible pieces come without a block
        row = block.any(dim=-1).any(dim=1).any(dim=0)
        seeing = row if seeing is None else seeing | row
    assert seeing is not None
    found = torch.nonzero(seeing).flatten()
    return int(found[0]), int(found[-1]) + 1


def _joined(blocks: list[Tensor]) -> Tensor:
    """Neighbouring key blocks of one tile as one block (keys side by side)."""
    if len(blocks) == 1:
        return blocks[0]
    lead = torch.broadcast_shapes(*(t.shape[:3] for t in blocks))
    return torch.cat([t.expand(*lead, t.shape[-1]) for t in blocks], dim=-1)


def _chunks(pieces: list[Piece]) -> list[Chunk]:
    """A tile's pieces as chunks: fully visible runs need no mask, triangles run as causal
    squares, and neighbouring masked pieces merge into one masked chunk."""
    runs: list[tuple[int, int, str, list]] = []  # (k0, k1, kind, blocks)
    for k0, k1, kind, block in pieces:
        last = runs[-1] if runs else None
        if last is not None and last[1] == k0 and kind == last[2] and kind in ("full", "mask"):
            runs[-1] = (last[0], k1, kind, [*last[3], block])
        else:
            runs.append((k0, k1, kind, [block]))
    chunks = []
    for k0, k1, kind, blocks in runs:
        if kind == "full":
            chunks.append(Chunk(k0, k1, None))
            continue
        block = _joined(blocks)
        if kind == "mask":
            live, seen = block.any(dim=2)[..., None], block.any(dim=-1)
            live = None if bool(live.all()) else live
            seen = None if bool(seen.all()) else seen
            chunks.append(Chunk(k0, k1, block, live, None, seen))
        else:  # a triangle: every row and every key of the square takes part
            chunks.append(Chunk(k0, k1, block, None, kind, None))
    return chunks


_PLANS: Bounded[tuple, list[Item]] = Bounded(16)  # plans of band-only masks, reused across calls
KEPT_ON_MASK = 4  # shapes whose plans a mask keeps in its memo (the most recently used)
# a plan whose keep blocks hold more bits than this is not kept (a dense mask's partial tiles
# could double the memory its own tensor holds): it is made again at each call
KEPT_BITS = 64 << 20


def plan(
    mask: Mask | None,
    batch: int,
    length_q: int,
    length_k: int,
    tile: int,
    device,
    *,
    stack: bool = False,
) -> list[Item]:
    """The work list: every query tile with its visible key chunks. Empty tiles are left out.
    With ``stack``, runs of equal packed documents come as stacked items (see ``Item``).

    Plans of masks whose pattern depends only on (L, S) (their ``structure_key``; causal and
    sliding-window bands) are cached, so a training loop plans once. Other masks (predicates,
    documents, dense masks) keep their plans in their memo (``Mask.memo``), as they keep their
    tile answers
    (a mask does not change once made; a plan whose keep blocks exceed ``KEPT_BITS`` is made
    anew instead): a predicate mask used again with the same shapes plans once too, as the
    built-in kinds do.
    """
    structure = None if mask is None else mask.structure_key
    if mask is not None and structure is None:
        kept = mask.memo("plans", KEPT_ON_MASK)
        key = (batch, length_q, length_k, tile, _MIN_FULL_RUN, str(device), stack)
        items = kept.get(key)
        if items is not None:
            return items
        items = _plan(mask, batch, length_q, length_k, tile, device)
        items = _stacked(items, batch) if stack else items
        bits = sum(c.keep.numel() for i in items for c in i.chunks if c.keep is not None)
        if bits <= KEPT_BITS:
            kept[key] = items
        return items
    if structure is None:
        return _plan(mask, batch, length_q, length_k, tile, device)
    key = (structure, length_q, length_k, tile, _MIN_FULL_RUN, str(device))
    found = _PLANS.get(key)
    if found is None:
        found = _PLANS[key] = _plan(mask, batch, length_q, length_k, tile, device)
    return found


def _plan(
    mask: Mask | None, batch: int, length_q: int, length_k: int, tile: int, device
) -> list[Item]:
    if length_q == 0 or length_k == 0:
        return []
    if mask is None:
        return [Item(slice(None), 0, length_q, (Chunk(0, length_k, None),))]
    groups = [slice(None)] if mask.batch_size is None else [slice(b, b + 1) for b in range(batch)]
    items = _rectangle_items(mask, groups, length_q, length_k)
    if items is not None:
        return items
    items = []
    for group in groups:
        b = group.start or 0
        for q0 in range(0, length_q, tile):
            q1 = min(q0 + tile, length_q)
            answer = mask.tile(length_q, length_k, q0, q1, batch=b)
            if answer.kind == TileKind.EMPTY:
                continue
            items += _items(mask, group, b, length_q, length_k, q0, q1, answer, device)
    return items


def _rectangle_items(
    mask: Mask, groups: list[slice], length_q: int, length_k: int
) -> list[Item] | None:
    """Masks that are exactly a set of fully visible rectangles (packed documents): one
    unmasked item per rectangle, however small, so packing many short texts costs one kernel
    call each and no mask at all. None when the mask is not of that form."""
    items = []
    for group in groups:
        rects = mask.blocks(length_q, length_k, batch=group.start or 0)
        if rects is None:
            return None
        items += [Item(group, q0, q1, (Chunk(k0, k1, None),)) for q0, q1, k0, k1 in rects]
    return items


def _stacked(items: list[Item], batch: int) -> list[Item]:
    """Runs of consecutive equal self-attention documents (the usual result of packing texts
    sorted by length) merged into stacked items: one kernel call instead of one per text."""
    out: list[Item] = []
    for item in items:
        if len(item.chunks) != 1:
            out.append(item)
            continue
        (chunk,) = item.chunks
        n = item.q1 - item.q0
        own = (chunk.start, chunk.stop) == (item.q0, item.q1) and chunk.keep is None
        one_row = item.batch.start is not None or batch == 1
        prev = out[-1] if out else None
        if (
            own
            and one_row
            and prev is not None
            and prev.batch == item.batch
            and prev.q1 == item.q0
            and prev.chunks[0].stop == item.q0
            and (prev.q1 - prev.q0) // prev.stack == n
            and prev.chunks[0].start == prev.q0
        ):
            out[-1] = Item(
                item.batch, prev.q0, item.q1, (Chunk(prev.q0, item.q1, None),), prev.stack + 1
            )
        else:
            out.append(item)
    return out


def _items(mask, group, b, length_q, length_k, q0, q1, answer, device) -> list[Item]:
    """The work for one query tile: usually one item; none when no row sees a key; several
    when the tile is split. Query rows at either end that see no key are trimmed off."""
    if answer.kind == TileKind.FULL:
        return [Item(group, q0, q1, (Chunk(answer.start, answer.stop, None),))]
    batch = None if group.start is None else b
    size, keys = (length_q, length_k), (answer.start, answer.stop)
    pieces = _pieces(mask, batch, b, size, (q0, q1), keys, device)
    seeing = _seeing(pieces, q1 - q0)
    if seeing is None:
        return []
    lo, hi = seeing
    if (lo, hi) != (0, q1 - q0):
        trimmed = mask.tile(length_q, length_k, q0 + lo, q0 + hi, batch=b)
        if trimmed.kind == TileKind.EMPTY:
            return []
        return _items(mask, group, b, length_q, length_k, q0 + lo, q0 + hi, trimmed, device)
    chunks = _chunks(pieces)
    if _mostly_hidden(chunks, q1 - q0):
        # a tile across a document boundary: split the rows
        mid = (q0 + q1) // 2
        return [
            piece
            for lo, hi in ((q0, mid), (mid, q1))
            if (ans := mask.tile(length_q, length_k, lo, hi, batch=b)).kind != TileKind.EMPTY
            for piece in _items(mask, group, b, length_q, length_k, lo, hi, ans, device)
        ]
    return [Item(group, q0, q1, tuple(chunks))]


def _mostly_hidden(chunks: list[Chunk], rows: int) -> bool:
    """True when a tile of ``rows`` rows is worth splitting: its masked chunks are mostly
    hidden work."""
    masked = [c for c in chunks if c.keep is not None and c.pattern is None]
    area = sum(c.keep.shape[-1] for c in masked) * rows
    return rows >= 2 * _MIN_FULL_RUN and bool(area) and _visible(masked) < 0.6 * area


def _visible(chunks: list[Chunk]) -> int:
    """Visible entries of masked chunks, counted once per row and key (heads and batch merged)."""
    return sum(int(c.keep.any(dim=1).any(dim=0).sum()) for c in chunks)
