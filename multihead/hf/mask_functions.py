"""transformers' mask functions as multihead masks whose tiles are known.

transformers describes every attention pattern as a predicate ``(b, h, q_idx, kv_idx) -> bool``
built from a few factories (``causal_mask_function``, ``sliding_window_overlay``,
``chunked_overlay``, ``padding_mask_function``, ``packed_sequence_mask_function``, ...) and
combined with ``and_masks`` / ``or_masks``; its ``sdpa`` and ``eager`` paths evaluate that
predicate into a dense (B, 1, L, S) tensor. ``make_mask`` (registered with transformers'
``AttentionMaskInterface``) reads the same predicate as data instead: each factory's closure,
read by ``_transformers.read_mask_function`` (the one module that reads transformers' private
names), becomes the built-in kind that says the same thing (``causal``, ``sliding_window``,
``key_padding``, ``documents``), so a sliding-window model skips what its window hides. A
predicate made of anything else, or one this version of transformers spells in a way the
reader does not know, is evaluated as transformers evaluates it: ``masks.predicate`` over the
batch (index-based functions) or, for functions transformers itself only evaluates under
``torch.vmap``, the dense tensor ``sdpa`` would have received.

A band that every (query, key) pair of the call lies in hides nothing and is dropped where it
meets another part: a decoding step over its whole cache, causal and padded, is the padding
alone (``key_padding``), a mask that holds for any number of query rows.

Positions: transformers evaluates query i and key j at absolute positions ``i + q_offset`` and
``j + kv_offset`` (a KV cache, a sliding-window cache). A band of absolute distances
``lo <= P_k - P_q <= hi`` is therefore the local band ``lo + d0 <= j - i <= hi + d0`` with
``d0 = q_offset - kv_offset``; it is expressed with bottom-right or top-left alignment when one
of them matches, else as a crop of the band over the whole (absolute) problem.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from transformers import masking_utils as mu

from .. import masks
from ..masks import Mask
from ._transformers import read_mask_function

__all__ = ["make_mask"]

MaskFunction = Callable[..., Any]


@dataclass(frozen=True)
class _Geometry:
    """One call of the mask interface: local sizes and where they sit in absolute positions."""

    batch: int
    length_q: int
    length_k: int
    q_offset: int
    kv_offset: int
    device: torch.device

    @property
    def shift(self) -> int:
        """d0: local distance j - i = absolute distance P_k - P_q + d0."""
        return self.q_offset - self.kv_offset


@dataclass(frozen=True)
class _Band:
    """Absolute distances lo <= P_k - P_q <= hi (None: unbounded)."""

    lo: int | None
    hi: int | None

    def __and__(self, other: _Band) -> _Band:
        lo = [x for x in (self.lo, other.lo) if x is not None]
        hi = [x for x in (self.hi, other.hi) if x is not None]
        return _Band(max(lo) if lo else None, min(hi) if hi else None)


class _All:
    """The predicate that is True everywhere (bidirectional attention, no restriction)."""


_ALL = _All()
_Part = Mask | _Band | _All


class _Unknown(Exception):
    """A predicate this module does not recognize: the caller evaluates it instead."""


def _translate(fn: object, geo: _Geometry) -> _Part:
    """``fn`` as a band, a multihead mask in local coordinates, or _ALL; _Unknown otherwise
    (a function transformers' factories did not make, or one this version cannot read)."""
    read = read_mask_function(fn)
    if read is None:
        raise _Unknown(fn)
    kind, cells = read
    if kind == "causal":
        return _Band(None, 0)
    if kind == "bidirectional":
        return _ALL
    if kind == "sliding":  # kv > q - w
        return _Band(1 - int(cells["sliding_window"]), None)
    if kind == "sliding_both":  # |q - kv| <= w
        w = int(cells["sliding_window"])
        return _Band(-w, w)
    if kind == "padding":
        return _padding(cells["padding_mask"], geo)
    if kind == "chunked":  # (kv - pad_b) // c == (q - pad_b) // c: one document per chunk
        size, left = int(cells["chunk_size"]), cells["left_padding"].to(geo.device)
        ids_q = torch.arange(geo.length_q, device=geo.device) + geo.q_offset
        ids_k = torch.arange(geo.length_k, device=geo.device) + geo.kv_offset
        return masks.documents(
            (ids_q[None] - left[:, None]) // size, (ids_k[None] - left[:, None]) // size
        )
    if kind == "packed":  # psm[b, q] == psm[b, kv]
        ids = cells["packed_sequence_mask"]
        return masks.documents(
            ids[:, geo.q_offset : geo.q_offset + geo.length_q],
            ids[:, geo.kv_offset : geo.kv_offset + geo.length_k],
        )
    if kind == "and":
        return _and(cells["mask_functions"], geo)
    if kind == "or":
        return _or([_translate(f, geo) for f in cells["mask_functions"]], geo)
    raise _Unknown(fn)  # remap or offsets outside the combinations handled in _and


def _padding(padding: Tensor, geo: _Geometry) -> _Part:
    """A 2-D padding mask padding[b, kv] (prepared to kv_offset + kv_length) as key padding."""
    pad = padding[:, geo.kv_offset : geo.kv_offset + geo.length_k]
    return _ALL if bool(pad.all()) else masks.key_padding(pad.to(torch.bool))


def _and(functions: tuple, geo: _Geometry) -> _Part:
    read = [read_mask_function(f) for f in functions]
    kinds = [None if r is None else r[0] for r in read]
    parts: list[_Part] = []
    for f, r in zip(functions, read):
        if r is not None and r[0] == "remap" and "packed" in kinds:
            # inside one packed sequence the positions rise by exactly one per token, so a
            # pattern of position differences is the same pattern of index differences
            parts.append(_translate(r[1]["mask_function"], geo))
        else:
            parts.append(_translate(f, geo))
    total: _Part = _ALL
    for part in parts:
        total = _meet(total, part, geo)
    return total


def _or_all(part: _Part, geo: _Geometry) -> _Part:
    """``part``, or _ALL where it is a band every (query, key) pair of the call lies in (the
    causal band of a decoding step over its whole cache)."""
    if not isinstance(part, _Band) or geo.length_q == 0 or geo.length_k == 0:
        return part
    least = geo.kv_offset - (geo.q_offset + geo.length_q - 1)  # the smallest P_k - P_q
    most = geo.kv_offset + geo.length_k - 1 - geo.q_offset
    if (part.lo is None or part.lo <= least) and (part.hi is None or most <= part.hi):
        return _ALL
    return part


def _meet(a: _Part, b: _Part, geo: _Geometry) -> _Part:
    if isinstance(a, _All):
        return b
    if isinstance(b, _All):
        return a
    if isinstance(a, _Band) and isinstance(b, _Band):
        return a & b
    a, b = _or_all(a, geo), _or_all(b, geo)  # a band that hides nothing adds nothing to a mask
    if isinstance(a, _All):
        return b
    if isinstance(b, _All):
        return a
    return _as_mask(a, geo) & _as_mask(b, geo)


def _or(parts: list[_Part], geo: _Geometry) -> _Part:
    total: Mask | None = None
    for p in parts:
        if isinstance(p, _All):
            return _ALL
        total = _as_mask(p, geo) if total is None else total | _as_mask(p, geo)
    if total is None:
        raise _Unknown(parts)
    return total


def _as_mask(part: Mask | _Band, geo: _Geometry) -> Mask:
    return part if isinstance(part, Mask) else _band_mask(part, geo)


def _band_mask(band: _Band, geo: _Geometry) -> Mask:
    """A band of absolute distances as a built-in kind in local coordinates."""
    lo, hi = band.lo, band.hi
    # the kinds express bands around the diagonal, bounded above (causal and windows)
    if hi is None or hi < 0 or (lo is not None and (lo > 0 or lo > hi)):
        raise _Unknown(band)
    aligned = _aligned(lo, hi, geo)
    if aligned is not None:
        return aligned
    whole = _kind_mask(None if lo is None else -lo, hi, "top_left")
    q0, k0, length_q, length_k = geo.q_offset, geo.kv_offset, geo.length_q, geo.length_k
    return whole.crop(q0 + length_q, k0 + length_k, q0, q0 + length_q, k0, k0 + length_k)


def _aligned(lo: int | None, hi: int, geo: _Geometry) -> Mask | None:
    """The band as causal() or sliding_window() with bottom-right or top-left alignment, when
    one of them puts it around its diagonal; else None."""
    for align, offset in (("bottom_right", geo.length_k - geo.length_q), ("top_left", 0)):
        # local band [lo + shift, hi + shift] around the alignment's diagonal
        before = None if lo is None else offset - (lo + geo.shift)
        after = hi + geo.shift - offset
        if (before is None and after == 0) or (before is not None and before >= 0 <= after):
            return _kind_mask(before, after, align)
    return None


def _kind_mask(before: int | None, after: int, align: str) -> Mask:
    if before is None:
        if after == 0:
            return masks.causal(align=align)
        raise _Unknown((before, after))
    return masks.sliding_window(before, after, align=align)


def _fallback(
    fn: MaskFunction, geo: _Geometry, use_vmap: bool, padding: Tensor | None
) -> Mask | None:
    """A predicate transformers' factories do not describe: evaluated by the library from the
    function itself (index-based functions), or lowered as transformers lowers it for sdpa."""
    if use_vmap:  # transformers evaluates these only under vmap: keep its lowering
        keep = mu.sdpa_mask(
            batch_size=geo.batch,
            q_length=geo.length_q,
            kv_length=geo.length_k,
            q_offset=geo.q_offset,
            kv_offset=geo.kv_offset,
            mask_function=fn,
            attention_mask=padding,
            allow_is_causal_skip=False,
            use_vmap=True,
            device=geo.device,
        )
        return None if keep is None else masks.dense(keep)
    q_offset, kv_offset = geo.q_offset, geo.kv_offset

    def shifted(b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        return fn(b, h, q + q_offset, k + kv_offset)

    shifted.__name__ = getattr(fn, "__name__", "mask_function")
    mask = masks.predicate(shifted, batch_size=geo.batch, device=geo.device)
    if padding is not None:
        part = _padding(padding, geo)
        mask = mask if isinstance(part, _All) else mask & _as_mask(part, geo)
    return mask


def make_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | Tensor = 0,
    kv_offset: int = 0,
    mask_function: MaskFunction = mu.causal_mask_function,
    attention_mask: Tensor | None = None,
    use_vmap: bool = False,
    device: torch.device | str = "cpu",
    **kwargs: object,
) -> Mask | None:
    """The mask function registered with transformers' ``AttentionMaskInterface``.

    Takes what transformers passes to every mask interface (sizes, offsets, the predicate,
    the 2-D padding mask) and returns a multihead ``Mask`` over the local (L, S) =
    (``q_length``, ``kv_length``) problem, or None when every query sees every key. The
    attention function ``multihead.hf`` registers receives it as ``attention_mask``. Other
    keywords (``dtype``, ``config``, ``local_size``, the sdpa-only skip switches) do not
    change the pattern and are ignored.
    """
    geo = _Geometry(
        batch_size, q_length, kv_length, int(q_offset), int(kv_offset), torch.device(device)
    )
    padding = mu.prepare_padding_mask(attention_mask, kv_length, geo.kv_offset)
    try:
        part = _translate(mask_function, geo)
        if padding is not None:
            part = _meet(part, _padding(padding, geo), geo)
        return None if isinstance(part, _All) else _as_mask(part, geo)
    except _Unknown:
        return _fallback(mask_function, geo, use_vmap, padding)
