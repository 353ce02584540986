"""Block-skipping attention: compute only the key ranges each query tile can see.

For every tile of query rows the mask reports the visible key range and whether it is empty,
fully visible or partly visible. Empty tiles cost nothing, fully visible ranges run without a
mask, and only partly visible columns get a mask block (built for that tile alone; no L x S
tensor). Each tile's key range is split into chunks; chunk results are merged exactly through
their log-sum-exp (the FlashAttention recipe), so softmax statistics stay in float32 or better.

Per-chunk math runs on torch's fused CPU flash kernel when it can (it returns the log-sum-exp
we need); otherwise (other devices, dropout) on plain torch ops. The backward pass recomputes
each chunk from the saved output and log-sum-exp: only O(L) state is kept, never L x S.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import Tensor

from ..masks import Mask, TileKind, _Band, _Combine, _Documents, _KeyPadding, _Lengths
from ._call import Call, repeat_kv, stat_dtype

__all__ = ["plan", "run", "unsupported", "weights"]

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
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
    """One query tile ``[q0, q1)`` of the batch entries ``batch`` (a slice)."""

    batch: slice
    q0: int
    q1: int
    chunks: tuple[Chunk, ...]


def unsupported(call: Call) -> str | None:
    if call.bias is not None and call.bias.requires_grad and torch.is_grad_enabled():
        return "tiled does not compute gradients for bias"
    return None


def query_tile(call: Call) -> int:
    """Rows per query tile: small enough to follow a band's diagonal closely, large enough to
    amortize the per-call cost."""
    _, _, _, length_q, _, _ = call.shape
    mask = call.mask
    if isinstance(mask, _KeyPadding) or (isinstance(mask, _Lengths) and mask.valid_lens.dim() == 1):
        return max(length_q, 1)  # every query row of a batch entry sees the same keys
    if isinstance(mask, _Band) and mask.before is not None and mask.after is not None:
        # one tile per window width: its keys split into two triangles (see _chunks)
        return max(32, min(512, mask.before + mask.after))
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


def _chunks(keep: Tensor, start: int) -> list[Chunk]:
    """Split a partly visible block into key blocks the width of the tile, anchored at its right
    end (where a band's diagonal is): fully visible blocks run without a mask, triangles run as
    causal squares, empty blocks are dropped, and the rest is merged into masked chunks."""
    rows, width = keep.shape[2], keep.shape[3]
    keep = keep.expand(-1, -1, rows, -1)
    step = max(rows, _MIN_FULL_RUN)
    edges = sorted({0, *range(width, 0, -step)})
    pieces: list[tuple[int, int, str]] = []  # (a, b, "full" | "tril" | "triu" | "mask")
    for a, b in itertools.pairwise([*edges, width]):
        block = keep[..., a:b]
        if not bool(block.any()):
            kind = "empty"
        elif bool(block.all()) and b - a >= _MIN_FULL_RUN:
            kind = "full"
        else:
            kind = _pattern(block) or "mask"
        if kind == "empty":
            continue
        if pieces and pieces[-1][1] == a and kind == pieces[-1][2] and kind in ("full", "mask"):
            pieces[-1] = (pieces[-1][0], b, kind)  # merge neighbours of the same kind
        else:
            pieces.append((a, b, kind))
    chunks = []
    for a, b, kind in pieces:
        if kind == "full":
            chunks.append(Chunk(start + a, start + b, None))
            continue
        block = keep[..., a:b]
        if kind == "mask":
            live, seen = block.any(dim=2)[..., None], block.any(dim=-1)
            live = None if bool(live.all()) else live
            seen = None if bool(seen.all()) else seen
            chunks.append(Chunk(start + a, start + b, block, live, None, seen))
        else:  # a triangle: every row and every key of the square takes part
            chunks.append(Chunk(start + a, start + b, block, None, kind, None))
    return chunks


def _structure(mask: Mask | None) -> tuple | None:
    """A hashable description of a mask made of bands only (its plan depends on nothing else)."""
    if isinstance(mask, _Band):
        return ("band", mask.before, mask.after, mask.align)
    if isinstance(mask, _Combine):
        a, b = _structure(mask.a), _structure(mask.b)
        return None if a is None or b is None else (mask.op, a, b)
    return None


_PLANS: dict[tuple, list[Item]] = {}  # plans of band-only masks, reused across calls
_PLAN_CACHE_SIZE = 16


def plan(
    mask: Mask | None, batch: int, length_q: int, length_k: int, tile: int, device
) -> list[Item]:
    """The work list: every query tile with its visible key chunks. Empty tiles are left out.

    Plans of masks made only of causal/sliding-window bands are cached, so a training loop
    plans once.
    """
    structure = _structure(mask)
    if structure is None:
        return _plan(mask, batch, length_q, length_k, tile, device)
    key = (structure, length_q, length_k, tile, _MIN_FULL_RUN, str(device))
    if key not in _PLANS:
        if len(_PLANS) >= _PLAN_CACHE_SIZE:
            _PLANS.pop(next(iter(_PLANS)))
        _PLANS[key] = _plan(mask, batch, length_q, length_k, tile, device)
    return _PLANS[key]


def _plan(
    mask: Mask | None, batch: int, length_q: int, length_k: int, tile: int, device
) -> list[Item]:
    if length_q == 0 or length_k == 0:
        return []
    if mask is None:
        return [Item(slice(None), 0, length_q, (Chunk(0, length_k, None),))]
    groups = [slice(None)] if mask.batch_size is None else [slice(b, b + 1) for b in range(batch)]
    if isinstance(mask, _Documents):
        items = _document_items(mask, groups)
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


def _document_items(mask: _Documents, groups: list[slice]) -> list[Item] | None:
    """Packed sequences whose documents' keys are contiguous: one fully visible item per run of
    equal query ids, however short, so packing many small texts costs one kernel call each and
    no mask at all. None when some document's keys are interleaved with another's."""
    items = []
    for group in groups:
        for q0, q1, span in mask.runs(group.start or 0):
            if span is None:
                continue  # no key shares this id: the rows see nothing
            first, stop, count = span
            if count != stop - first:
                return None
            items.append(Item(group, q0, q1, (Chunk(first, stop, None),)))
    return items


def _items(mask, group, b, length_q, length_k, q0, q1, answer, device) -> list[Item]:
    """The work for one query tile: usually one item; none when no row sees a key; several
    when the tile is split. Query rows at either end that see no key are trimmed off."""
    if answer.kind == TileKind.FULL:
        return [Item(group, q0, q1, (Chunk(answer.start, answer.stop, None),))]
    batch = None if group.start is None else b
    keep = mask.block(
        length_q, length_k, q0, q1, answer.start, answer.stop, batch=batch, device=device
    )
    # a mask that does not depend on the key gives a block one column wide: widen it, or only
    # the first key would be read
    keep = keep.expand(*keep.shape[:3], answer.stop - answer.start)
    seeing = torch.nonzero(keep.any(dim=-1).any(dim=1).any(dim=0)).flatten()
    if seeing.numel() == 0:
        return []
    lo, hi = int(seeing[0]), int(seeing[-1]) + 1
    if keep.shape[2] > 1 and (lo, hi) != (0, q1 - q0):
        trimmed = mask.tile(length_q, length_k, q0 + lo, q0 + hi, batch=b)
        if trimmed.kind == TileKind.EMPTY:
            return []
        return _items(mask, group, b, length_q, length_k, q0 + lo, q0 + hi, trimmed, device)
    chunks = _chunks(keep, answer.start)
    masked = [c for c in chunks if c.keep is not None and c.pattern is None]
    area = sum(c.keep.shape[-1] for c in masked) * (q1 - q0)
    if q1 - q0 >= 2 * _MIN_FULL_RUN and area and _visible(masked) < 0.6 * area:
        # mostly hidden masked work (a tile across a document boundary): split the rows
        mid = (q0 + q1) // 2
        return [
            piece
            for lo, hi in ((q0, mid), (mid, q1))
            if (ans := mask.tile(length_q, length_k, lo, hi, batch=b)).kind != TileKind.EMPTY
            for piece in _items(mask, group, b, length_q, length_k, lo, hi, ans, device)
        ]
    return [Item(group, q0, q1, tuple(chunks))]


def _visible(chunks: list[Chunk]) -> int:
    """Visible entries of masked chunks, counted once per row and key (heads and batch merged)."""
    return sum(int(c.keep.any(dim=1).any(dim=0).sum()) for c in chunks)


def _additive(keep: Tensor | None, bias: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """A float block for the kernels: 0 where visible, -inf where hidden, plus the bias."""
    if keep is None:
        return None if bias is None else bias.to(dtype)
    zero = torch.zeros((), dtype=dtype, device=keep.device)
    block = torch.where(keep, zero, torch.tensor(float("-inf"), dtype=dtype, device=keep.device))
    return block if bias is None else block + bias.to(dtype)


def _bias_block(bias: Tensor | None, item: Item, chunk: Chunk) -> Tensor | None:
    if bias is None:
        return None
    if bias.dim() == 2:
        bias = bias[None, None]
    if bias.shape[0] != 1:
        bias = bias[item.batch]
    if bias.shape[2] != 1:
        bias = bias[:, :, item.q0 : item.q1]
    if bias.shape[3] != 1:
        bias = bias[..., chunk.start : chunk.stop]
    return bias


def _chunk_inputs(ctx: _Ctx, q, k, v, item: Item, chunk: Chunk):
    """(keys, values, additive mask or None, triangle pattern or None) for one chunk, the same
    in the forward and the backward pass."""
    bias = _bias_block(ctx.bias, item, chunk)
    pattern = chunk.pattern if bias is None and ctx.use_flash(q, v) else None
    # float32 beside half inputs (the bias rule); torch's flash kernel accepts it
    add = None if pattern else _additive(chunk.keep, bias, stat_dtype(q.dtype))
    return (*_chunk_kv(k, v, item, chunk), add, pattern)


def _chunk_kv(k: Tensor, v: Tensor, item: Item, chunk: Chunk) -> tuple[Tensor, Tensor]:
    """Key/value rows of a chunk; keys no row of the tile sees are zeroed, never read (padding
    may hold NaN, and 0 * NaN is NaN inside a matmul)."""
    cols = slice(chunk.start, chunk.stop)
    kc, vc = k[item.batch, :, cols], v[item.batch, :, cols]
    if chunk.live is None:
        return kc, vc
    zero = torch.zeros((), dtype=k.dtype, device=k.device)
    return torch.where(chunk.live, kc, zero), torch.where(chunk.live, vc, zero)


class _Ctx:
    """What the per-chunk kernels need besides the tensors."""

    def __init__(self, scale: float, dropout_p: float, seed: int, bias: Tensor | None) -> None:
        self.scale, self.dropout_p, self.seed, self.bias = scale, dropout_p, seed, bias

    def use_flash(self, q: Tensor, v: Tensor) -> bool:
        # torch's CPU flash kernel: no dropout, and one head dim for queries and values
        return q.device.type == "cpu" and self.dropout_p == 0.0 and q.shape[-1] == v.shape[-1]

    def keep_draw(self, shape, index: int, device) -> Tensor:
        """Dropout's keep pattern for chunk ``index``, identical in forward and backward."""
        g = torch.Generator(device=device).manual_seed(self.seed + index)
        return torch.rand(shape, generator=g, device=device) >= self.dropout_p


def _flip(*tensors: Tensor) -> list[Tensor]:
    return [t.flip(2) for t in tensors]


def _chunk_forward(ctx: _Ctx, q, k, v, add, index: int, pattern=None) -> tuple[Tensor, Tensor]:
    """Attention of q over one key chunk: (out [b, H, rows, D_v], lse [b, H, rows]).

    With a triangle ``pattern`` (and no bias) ``add`` is ignored: torch's causal kernel applies
    it and skips the hidden half.
    """
    if ctx.use_flash(q, v):
        if pattern == "tril":
            return _FLASH(q, k, v, is_causal=True, scale=ctx.scale)
        if pattern == "triu":
            o, lse = _FLASH(*_flip(q, k, v), is_causal=True, scale=ctx.scale)
            return o.flip(2), lse.flip(-1)
        return _FLASH(q, k, v, attn_mask=add, scale=ctx.scale)
    f = stat_dtype(q.dtype)
    # scores in float32 for half inputs: a half matmul overflows for finite inputs
    s = (q.to(f) @ k.to(f).transpose(-2, -1)) * ctx.scale  # [b, H, rows, cols]
    if add is not None:
        s = s + add.to(f)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - _finite(lse)[..., None])
    if ctx.dropout_p > 0.0:
        p = p * ctx.keep_draw(p.shape, index, p.device) / (1.0 - ctx.dropout_p)
    return p.to(v.dtype) @ v, lse


def _chunk_backward(ctx: _Ctx, g, q, k, v, out, lse, add, index: int, pattern=None):
    """Gradients of one chunk given the *global* out and log-sum-exp of its rows."""
    if ctx.use_flash(q, v):
        if pattern == "tril":
            return _FLASH_BACKWARD(g, q, k, v, out, lse, 0.0, True, scale=ctx.scale)
        if pattern == "triu":
            grads = _FLASH_BACKWARD(
                *_flip(g, q, k, v, out), lse.flip(-1), 0.0, True, scale=ctx.scale
            )
            return [t.flip(2) for t in grads]
        return _FLASH_BACKWARD(g, q, k, v, out, lse, 0.0, False, attn_mask=add, scale=ctx.scale)
    f = stat_dtype(q.dtype)
    s = (q.to(f) @ k.to(f).transpose(-2, -1)) * ctx.scale
    if add is not None:
        s = s + add.to(f)
    p = torch.exp(s - lse[..., None].to(f))
    g32 = g.to(f)
    dp = g32 @ v.to(f).transpose(-2, -1)
    pd = p
    if ctx.dropout_p > 0.0:
        z = ctx.keep_draw(p.shape, index, p.device) / (1.0 - ctx.dropout_p)
        pd, dp = p * z, dp * z
    row = (g32 * out.to(f)).sum(dim=-1, keepdim=True)
    ds = p * (dp - row) * ctx.scale
    dq = ds @ k.to(f)
    dk = ds.transpose(-2, -1) @ q.to(f)
    dv = pd.transpose(-2, -1) @ g32
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _finite(lse: Tensor) -> Tensor:
    return torch.where(
        torch.isfinite(lse), lse, torch.zeros((), dtype=lse.dtype, device=lse.device)
    )


def _forward(ctx: _Ctx, q, k, v, items: list[Item]) -> tuple[Tensor, Tensor]:
    b, h, length_q, _ = q.shape
    stat = stat_dtype(q.dtype)
    # heads-inner memory layout, so merging heads afterwards (B, L, H * D_v) is a free view
    out = q.new_zeros(b, length_q, h, v.shape[-1]).transpose(1, 2)
    lse = torch.full((b, h, length_q), float("-inf"), dtype=stat, device=q.device)
    index = 0
    for item in items:
        rows = slice(item.q0, item.q1)
        qt = q[item.batch, :, rows]
        acc = total = None
        for chunk in item.chunks:
            kc, vc, add, pattern = _chunk_inputs(ctx, q, k, v, item, chunk)
            o, l_c = _chunk_forward(ctx, qt, kc, vc, add, index, pattern)
            index += 1
            l_c = l_c.to(stat)
            seen = chunk.seen
            if seen is not None:  # the kernel reports lse = 0 for rows that see nothing
                l_c = torch.where(seen, l_c, float("-inf"))
                o = torch.where(seen[..., None], o, 0.0)
            if acc is None:
                acc, total = o.to(stat), l_c
                continue
            new_total = torch.logaddexp(total, l_c)
            safe = _finite(new_total)
            acc = (
                acc * torch.exp(total - safe)[..., None]
                + o.to(stat) * torch.exp(l_c - safe)[..., None]
            )
            total = new_total
        out[item.batch, :, rows] = acc.to(out.dtype)
        lse[item.batch, :, rows] = total
    return out, lse


def _backward(ctx: _Ctx, g, q, k, v, out, lse, items: list[Item]):
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    # rows that saw nothing: +inf makes every recomputed probability exactly 0
    lse = torch.where(torch.isfinite(lse), lse, float("inf"))
    index = 0
    for item in items:
        rows = slice(item.q0, item.q1)
        qt, gt, ot = (t[item.batch, :, rows] for t in (q, g, out))
        lt = lse[item.batch, :, rows]
        for chunk in item.chunks:
            cols = slice(chunk.start, chunk.stop)
            kc, vc, add, pattern = _chunk_inputs(ctx, q, k, v, item, chunk)
            a, b, c = _chunk_backward(ctx, gt, qt, kc, vc, ot, lt, add, index, pattern)
            index += 1
            dq[item.batch, :, rows] += a
            dk[item.batch, :, cols] += b
            dv[item.batch, :, cols] += c
    return dq, dk, dv


class _TiledAttention(torch.autograd.Function):
    @staticmethod
    def forward(fctx, q, k, v, items, ctx):
        out, lse = _forward(ctx, q, k, v, items)
        fctx.save_for_backward(q, k, v, out, lse)
        fctx.items, fctx.ctx = items, ctx
        return out

    @staticmethod
    def backward(fctx, g):
        q, k, v, out, lse = fctx.saved_tensors
        dq, dk, dv = _backward(fctx.ctx, g.contiguous(), q, k, v, out, lse, fctx.items)
        return dq, dk, dv, None, None


def _unit_last(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def run(call: Call) -> tuple[Tensor, Tensor | None]:
    b, h, h_kv, length_q, length_k, _ = call.shape
    # the kernels take any strides with a unit last one; (B, L, H, D) views from a projection
    # need no copy
    q, k, v = (
        _unit_last(t)
        for t in (call.query, repeat_kv(call.key, h // h_kv), repeat_kv(call.value, h // h_kv))
    )
    items = plan(call.mask, b, length_q, length_k, query_tile(call), q.device)
    seed = 0
    if call.dropout_p > 0.0:
        seed = int(torch.randint(0, 2**62, (), device="cpu"))
    ctx = _Ctx(call.scale, call.dropout_p, seed, call.bias)
    if call.needs_grad:
        out = _TiledAttention.apply(q, k, v, items, ctx)
        return out, (weights(call, items) if call.return_weights else None)
    out, lse = _forward(ctx, q, k, v, items)
    return out, (_weights_from_lse(call, k, items, lse) if call.return_weights else None)


def _weights_from_lse(call: Call, k: Tensor, items: list[Item], lse: Tensor) -> Tensor:
    """Weights exp(s - lse) with the forward pass's log-sum-exp as the stabilizer, then each row
    divided by its sum. The division matters: the fused kernel rounds its scores differently,
    so exp(s - lse) alone sums to 1 only up to ulp(s), which for scores near 200 is 5x the error
    of an eager softmax. Not differentiable (used when no gradient is needed)."""
    q = call.query
    b, h, length_q, _ = q.shape
    stat = stat_dtype(q.dtype)
    w = q.new_zeros(b, h, length_q, k.shape[2])
    lse = torch.where(torch.isfinite(lse), lse, float("inf"))  # rows that see nothing -> 0
    for item in items:
        for chunk in item.chunks:
            kc = _chunk_kv(k, k, item, chunk)[0].to(stat).transpose(-2, -1).contiguous()
            add = _additive(chunk.keep, _bias_block(call.bias, item, chunk), stat)
            # row blocks of 256 keep the temporaries small when a tile spans every query
            for r0 in range(item.q0, item.q1, 256):
                r1 = min(r0 + 256, item.q1)
                qt = q[item.batch, :, r0:r1].to(stat)
                nb, rows, cols = qt.shape[0], r1 - r0, kc.shape[-1]
                # scale * q k^T - lse in one call: [b * H, rows, cols]
                s = torch.baddbmm(
                    -lse[item.batch, :, r0:r1, None].reshape(nb * h, rows, 1),
                    qt.reshape(nb * h, rows, -1),
                    kc.reshape(nb * h, -1, cols),
                    alpha=call.scale,
                ).view(nb, h, rows, cols)
                if add is not None:
                    s.add_(add if add.shape[2] == 1 else add[:, :, r0 - item.q0 : r1 - item.q0])
                torch.exp(s, out=w[item.batch, :, r0:r1, chunk.start : chunk.stop])
    return w.div_(w.sum(-1, keepdim=True).clamp_min_(torch.finfo(w.dtype).tiny))


def weights(call: Call, items: list[Item] | None = None) -> Tensor:
    """Softmax weights (B, H, L, S), computed tile by tile over the visible ranges only."""
    b, h, h_kv, length_q, length_k, _ = call.shape
    q = call.query
    k = repeat_kv(call.key, h // h_kv)
    if items is None:
        items = plan(call.mask, b, length_q, length_k, query_tile(call), q.device)
    w = q.new_zeros(b, h, length_q, length_k)
    stat = stat_dtype(q.dtype)
    for item in items:
        rows = slice(item.q0, item.q1)
        lo, hi = item.chunks[0].start, item.chunks[-1].stop
        qt = q[item.batch, :, rows].to(stat)
        # chunks may leave gaps (key blocks no row sees): those stay -inf
        s = torch.full((*qt.shape[:-1], hi - lo), float("-inf"), dtype=stat, device=q.device)
        for chunk in item.chunks:
            kc, _ = _chunk_kv(k, k, item, chunk)
            sc = (qt @ kc.to(stat).transpose(-2, -1)) * call.scale
            add = _additive(chunk.keep, _bias_block(call.bias, item, chunk), stat)
            s[..., chunk.start - lo : chunk.stop - lo] = sc if add is None else sc + add
        # rows that see nothing in this tile keep weight 0 instead of softmax(-inf row) = NaN
        top = s.amax(dim=-1, keepdim=True)
        e = torch.exp(s - torch.where(torch.isfinite(top), top, 0.0))
        total = e.sum(dim=-1, keepdim=True)
        w[item.batch, :, rows, lo:hi] = (e / torch.where(total > 0, total, 1.0)).to(w.dtype)
    return w
