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

from ..masks import Mask, TileKind
from ._call import Call, repeat_kv

__all__ = ["plan", "run", "unsupported", "weights"]

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
_MIN_FULL_RUN = 32  # a shorter run of fully visible key columns is not worth its own call


@dataclass(frozen=True)
class Chunk:
    """Keys ``[start, stop)`` of one query tile; ``keep`` is None when fully visible."""

    start: int
    stop: int
    keep: Tensor | None  # bool [b|1, H|1, rows, stop - start]
    live: Tensor | None = None  # bool [b|1, H|1, stop - start, 1]: keys some row sees; None = all


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
    window = getattr(mask, "before", None)
    if window is not None and getattr(mask, "after", None) is not None:
        return max(32, min(256, (window + mask.after) // 2))
    return 256 if length_q > 256 else max(length_q, 1)


def _runs(flags: Tensor) -> list[tuple[int, int, bool]]:
    """Split a 1-D bool tensor into maximal runs: (start, stop, value)."""
    n = flags.numel()
    edges = torch.nonzero(flags[1:] != flags[:-1]).flatten().add(1).tolist()
    bounds = [0, *edges, n]
    first = bool(flags[0])
    return [
        (a, b, first if i % 2 == 0 else not first)
        for i, (a, b) in enumerate(itertools.pairwise(bounds))
    ]


def _chunks(keep: Tensor, start: int) -> list[Chunk]:
    """Split a partly visible block into fully visible runs (no mask) and masked runs."""
    rows = keep.shape[2]
    full_cols = keep.expand(-1, -1, rows, -1).all(dim=2).all(dim=1).all(dim=0)  # [cols]
    pieces: list[tuple[int, int, bool]] = []
    for a, b, full in _runs(full_cols):
        full = full and b - a >= _MIN_FULL_RUN
        if pieces and not full and not pieces[-1][2]:
            pieces[-1] = (pieces[-1][0], b, False)  # merge neighbouring masked runs
        else:
            pieces.append((a, b, full))
    chunks = []
    for a, b, full in pieces:
        if full:
            chunks.append(Chunk(start + a, start + b, None))
            continue
        block = keep[..., a:b]
        live = block.any(dim=2)[..., None]
        chunks.append(Chunk(start + a, start + b, block, None if bool(live.all()) else live))
    return chunks


def plan(
    mask: Mask | None, batch: int, length_q: int, length_k: int, tile: int, device
) -> list[Item]:
    """The work list: every query tile with its visible key chunks. Empty tiles are left out."""
    if length_q == 0 or length_k == 0:
        return []
    if mask is None:
        return [Item(slice(None), 0, length_q, (Chunk(0, length_k, None),))]
    groups = [slice(None)] if mask.batch_size is None else [slice(b, b + 1) for b in range(batch)]
    items = []
    for group in groups:
        b = group.start or 0
        for q0 in range(0, length_q, tile):
            q1 = min(q0 + tile, length_q)
            answer = mask.tile(length_q, length_k, q0, q1, batch=b)
            if answer.kind == TileKind.EMPTY:
                continue
            if answer.kind == TileKind.FULL:
                chunks = [Chunk(answer.start, answer.stop, None)]
            else:
                keep = mask.block(
                    length_q,
                    length_k,
                    q0,
                    q1,
                    answer.start,
                    answer.stop,
                    batch=None if group.start is None else b,
                    device=device,
                )
                chunks = _chunks(keep, answer.start)
            items.append(Item(group, q0, q1, tuple(chunks)))
    return items


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


def _chunk_kv(k: Tensor, v: Tensor, item: Item, chunk: Chunk) -> tuple[Tensor, Tensor]:
    """Key/value rows of a chunk; keys no row of the tile sees are zeroed, never read (padding
    may hold NaN, and 0 * NaN is NaN inside a matmul)."""
    cols = slice(chunk.start, chunk.stop)
    kc, vc = k[item.batch, :, cols], v[item.batch, :, cols]
    if chunk.live is None:
        return kc, vc
    zero = torch.zeros((), dtype=k.dtype, device=k.device)
    return torch.where(chunk.live, kc, zero), torch.where(chunk.live, vc, zero)


def _row_any(chunk: Chunk) -> Tensor | None:
    """[b|1, H|1, rows] rows that see at least one key of this chunk; None if all do."""
    if chunk.keep is None:
        return None
    return chunk.keep.any(dim=-1)


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


def _chunk_forward(ctx: _Ctx, q, k, v, add, index: int) -> tuple[Tensor, Tensor]:
    """Attention of q over one key chunk: (out [b, H, rows, D_v], lse [b, H, rows])."""
    if ctx.use_flash(q, v):
        return _FLASH(q, k, v, attn_mask=add, scale=ctx.scale)
    f = _stat(q.dtype)
    s = (q @ k.transpose(-2, -1)).to(f) * ctx.scale  # [b, H, rows, cols]
    if add is not None:
        s = s + add.to(f)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - _finite(lse)[..., None])
    if ctx.dropout_p > 0.0:
        p = p * ctx.keep_draw(p.shape, index, p.device) / (1.0 - ctx.dropout_p)
    return p.to(v.dtype) @ v, lse


def _chunk_backward(ctx: _Ctx, g, q, k, v, out, lse, add, index: int):
    """Gradients of one chunk given the *global* out and log-sum-exp of its rows."""
    if ctx.use_flash(q, v):
        return _FLASH_BACKWARD(g, q, k, v, out, lse, 0.0, False, attn_mask=add, scale=ctx.scale)
    f = _stat(q.dtype)
    s = (q @ k.transpose(-2, -1)).to(f) * ctx.scale
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


def _stat(dtype: torch.dtype) -> torch.dtype:
    """Softmax statistics: float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _finite(lse: Tensor) -> Tensor:
    return torch.where(
        torch.isfinite(lse), lse, torch.zeros((), dtype=lse.dtype, device=lse.device)
    )


def _forward(ctx: _Ctx, q, k, v, items: list[Item]) -> tuple[Tensor, Tensor]:
    b, h, length_q, _ = q.shape
    stat = _stat(q.dtype)
    out = q.new_zeros(b, h, length_q, v.shape[-1])
    lse = torch.full((b, h, length_q), float("-inf"), dtype=stat, device=q.device)
    index = 0
    for item in items:
        rows = slice(item.q0, item.q1)
        qt = q[item.batch, :, rows]
        acc = total = None
        for chunk in item.chunks:
            add = _additive(chunk.keep, _bias_block(ctx.bias, item, chunk), q.dtype)
            kc, vc = _chunk_kv(k, v, item, chunk)
            o, l_c = _chunk_forward(ctx, qt, kc, vc, add, index)
            index += 1
            l_c = l_c.to(stat)
            seen = _row_any(chunk)
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
            add = _additive(chunk.keep, _bias_block(ctx.bias, item, chunk), q.dtype)
            kc, vc = _chunk_kv(k, v, item, chunk)
            a, b, c = _chunk_backward(ctx, gt, qt, kc, vc, ot, lt, add, index)
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


def run(call: Call) -> tuple[Tensor, Tensor | None]:
    b, h, h_kv, length_q, length_k, _ = call.shape
    q = call.query.contiguous()
    k = repeat_kv(call.key, h // h_kv).contiguous()
    v = repeat_kv(call.value, h // h_kv).contiguous()
    items = plan(call.mask, b, length_q, length_k, query_tile(call), q.device)
    seed = 0
    if call.dropout_p > 0.0:
        seed = int(torch.randint(0, 2**62, (), device="cpu"))
    ctx = _Ctx(call.scale, call.dropout_p, seed, call.bias)
    out = _TiledAttention.apply(q, k, v, items, ctx)
    return out, (weights(call, items) if call.return_weights else None)


def weights(call: Call, items: list[Item] | None = None) -> Tensor:
    """Softmax weights (B, H, L, S), computed tile by tile over the visible ranges only."""
    b, h, h_kv, length_q, length_k, _ = call.shape
    q = call.query
    k = repeat_kv(call.key, h // h_kv)
    if items is None:
        items = plan(call.mask, b, length_q, length_k, query_tile(call), q.device)
    w = q.new_zeros(b, h, length_q, length_k)
    stat = _stat(q.dtype)
    for item in items:
        rows = slice(item.q0, item.q1)
        lo, hi = item.chunks[0].start, item.chunks[-1].stop
        qt = q[item.batch, :, rows].to(stat)
        parts = []
        for chunk in item.chunks:
            kc, _ = _chunk_kv(k, k, item, chunk)
            sc = (qt @ kc.to(stat).transpose(-2, -1)) * call.scale
            add = _additive(chunk.keep, _bias_block(call.bias, item, chunk), stat)
            parts.append(sc if add is None else sc + add)
        s = torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]
        # rows that see nothing in this tile keep weight 0 instead of softmax(-inf row) = NaN
        top = s.amax(dim=-1, keepdim=True)
        e = torch.exp(s - torch.where(torch.isfinite(top), top, 0.0))
        total = e.sum(dim=-1, keepdim=True)
        w[item.batch, :, rows, lo:hi] = (e / torch.where(total > 0, total, 1.0)).to(w.dtype)
    return w
