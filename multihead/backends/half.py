"""Half-precision attention on CPU with the matmuls in bf16/fp16 (``backend="half"``).

torch's CPU flash kernel converts bf16 and fp16 inputs to float32 and computes at float32
speed. Here each block of query rows computes its scores with one half-precision matmul over
the keys the mask lets it see (the tiled plan's ranges: hidden tiles are skipped), normalizes
them with a half-in, half-out softmax (float32 inside) and multiplies them by V with a second
half-precision matmul. That is the naive formula's arithmetic in the input dtype, so its error
is the naive formula's (the 2x rule: docs/design.md, "Error rules"). The backward pass
recomputes each block's softmax from scratch (a block holds whole rows, so no log-sum-exp is
needed), keeps those weights in float32 for the score gradient and accumulates the gradients in
float32.

When ``auto`` runs it: never from the CPU's instruction set alone. Native bf16/fp16 matmuls
(AVX512-BF16 / AMX, AVX512-FP16 / AMX-FP16) make the kernel a candidate; it then leads only
where it measured faster than the backend ``auto`` would otherwise run (``measured_faster``):
once per shape class (device, dtype, B * H and L, S in powers of two, GQA groups, head dims,
mask kind, gradients), on the first such call, each side warmed up and timed three times, the
kernel at least 10% faster; the answer is kept for the process. (Native is not enough: a CPU
whose bf16 matmuls are slower than its fp32 ones keeps ``auto`` on SDPA this way.)
``MULTIHEAD_HALF_AUTO=0`` turns the measurement off, and with it the kernel's lead.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch
from torch import Tensor

from . import _measure
from ._plan import Item, plan
from ._tensors import repeat_kv
from .call import Call
from .protocol import FALLBACK, Backend, Capabilities, Rank

__all__ = ["BACKEND", "ROWS", "fast", "measured_faster", "rank", "run"]

ROWS = 128  # query rows per block: see docs/performance.md for the measurement

_CAPABILITIES = Capabilities(
    label="the half-precision kernel",
    dtypes=(torch.bfloat16, torch.float16),
    # accelerators have fused kernels of their own
    devices=("cpu",),
    # weights come from the tiled backend's float32 weights pass
    weights=False,
    dropout=False,
)


def _no_bias(call: Call) -> str | None:
    if call.bias is not None:
        return "a bias is added in float32 (the bias rule), which the half kernel would round"
    return None


def rank(call: Call) -> Rank:
    # it leads only through ``measured``, where it ran faster on this machine; its plan reads
    # the mask on the host: never inside traced graphs
    if fast(call) and not call.traced:
        return Rank(FALLBACK, "its half-precision kernel leads only where it measured faster")
    # without native half matmuls they are emulated: torch's float32 kernels are faster
    return Rank(FALLBACK + 5, "it computes half inputs with half-precision matmuls")


def fast(call: Call) -> bool:
    """True when the kernel can run the call and this CPU has native half-precision matmuls
    (AVX512-BF16 / AMX for bf16, AVX512-FP16 / AMX-FP16 for fp16); without them the matmuls
    are emulated and torch's float32 kernel is faster. Native is not fast enough to lead:
    ``measured_faster`` decides that."""
    if BACKEND.why_not(call) is not None:
        return False
    if call.query.dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


def _scores(
    q: Tensor, k: Tensor, item: Item, r0: int, r1: int, scale: float
) -> tuple[Tensor, bool]:
    """Scaled scores of rows [r0, r1) over the item's key range, hidden entries -inf; and
    whether anything was hidden (rows may then see nothing)."""
    lo, hi = item.chunks[0].start, item.chunks[-1].stop
    # the scale multiplies the product, as in the naive formula: folded into q first, it would
    # round every entry of q, and the scores would inherit that error coherently
    s = (q[item.batch, :, r0:r1] @ k[item.batch, :, lo:hi].transpose(-2, -1)).mul_(scale)
    masked = False
    rel = slice(r0 - item.q0, r1 - item.q0)
    covered = lo
    for chunk in item.chunks:
        if chunk.start > covered:  # a key block no row of the tile sees
            s[..., covered - lo : chunk.start - lo] = float("-inf")
            masked = True
        if chunk.keep is not None:
            keep = chunk.keep if chunk.keep.shape[2] == 1 else chunk.keep[:, :, rel]
            s[..., chunk.start - lo : chunk.stop - lo].masked_fill_(~keep, float("-inf"))
            masked = True
        covered = chunk.stop
    return s, masked


def _softmax_(s: Tensor, masked: bool) -> Tensor:
    torch.ops.aten._softmax.out(s, -1, False, out=s)
    if masked:  # rows that see nothing: softmax of -inf only is NaN; they get 0
        s.nan_to_num_(0.0)
    return s


def _blocks(items: list[Item]):
    for item in items:
        for r0 in range(item.q0, item.q1, ROWS):
            yield item, r0, min(r0 + ROWS, item.q1)


def _forward(q: Tensor, k: Tensor, v: Tensor, items: list[Item], scale: float) -> Tensor:
    b, h, length_q, _ = q.shape
    out = q.new_zeros(b, length_q, h, v.shape[-1]).transpose(1, 2)  # heads-inner, as tiled
    for item, r0, r1 in _blocks(items):
        p = _softmax_(*_scores(q, k, item, r0, r1, scale))
        lo, hi = item.chunks[0].start, item.chunks[-1].stop
        out[item.batch, :, r0:r1] = p @ v[item.batch, :, lo:hi]
    return out


def _backward(g, q, k, v, items: list[Item], scale: float):
    f = torch.float32
    dq = torch.zeros(q.shape, dtype=f)
    dk, dv = torch.zeros(k.shape, dtype=f), torch.zeros(v.shape, dtype=f)
    for item, r0, r1 in _blocks(items):
        lo, hi = item.chunks[0].start, item.chunks[-1].stop
        rows, cols = slice(r0, r1), slice(lo, hi)
        s, masked = _scores(q, k, item, r0, r1, scale)
        # weights in float32 for the score gradient: rounded to half, a weight of 0.9997
        # becomes 1, and the 3e-4 it loses is as large as the small weights dq is made of
        # when a row is nearly one-hot; the half copy (the forward's weights) serves dv
        p = _softmax_(s.to(f), masked)
        gt, vt, kt = g[item.batch, :, rows], v[item.batch, :, cols], k[item.batch, :, cols]
        dp = (gt @ vt.transpose(-2, -1)).to(f)
        ds = _score_grad(p, dp).mul_(scale).to(q.dtype)  # [b, H, rows, cols]
        dq[item.batch, :, rows] += (ds @ kt).to(f)
        dk[item.batch, :, cols] += (ds.transpose(-2, -1) @ q[item.batch, :, rows]).to(f)
        dv[item.batch, :, cols] += (p.to(q.dtype).transpose(-2, -1) @ gt).to(f)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _score_grad(p: Tensor, dp: Tensor) -> Tensor:
    """The softmax's backward p * (dp - sum_j p_j dp_j), in place on ``dp`` (float32).

    The row term comes from this dp, as in the softmax's own backward, not FlashAttention's
    sum(dO * O): with O rounded to half the two differ by a rounding of dp, which survived in
    dp - row (a row that sees one key would get dq = scale * k * that rounding, not exactly 0).
    """
    row = (p * dp).sum(-1, keepdim=True)
    return dp.sub_(row).mul_(p)


class _HalfAttention(torch.autograd.Function):
    @staticmethod
    def forward(fctx, q, k, v, items, scale):
        fctx.save_for_backward(q, k, v)
        fctx.items, fctx.scale = items, scale
        return _forward(q, k, v, items, scale)

    @staticmethod
    def backward(fctx, g):
        q, k, v = fctx.saved_tensors
        return (*_backward(g, q, k, v, fctx.items, fctx.scale), None, None)


def _output(call: Call) -> Tensor:
    b, h, h_kv, length_q, length_k, _ = call.shape
    k, v = repeat_kv(call.key, h // h_kv), repeat_kv(call.value, h // h_kv)
    items = plan(call.mask, b, length_q, length_k, ROWS, call.query.device)
    if call.needs_grad:
        return _HalfAttention.apply(call.query, k, v, items, call.scale)
    return _forward(call.query, k, v, items, call.scale)


def run(call: Call) -> tuple[Tensor, None]:
    """The output of ``call`` (see ``unsupported`` for what it takes); never weights."""
    return _output(call), None


# auto's measurement (``_measure.py``), remembered per shape class for the process
_MEASURED: dict[Hashable, bool] = {}
_best_time = _measure.best_time  # the clock (tests replace it)


def measured_faster(call: Call, rival: Callable[[Call], object] | None) -> bool | None:
    """True when the kernel ran at least 10% faster than ``rival`` (the backend ``auto`` would
    otherwise run) on calls of this shape class on this machine; measured on the first such
    call and remembered (``rival=None``: only the remembered answer, None when there is
    none). Only CPUs with native half-precision matmuls are measured (``fast``); nothing is
    measured with ``MULTIHEAD_HALF_AUTO=0``."""
    if _measure.switched_off("MULTIHEAD_HALF_AUTO") or not fast(call):
        return False
    return _measure.faster(_MEASURED, call, run, rival, clock=_best_time)


def _measured(call: Call, rival: Callable[[Call], object] | None) -> bool | None:
    return measured_faster(call, rival)  # through the module: a test may stand one in


def _state() -> object:
    return _measure.switched_off("MULTIHEAD_HALF_AUTO")


BACKEND = Backend(
    run=run,
    rank=rank,
    capabilities=_CAPABILITIES,
    unsupported=_no_bias,
    measured=_measured,
    state=_state,
)
