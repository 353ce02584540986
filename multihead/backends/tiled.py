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

import torch
from torch import Tensor

from ._plan import Chunk, Item, plan, query_tile
from ._tensors import repeat_kv, sink_grad, stat_dtype
from .call import Call, plain_causal
from .protocol import FALLBACK, PREFERRED, Backend, Capabilities, Rank

__all__ = [
    "BACKEND",
    "backward_with_lse",
    "forward_with_lse",
    "plan",
    "rank",
    "run",
]

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
_TABLE_TILE = 1024  # query rows per tile when a relative bias meets an unbounded band


def rank(call: Call) -> Rank:
    skips = "it skips the tiles the mask hides"
    if call.exported:
        return Rank(FALLBACK, "its plan branches on the mask, which an exported graph cannot")
    if call.traced:
        return Rank(
            FALLBACK,
            "its plan reads the mask on the host: inside a compiled graph every read would be "
            "a graph break",
        )
    if call.return_weights:
        return Rank(PREFERRED, "it computes the output fused and weights by tile")
    if call.device_type != "cpu":
        return Rank(FALLBACK, skips)
    if call.bias is not None and call.bias.computed:
        return Rank(
            PREFERRED,
            "it computes the score modifier tile by tile; the others need it as a dense "
            "(B, H, L, S) tensor",
        )
    if call.mask is None or plain_causal(call) or call.mask.arbitrary:
        return Rank(FALLBACK, skips)
    return Rank(PREFERRED, skips)


class _Ctx:
    """What the per-chunk kernels need besides q, k and v."""

    def __init__(self, call: Call, seed: int = 0) -> None:
        _, _, _, self.length_q, self.length_k, _ = call.shape
        self.scale, self.dropout_p, self.seed = call.scale, call.dropout_p, seed
        self.bias = call.bias
        self.softcap = call.softcap
        self.device = call.query.device
        self.stat = stat_dtype(call.query.dtype)
        self.sinks = None if call.sinks is None else call.sinks.to(self.stat)
        # a bias that learns needs each chunk's score gradient, which only the eager kernel
        # exposes
        self.bias_grad = call.bias is not None and call.needs_grad and call.bias.requires_grad
        self.relative = call.bias is not None and (
            call.bias.diagonals(self.length_q, self.length_k, 0, 1, device=self.device) is not None
        )
        # a mask that is a band of distances j - i: with a relative bias, a whole tile runs as
        # one kernel call against one strided table (bias inside the band, -inf outside)
        self.band = None
        if self.relative and call.mask is not None:
            self.band = call.mask.visible_distances(self.length_q, self.length_k)
        self.reversed_kv: tuple[Tensor, Tensor] | None = None
        # stacked documents run as one batched call; a bias would need per-document views
        self.stacks = call.bias is None

    def use_flash(self, q: Tensor, v: Tensor) -> bool:
        # torch's CPU flash kernel: no dropout, no cap, one head dim for queries and values
        return (
            q.device.type == "cpu"
            and self.dropout_p == 0.0
            and self.softcap is None
            and q.shape[-1] == v.shape[-1]
        )

    def capped(self, raw: Tensor) -> tuple[Tensor, Tensor | None]:
        """(scores after the soft cap, tanh(raw / cap) or None without a cap): the second is
        what the backward pass needs for the cap's derivative 1 - tanh^2."""
        if self.softcap is None:
            return raw, None
        t = torch.tanh(raw / self.softcap)
        return self.softcap * t, t

    def keep_draw(self, shape, index: int, device) -> Tensor:
        """Dropout's keep pattern for chunk ``index``, identical in forward and backward."""
        g = torch.Generator(device=device).manual_seed(self.seed + index)
        return torch.rand(shape, generator=g, device=device) >= self.dropout_p

    def units(self, items: list[Item]) -> list[tuple[Item, Chunk]]:
        """The kernel calls: every chunk of every item, or one "table" call per item when a
        band mask meets a relative bias."""
        if not self.stacks:
            items = [part for item in items for part in item.unstacked()]
        if self.band is None:
            return [(item, chunk) for item in items for chunk in item.chunks]
        return [
            (item, Chunk(item.chunks[0].start, item.chunks[-1].stop, None, pattern="table"))
            for item in items
        ]

    def bias_block(self, item: Item, chunk: Chunk) -> Tensor | None:
        """The bias on this chunk, (b|1, H|1, rows|1, cols|1), in natural key order."""
        if self.bias is None:
            return None
        if self.relative:  # a copy of a strided view: no arithmetic per entry
            return self.table_view(item, chunk, band=False).flip(-1)
        return self.bias.block(
            self.length_q,
            self.length_k,
            item.q0,
            item.q1,
            chunk.start,
            chunk.stop,
            batch=item.batch.start,
            device=self.device,
            dtype=self.stat,
        )

    def table_view(self, item: Item, chunk: Chunk, *, band: bool) -> Tensor:
        """The relative bias of a chunk with its keys in reverse order, as a strided view of one
        (H, rows + cols - 1) table: entry (r, c) is the key j = stop - 1 - c, so j - i falls
        by one along both rows and columns and the view needs no negative stride. Nothing of
        size rows x cols is built. With ``band``, distances outside the mask's band are -inf.
        """
        rows, cols = item.q1 - item.q0, chunk.stop - chunk.start
        top = chunk.stop - 1 - item.q0  # j - i at entry (0, 0), the largest in the chunk
        low = top - (rows + cols - 2)
        off = self.bias.offset(self.length_q, self.length_k)
        table = self.bias.diagonals(
            self.length_q, self.length_k, low - off, top - off + 1, device=self.device,
            dtype=self.stat,
        ).flip(-1)  # fmt: skip
        if band:
            lo, hi = self.band
            d = torch.arange(top, low - 1, -1, device=self.device)
            inside = torch.ones_like(d, dtype=torch.bool)
            if lo is not None:
                inside &= d >= lo
            if hi is not None:
                inside &= d <= hi
            table = table.masked_fill(~inside, float("-inf"))
        table = table.contiguous()
        return table.as_strided((1, table.shape[0], rows, cols), (0, table.stride(0), 1, 1))

    def reversed_keys(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """k and v with the key axis reversed, made once per call."""
        if self.reversed_kv is None:
            self.reversed_kv = (k.flip(2), v.flip(2))
        return self.reversed_kv


def _additive(keep: Tensor | None, bias: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """A float block for the kernels: 0 where visible, -inf where hidden, plus the bias."""
    if keep is None:
        return None if bias is None else bias.to(dtype)
    zero = torch.zeros((), dtype=dtype, device=keep.device)
    block = torch.where(keep, zero, torch.tensor(float("-inf"), dtype=dtype, device=keep.device))
    return block if bias is None else block + bias.to(dtype)


def _chunk_inputs(ctx: _Ctx, k, v, item: Item, chunk: Chunk, flash: bool):
    """(keys, values, additive block or None, pattern or None) for one chunk, the same in the
    forward and the backward pass.

    Patterns: "tril"/"triu" run a triangle on torch's causal kernel (which masks it; the block
    is then only the bias); "table" runs the keys in reverse order against a strided view of
    a relative bias (see ``_Ctx.table_view``).
    """
    table = chunk.pattern == "table" or (chunk.keep is None and ctx.relative)
    if table:
        k_rev, v_rev = ctx.reversed_keys(k, v)
        cols = slice(ctx.length_k - chunk.stop, ctx.length_k - chunk.start)
        view = ctx.table_view(item, chunk, band=chunk.pattern == "table")
        return k_rev[item.batch, :, cols], v_rev[item.batch, :, cols], view, "table"
    kc, vc = _chunk_kv(k, v, item, chunk)
    if flash and chunk.pattern is not None:
        return kc, vc, ctx.bias_block(item, chunk), chunk.pattern
    # float32 beside half inputs (the bias rule); torch's flash kernel accepts it
    return kc, vc, _additive(chunk.keep, ctx.bias_block(item, chunk), ctx.stat), None


def _chunk_kv(k: Tensor, v: Tensor, item: Item, chunk: Chunk) -> tuple[Tensor, Tensor]:
    """Key/value rows of a chunk; keys no row of the tile sees are zeroed, never read (padding
    may hold NaN, and 0 * NaN is NaN inside a matmul)."""
    cols = slice(chunk.start, chunk.stop)
    kc, vc = k[item.batch, :, cols], v[item.batch, :, cols]
    if chunk.live is None:
        return kc, vc
    zero = torch.zeros((), dtype=k.dtype, device=k.device)
    return torch.where(chunk.live, kc, zero), torch.where(chunk.live, vc, zero)


def _stack(t: Tensor, count: int) -> Tensor:
    """(1, H, count * n, ...) -> (count, H, n, ...): equal documents as a batch (a view)."""
    return t.unflatten(2, (count, -1)).transpose(1, 2).flatten(0, 1)


def _unstack(t: Tensor, count: int) -> Tensor:
    """The inverse of ``_stack``: (count, H, n, ...) -> (1, H, count * n, ...)."""
    return t.unflatten(0, (-1, count)).transpose(1, 2).flatten(2, 3)


def _flip(*tensors: Tensor) -> list[Tensor]:
    return [t.flip(2) for t in tensors]


def _flip_block(add: Tensor | None) -> Tensor | None:
    return None if add is None else add.flip(-2, -1)


def _chunk_forward(
    ctx: _Ctx, q, k, v, add, index: int, pattern: str | None, flash: bool
) -> tuple[Tensor, Tensor]:
    """Attention of q over one key chunk: (out [b, H, rows, D_v], lse [b, H, rows])."""
    if flash:
        if pattern == "tril":
            return _FLASH(q, k, v, is_causal=True, attn_mask=add, scale=ctx.scale)
        if pattern == "triu":
            o, lse = _FLASH(
                *_flip(q, k, v), is_causal=True, attn_mask=_flip_block(add), scale=ctx.scale
            )
            return o.flip(2), lse.flip(-1)
        return _FLASH(q, k, v, attn_mask=add, scale=ctx.scale)
    f = ctx.stat
    # scores in float32 for half inputs: a half matmul overflows for finite inputs
    s, _ = ctx.capped((q.to(f) @ k.to(f).transpose(-2, -1)) * ctx.scale)  # [b, H, rows, cols]
    if add is not None:
        s = s + add
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - _finite(lse)[..., None])
    if ctx.dropout_p > 0.0:
        p = p * ctx.keep_draw(p.shape, index, p.device) / (1.0 - ctx.dropout_p)
    return p.to(v.dtype) @ v, lse


def _chunk_backward(ctx: _Ctx, g, q, k, v, out, lse, add, index: int, pattern, flash: bool):
    """Gradients of one chunk given the *global* out and log-sum-exp of its rows:
    (dq, dk, dv, d scores before scaling or None). The last is the bias's gradient on this
    chunk; only the eager kernel gives it (``flash=False``)."""
    if flash:
        if pattern == "tril":
            grads = _FLASH_BACKWARD(g, q, k, v, out, lse, 0.0, True, attn_mask=add, scale=ctx.scale)
        elif pattern == "triu":
            grads = _FLASH_BACKWARD(
                *_flip(g, q, k, v, out),
                lse.flip(-1),
                0.0,
                True,
                attn_mask=_flip_block(add),
                scale=ctx.scale,
            )
            grads = [t.flip(2) for t in grads]
        else:
            grads = _FLASH_BACKWARD(
                g, q, k, v, out, lse, 0.0, False, attn_mask=add, scale=ctx.scale
            )
        return (*grads, None)
    f = ctx.stat
    s, tanh = ctx.capped((q.to(f) @ k.to(f).transpose(-2, -1)) * ctx.scale)
    if add is not None:
        s = s + add
    p = torch.exp(s - lse[..., None].to(f))
    g32 = g.to(f)
    dp = g32 @ v.to(f).transpose(-2, -1)
    pd = p
    if ctx.dropout_p > 0.0:
        z = ctx.keep_draw(p.shape, index, p.device) / (1.0 - ctx.dropout_p)
        pd, dp = p * z, dp * z
    row = (g32 * out.to(f)).sum(dim=-1, keepdim=True)
    d_scores = p * (dp - row)  # gradient of the scores after scaling: the bias's gradient
    ds = d_scores * ctx.scale if tanh is None else d_scores * (1.0 - tanh * tanh) * ctx.scale
    dq = ds @ k.to(f)
    dk = ds.transpose(-2, -1) @ q.to(f)
    dv = pd.transpose(-2, -1) @ g32
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), d_scores


def _finite(lse: Tensor) -> Tensor:
    return torch.where(
        torch.isfinite(lse), lse, torch.zeros((), dtype=lse.dtype, device=lse.device)
    )


def _forward(ctx: _Ctx, q, k, v, items: list[Item]) -> tuple[Tensor, Tensor]:
    b, h, length_q, _ = q.shape
    stat = ctx.stat
    # heads-inner memory layout, so merging heads afterwards (B, L, H * D_v) is a free view
    out = q.new_zeros(b, length_q, h, v.shape[-1]).transpose(1, 2)
    lse = torch.full((b, h, length_q), float("-inf"), dtype=stat, device=q.device)
    flash = ctx.use_flash(q, v)
    index = 0
    current, acc, total = None, None, None
    for item, chunk in [*ctx.units(items), (None, None)]:
        if item is not current and current is not None:  # the previous item is complete
            rows = slice(current.q0, current.q1)
            out[current.batch, :, rows] = acc.to(out.dtype)
            lse[current.batch, :, rows] = total
            acc = total = None
        current = item
        if item is None:
            break
        qt = q[item.batch, :, item.q0 : item.q1]
        kc, vc, add, pattern = _chunk_inputs(ctx, k, v, item, chunk, flash)
        c = item.stack
        if c > 1:
            qt, kc, vc = (_stack(t, c) for t in (qt, kc, vc))
        o, l_c = _chunk_forward(ctx, qt, kc, vc, add, index, pattern, flash)
        if c > 1:
            o, l_c = _unstack(o, c), _unstack(l_c, c)
        index += 1
        l_c = l_c.to(stat)
        seen = chunk.seen
        if seen is not None:  # the kernel reports lse = 0 for rows that see nothing
            l_c = torch.where(seen, l_c, float("-inf"))
            o = torch.where(seen[..., None], o, 0.0)
        if acc is None:
            acc, total = o, l_c
            continue
        new_total = torch.logaddexp(total, l_c)
        safe = _finite(new_total)
        acc = (
            acc.to(stat) * torch.exp(total - safe)[..., None]
            + o.to(stat) * torch.exp(l_c - safe)[..., None]
        )
        total = new_total
    return out, lse


def _backward(ctx: _Ctx, g, q, k, v, out, lse, items: list[Item], bias_tensors):
    """(dq, dk, dv, gradient of every bias tensor or None)."""
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dk_rev = dv_rev = None  # gradients of chunks that ran on reversed keys
    d_bias = [torch.zeros_like(t) if t.requires_grad else None for t in bias_tensors]
    # rows that saw nothing: +inf makes every recomputed probability exactly 0
    lse = torch.where(torch.isfinite(lse), lse, float("inf"))
    flash = ctx.use_flash(q, v) and not ctx.bias_grad
    for index, (item, chunk) in enumerate(ctx.units(items)):
        rows = slice(item.q0, item.q1)
        qt, gt, ot = (t[item.batch, :, rows] for t in (q, g, out))
        lt = lse[item.batch, :, rows]
        kc, vc, add, pattern = _chunk_inputs(ctx, k, v, item, chunk, flash)
        if item.stack > 1:
            n = item.stack
            stacked = [_stack(t, n) for t in (gt, qt, kc, vc, ot, lt)]
            a, b, c, ds = _chunk_backward(ctx, *stacked, add, index, pattern, flash)
            a, b, c = (_unstack(t, n) for t in (a, b, c))
        else:
            a, b, c, ds = _chunk_backward(ctx, gt, qt, kc, vc, ot, lt, add, index, pattern, flash)
        dq[item.batch, :, rows] += a
        if pattern == "table":
            if dk_rev is None:
                dk_rev, dv_rev = torch.zeros_like(k), torch.zeros_like(v)
            cols = slice(ctx.length_k - chunk.stop, ctx.length_k - chunk.start)
            dk_rev[item.batch, :, cols] += b
            dv_rev[item.batch, :, cols] += c
            ds = None if ds is None else ds.flip(-1)
        else:
            cols = slice(chunk.start, chunk.stop)
            dk[item.batch, :, cols] += b
            dv[item.batch, :, cols] += c
        if ctx.bias_grad:
            _bias_backward(ctx, item, chunk, ds, bias_tensors, d_bias)
    if dk_rev is not None:
        dk, dv = dk + dk_rev.flip(2), dv + dv_rev.flip(2)
    return dq, dk, dv, d_bias


def _bias_backward(ctx: _Ctx, item, chunk, ds: Tensor, tensors, d_bias: list) -> None:
    """Push one chunk's score gradient through the bias's own formula to its tensors (a T5
    table, ALiBi slopes, a tensor bias): rebuild that block with autograd on and pull back."""
    wanted = [i for i, t in enumerate(tensors) if t.requires_grad]
    with torch.enable_grad():
        block = ctx.bias_block(item, chunk)
        if not block.requires_grad:
            return
        grads = torch.autograd.grad(
            block, [tensors[i] for i in wanted], ds.sum_to_size(block.shape), allow_unused=True
        )
    for i, grad in zip(wanted, grads):
        if grad is not None:
            d_bias[i] += grad


def _sink(sinks: Tensor | None, out: Tensor, lse: Tensor) -> tuple[Tensor, Tensor]:
    """A row's sink logit joined to its finished softmax: the denominator grows from
    exp(lse) to exp(lse) + exp(sink), so the output shrinks by exp(lse - lse') (in place) and
    the log-sum-exp becomes lse' (rows that see nothing keep -inf and output 0)."""
    if sinks is None:
        return out, lse
    total = torch.logaddexp(lse, sinks.detach().to(lse.dtype)[None, :, None])
    out.mul_(torch.exp(lse - total)[..., None].to(out.dtype))
    return out, torch.where(torch.isfinite(lse), total, lse)


class _TiledAttention(torch.autograd.Function):
    @staticmethod
    def forward(fctx, q, k, v, items, ctx, sinks, *bias_tensors):
        out, lse = _sink(sinks, *_forward(ctx, q, k, v, items))
        fctx.save_for_backward(q, k, v, out, lse, sinks)
        fctx.items, fctx.ctx, fctx.bias_tensors = items, ctx, bias_tensors
        return out

    @staticmethod
    def backward(fctx, g):
        q, k, v, out, lse, sinks = fctx.saved_tensors
        g = g.contiguous()
        dq, dk, dv, d_bias = _backward(
            fctx.ctx, g, q, k, v, out, lse, fctx.items, fctx.bias_tensors
        )
        d_sinks = None
        if sinks is not None and fctx.needs_input_grad[5]:
            d_sinks = sink_grad(sinks, g, out, lse)
        return dq, dk, dv, None, None, d_sinks, *d_bias


def _unit_last(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _prepare(call: Call, seed: int = 0):
    """(q, k, v with H heads, the context, the plan) for one call."""
    b, h, h_kv, length_q, length_k, _ = call.shape
    # the kernels take any strides with a unit last one; (B, L, H, D) views from a projection
    # need no copy
    q, k, v = (
        _unit_last(t)
        for t in (call.query, repeat_kv(call.key, h // h_kv), repeat_kv(call.value, h // h_kv))
    )
    ctx = _Ctx(call, seed)
    tile = query_tile(call)
    if ctx.band is not None and call.mask.tile_rows(length_q, length_k) is None:
        # one call per tile against the band table: 1024 rows let torch's kernel work on
        # 256-row query blocks (256-row tiles give it 64-row blocks, which run slower)
        tile = max(tile, min(length_q, _TABLE_TILE))
    return q, k, v, ctx, plan(call.mask, b, length_q, length_k, tile, q.device, stack=True)


def run(call: Call) -> tuple[Tensor, Tensor | None]:
    seed = 0
    if call.dropout_p > 0.0:
        seed = int(torch.randint(0, 2**62, (), device="cpu"))
    if call.return_weights and call.dropout_p == 0.0:
        return _one_pass(call, output=True)
    q, k, v, ctx, items = _prepare(call, seed)
    if call.needs_grad:
        # half inputs train in float32 (torch's CPU flash kernel computes in float32 anyway),
        # rounded once at the output: in half, the backward's row term sum(dO * O) would read
        # an O rounded to half, whose rounding survives in dp - sum(dO * O) where the weights
        # are nearly one-hot, and a row's chunk gradients would be summed in half
        wide = [t.to(ctx.stat) for t in (q, k, v)]
        out = _TiledAttention.apply(*wide, items, ctx, call.sinks, *call.bias_tensors)
        return out.to(q.dtype), (_one_pass(call, output=False)[1] if call.return_weights else None)
    out, _ = _sink(call.sinks, *_forward(ctx, q, k, v, items))
    return out, (_one_pass(call, output=False)[1] if call.return_weights else None)


def forward_with_lse(call: Call) -> tuple[Tensor, Tensor]:
    """(out [B, H, L, D_v], log-sum-exp [B, H, L]) without autograd; rows that see no key
    have out 0 and lse -inf. Partial results over disjoint key sets merge exactly through
    their log-sum-exp (context parallelism sends key shards around a ring this way)."""
    if call.dropout_p > 0.0:
        raise ValueError(
            "forward_with_lse computes no dropout (its draws would differ per shard). "
            f"Received: dropout_p={call.dropout_p}"
        )
    if call.sinks is not None:
        raise ValueError(
            "forward_with_lse gives one shard's partial softmax; sink logits belong to the "
            "whole row and join once all shards have merged. Received: sinks"
        )
    q, k, v, ctx, items = _prepare(call)
    with torch.no_grad():
        return _forward(ctx, q, k, v, items)


def backward_with_lse(
    call: Call, grad_out: Tensor, out: Tensor, lse: Tensor
) -> tuple[Tensor, Tensor, Tensor, list[Tensor | None]]:
    """Gradients of this call's keys and queries given the *final* ``out`` and ``lse`` of its
    query rows (which may include keys of other calls): (dq, dk, dv with H_kv heads, gradient
    of each of ``call.bias.tensors()`` or None)."""
    _, h, h_kv, _, _, _ = call.shape
    q, k, v, ctx, items = _prepare(call)
    ctx.bias_grad = call.bias is not None and call.bias.requires_grad
    with torch.no_grad():
        dq, dk, dv, d_bias = _backward(
            ctx, grad_out.contiguous(), q, k, v, out, lse, items, call.bias_tensors
        )
    if h != h_kv:  # sum each group of query heads back onto its key/value head
        dk = dk.unflatten(1, (h_kv, h // h_kv)).sum(2)
        dv = dv.unflatten(1, (h_kv, h // h_kv)).sum(2)
    return dq, dk, dv, d_bias


_WEIGHT_ROWS = 256  # query rows per block of weights: bounds the temporaries


def _one_pass(call: Call, *, output: bool) -> tuple[Tensor | None, Tensor]:
    """Weights (B, H, L, S) and, with ``output``, the output computed from them: per block of
    query rows the scores of the visible key range are computed once, normalized in place into
    the returned weights, and multiplied by V. The output is exactly ``weights @ V``; rows that
    see nothing have zero weights. Differentiable when gradients are enabled (the weights are
    returned anyway, so keeping them for backward costs no extra order of memory)."""
    b, h, h_kv, length_q, length_k, _ = call.shape
    ctx = _Ctx(call)
    items = plan(call.mask, b, length_q, length_k, query_tile(call), call.query.device)
    stat = ctx.stat
    grad = call.needs_grad
    q = call.query * call.scale  # [B, H, L, D]: the scale folded into the small operand
    k = repeat_kv(call.key, h // h_kv)
    v = repeat_kv(call.value, h // h_kv) if output else None
    # every entry is written when nothing is masked; otherwise hidden blocks stay 0
    w = q.new_empty if call.mask is None else q.new_zeros
    w = w(b, h, length_q, length_k)
    out = None
    if output:
        out = q.new_zeros(b, h, length_q, v.shape[-1])
    if grad:
        # every input takes part in the graph even where the mask hides everything, so its
        # gradient is 0 rather than missing
        inputs = (call.query, call.key, *((call.value,) if output else ()), *call.bias_tensors)
        anchor = sum(_zero_of(t) for t in inputs)
        w = w + anchor.to(w.dtype)
        out = None if out is None else out + anchor.to(out.dtype)
    for item in items:
        lo, hi = item.chunks[0].start, item.chunks[-1].stop
        adds = [ctx.bias_block(item, c) for c in item.chunks]
        keys = [k[item.batch, :, c.start : c.stop].to(stat).transpose(-2, -1) for c in item.chunks]
        masked = any(c.keep is not None for c in item.chunks)
        for r0 in range(item.q0, item.q1, _WEIGHT_ROWS):
            r1 = min(r0 + _WEIGHT_ROWS, item.q1)
            rel = slice(r0 - item.q0, r1 - item.q0)
            qt = q[item.batch, :, r0:r1].to(stat)
            s = _item_scores(qt, keys, adds, item.chunks, rel, grad, ctx.softcap)
            p = _softmax(s, masked, grad, ctx.sinks)
            w[item.batch, :, r0:r1, lo:hi] = p.to(w.dtype)
            if output:
                vt = v[item.batch, :, lo:hi]
                o = p @ vt if vt.dtype == stat else (p @ vt.to(stat))
                out[item.batch, :, r0:r1] = o.to(out.dtype)
    return out, w


def _item_scores(
    qt: Tensor, keys: list, adds: list, chunks, rel: slice, grad: bool, cap: float | None
) -> Tensor:
    """Scaled, capped scores of a block of rows over an item's key range (its chunks' keys,
    biases)."""
    if len(chunks) == 1:
        return _scores(qt, keys[0], adds[0], chunks[0], rel, grad, cap)
    lo, hi = chunks[0].start, chunks[-1].stop
    # chunks may leave gaps (key blocks no row sees): those stay -inf
    s = torch.full((*qt.shape[:-1], hi - lo), float("-inf"), dtype=qt.dtype, device=qt.device)
    for chunk, kt, bias in zip(chunks, keys, adds):
        s[..., chunk.start - lo : chunk.stop - lo] = _scores(qt, kt, bias, chunk, rel, grad, cap)
    return s


def _softmax(s: Tensor, masked: bool, grad: bool, sinks: Tensor | None) -> Tensor:
    """Row softmax of scores, with each head's sink logit in the denominator when there are
    sinks; rows that see nothing (all -inf: NaN) get 0. In place on ``s`` when no gradient is
    needed (one buffer holds scores, then weights)."""
    if sinks is not None:
        return _sink_softmax(s, sinks, grad)
    if grad:
        p = torch.softmax(s, dim=-1)
        return torch.where(torch.isnan(p), 0.0, p) if masked else p
    p = torch.ops.aten._softmax.out(s, -1, False, out=s)
    return p.nan_to_num_(0.0) if masked else p


def _zero_of(t: Tensor) -> Tensor:
    """A 0 in the autograd graph of ``t``, read from one entry: a sum over all of ``t``
    overflows to inf for a finite bias whose entries add up past float32's 3.4e38, and
    inf * 0 is NaN. One entry is finite (the NaN rule cleans inputs first, biases are checked)."""
    return t[(slice(0, 1),) * t.dim()].sum() * 0


def _sink_softmax(s: Tensor, sinks: Tensor, grad: bool) -> Tensor:
    """Softmax of whole rows of scores with each head's sink logit in the denominator. A row
    with every score -inf gets weights 0 (its denominator is the sink's alone)."""
    total = torch.logaddexp(torch.logsumexp(s, dim=-1, keepdim=True), sinks[None, :, None, None])
    return torch.exp(s - total) if grad else s.sub_(total).exp_()


def _scores(
    qt: Tensor, kt: Tensor, bias, chunk: Chunk, rel: slice, grad: bool, cap: float | None
) -> Tensor:
    """Scaled scores of a block of rows against one chunk, capped, bias added, hidden entries
    -inf."""
    s = qt @ kt
    if cap is not None:
        s = cap * torch.tanh(s / cap) if grad else s.div_(cap).tanh_().mul_(cap)
    if bias is not None:
        bias = bias if bias.shape[2] == 1 else bias[:, :, rel]
        s = s + bias if grad else s.add_(bias)
    if chunk.keep is not None:
        hidden = ~(chunk.keep if chunk.keep.shape[2] == 1 else chunk.keep[:, :, rel])
        s = s.masked_fill(hidden, float("-inf")) if grad else s.masked_fill_(hidden, float("-inf"))
    return s


BACKEND = Backend(
    run=run,
    rank=rank,
    capabilities=Capabilities(
        label="the tiled backend", weights=True, dropout=True, softcap=True, sinks=True
    ),
)
