"""The built-in mask kinds: bands (``causal``, ``sliding_window``), ``lengths``, ``key_padding``
and ``documents``.

Each kind states its rule once, in ``mask_mod``; ``block`` comes from it. The tile answers
(``tile``, ``rect_kind``, ``blocks``) are overridden here because each kind knows them in
closed form, faster than evaluating the predicate.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Hashable

import torch
from torch import Tensor

from .. import _geometry as G
from .. import _validation as V
from .base import _EMPTY, Mask, TileKind, _batch_slice, _check_batch, _kind, _tile

__all__ = ["causal", "documents", "key_padding", "lengths", "sliding_window"]


class _Band(Mask):
    """Query i sees key j when ``-before <= j - (i + offset) <= after``.

    ``offset`` is S - L for bottom-right alignment and 0 for top-left; None means unbounded.
    """

    align: str  # always set: a band is tied to the diagonal

    def __init__(self, before: int | None, after: int | None, align: str, name: str) -> None:
        G.check_align(align)
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
        return G.offset(self.align, length_q, length_k)

    def check(self, batch: int, heads: int, length_q: int, length_k: int) -> None:
        return None

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
        self._home = self.valid_lens.device
        self.query_lens = None
        if query_lens is not None:
            self.query_lens = V.check_index_tensor("query_lens", query_lens, (1,), "(B,)")
            if self.query_lens.shape[0] != self.batch_size:
                raise ValueError(
                    "query_lens must have one entry per batch element, like valid_lens. "
                    f"Received: query_lens.shape={tuple(self.query_lens.shape)}, "
                    f"valid_lens.shape={tuple(self.valid_lens.shape)}"
                )

    @property
    def rows_alike(self) -> bool:  # type: ignore[override]
        return self.valid_lens.dim() == 1 and self.query_lens is None

    # the lengths are read on the host only when a planner asks for tiles (eager backends):
    # building the mask inside a compiled graph reads nothing, so it breaks nothing
    @functools.cached_property
    def _host(self) -> list:
        return self.valid_lens.detach().cpu().tolist()

    @functools.cached_property
    def _host_q(self) -> list[int] | None:
        return None if self.query_lens is None else self.query_lens.detach().cpu().tolist()

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
        if V.tracing():  # the range checks read the lengths on the host (see V.tracing)
            return
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
        self._home = keep.device

    rows_alike = True

    @functools.cached_property
    def _spans(self) -> list[tuple[int, int, bool]]:
        """Per batch row (first visible key, last + 1, every key between visible); read on
        the host on first use by a planner, never while a graph is traced."""
        spans = []
        for row in self.keep.detach().cpu():
            idx = torch.nonzero(row).flatten()
            if idx.numel() == 0:
                spans.append((0, 0, False))
                continue
            first, last = int(idx[0]), int(idx[-1]) + 1
            spans.append((first, last, idx.numel() == last - first))
        return spans

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
        self._home = self.query_ids.device
        q = self.query_ids if self.query_ids.dim() == 2 else self.query_ids[None]
        k = self.key_ids if self.key_ids.dim() == 2 else self.key_ids[None]
        self._q, self._k = q, k
        if q.shape[0] != 1 or k.shape[0] != 1:
            if q.shape[0] != 1 and k.shape[0] != 1 and q.shape[0] != k.shape[0]:
                raise ValueError(
                    "query_ids and key_ids must have the same batch size. "
                    f"Received: query_ids.shape={tuple(query_ids.shape)}, "
                    f"key_ids.shape={tuple(self.key_ids.shape)}"
                )
            self.batch_size = max(q.shape[0], k.shape[0])

    # the ids are read on the host only when a planner asks for tiles (see _Lengths._host)
    @functools.cached_property
    def _host_q(self) -> Tensor:
        return self._q.detach().cpu()

    @functools.cached_property
    def _key_spans(self) -> list[dict[int, tuple[int, int, int]]]:
        """Per batch row of keys: id -> (first, last + 1, count)."""
        spans = []
        for row in self._k.detach().cpu():
            ids, inverse, counts = torch.unique(row, return_inverse=True, return_counts=True)
            pos = torch.arange(row.numel())
            first = torch.full((ids.numel(),), row.numel()).scatter_reduce(0, inverse, pos, "amin")
            last = torch.full((ids.numel(),), -1).scatter_reduce(0, inverse, pos, "amax")
            spans.append(
                {
                    int(i): (int(f), int(x) + 1, int(c))
                    for i, f, x, c in zip(ids, first, last, counts)
                }
            )
        return spans

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
