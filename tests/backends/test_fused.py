"""The fused C++ kernel: what the shared matrix (tests/test_functional.py and neighbours) does
not cover: learnable modifiers, weights from the kernel, determinism, the torch ops under
torch.compile and torch.export, building, falling back, and auto's measured choice."""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest
import torch
from helpers import make_case, naive_attention, qkv, twice_naive_errors

import multihead as mh
from multihead import bias as mb
from multihead import masks
from multihead.backends import fused, registry
from multihead.backends.call import prepare

pytestmark = pytest.mark.skipif(
    fused.build_error() is not None, reason=f"fused kernel not built: {fused.build_error()}"
)

KINDS = ["none", "causal", "window_both", "lengths_per_query", "documents&causal", "dense"]


def _t5_table(heads: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, heads, generator=g, dtype=torch.float64).requires_grad_()


@pytest.mark.parametrize("kind", KINDS)
def test_gradcheck_float64_through_learnable_modifiers(kind):
    """ALiBi slopes and a T5 table reach the kernel as one row of values per head by distance;
    their gradients come back from the kernel summed along each distance."""
    b, h, length_q, length_k, d = 2, 2, 5, 7, 3
    q, k, v = qkv(b, h, 1, length_q, length_k, d, requires_grad=True, seed=5)
    mask = make_case(kind, b, h, length_q, length_k, seed=5).mask
    slopes = torch.tensor([0.5, 0.25], dtype=torch.float64, requires_grad=True)
    table = _t5_table(h)

    def f(q, k, v, slopes, table):
        bias = mb.alibi(slopes=slopes) + mb.relative_buckets(table, max_distance=4)
        return mh.attention(q, k, v, mask, bias=bias, backend="fused")

    assert torch.autograd.gradcheck(f, (q, k, v, slopes, table))


def test_relative_modifiers_are_never_lowered_to_a_dense_bias(monkeypatch):
    """ALiBi and T5 buckets run from their per-distance values: no (L, S) block is built."""
    q, k, v = qkv(1, 4, 2, 40, 50, 8)

    def refuse(*args, **kwargs):
        raise AssertionError("a relative modifier was lowered to a block")

    bias = mb.alibi(4) + mb.relative_buckets(_t5_table(4).detach(), max_distance=16)
    want = mh.attention(q, k, v, masks.causal(), bias=bias, backend="reference")
    for modifier in (bias, *bias.parts):
        monkeypatch.setattr(type(modifier), "block", refuse)
    got = mh.attention(q, k, v, masks.causal(), bias=bias, backend="fused")
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("length_q,length_k", [(150, 290), (300, 600)])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_weights_come_from_the_kernel_and_match_the_formula(kind, dtype, length_q, length_k):
    """(300, 600): key blocks that no row of a query block sees are skipped; their weights
    must still come out 0."""
    b, h, h_kv, d = 2, 4, 2, 16
    q, k, v = qkv(b, h, h_kv, length_q, length_k, d)
    case = make_case(kind, b, h, length_q, length_k)
    bias = torch.randn(1, h, length_q, length_k, dtype=torch.float64)
    want_out, want_w = naive_attention(q, k, v, case.keep, bias=bias)
    lo = [t.to(dtype) for t in (q, k, v, bias)]
    out, w = mh.attention_with_weights(*lo[:3], case.mask, bias=lo[3], backend="fused")
    # float32: scores of |s| <= ~10 carry ~1e-6 relative error into exp
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    assert (w.double() - want_w).abs().max() <= tol
    assert (out.double() - want_out).abs().max() <= tol
    hidden = ~case.keep.expand(b, h, length_q, length_k)
    assert torch.equal(w[hidden], torch.zeros_like(w[hidden]))  # exactly 0, not tiny


def test_weights_with_gradients_are_left_to_tiled():
    q, k, v = qkv(1, 2, 2, 4, 5, 3, requires_grad=True)
    with pytest.raises(ValueError, match=r"gradients through returned weights run on tiled"):
        mh.attention_with_weights(q, k, v, backend="fused")
    assert mh.explain_backend(q, k, v, weights=True).backend == "tiled"


def test_dropout_is_left_to_tiled_and_explained():
    q, k, v = qkv(1, 2, 2, 4, 5, 3)
    # the message comes from the kernel's declared capabilities
    with pytest.raises(ValueError, match=r"cannot run this call: the fused kernel has no dropout"):
        mh.attention(q, k, v, dropout_p=0.1, backend="fused")
    reason = mh.explain_backend(q, k, v, dropout_p=0.1).reasons["fused"]
    assert reason == "the fused kernel has no dropout"


@pytest.mark.parametrize("threads", [1, 2])
def test_bitwise_deterministic_for_a_thread_count(threads):
    """Every output row and every key's gradient is written by one task in a fixed order."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q, k, v = qkv(2, 4, 2, 300, 520, 32, dtype=torch.float32, requires_grad=True)
        mask = masks.causal() & masks.lengths(torch.tensor([520, 301]))
        g = torch.randn(2, 4, 300, 32)
        runs = []
        for _ in range(2):
            out = mh.attention(q, k, v, mask, bias=mb.alibi(4), backend="fused")
            runs.append((out, *torch.autograd.grad(out, (q, k, v), g)))
        for a, b in zip(*runs):
            assert torch.equal(a, b)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("layout", ["heads_last", "expanded_rows"])
def test_block_gemm_operands_in_any_layout(layout):
    """The float block GEMM (torch's brgemm) reads row-major operands with a row stride of at
    least a row: queries as a (B, L, H, D) view; keys and values with a stride-0 row (one row
    broadcast over S) are made contiguous first. Odd head dims and partial blocks of rows and
    keys on both passes, against the float64 formula."""
    b, h, h_kv, length_q, length_k, d, d_v = 2, 4, 2, 133, 301, 24, 40
    lens = torch.tensor([301, 170])
    q, k, v = qkv(b, h, h_kv, length_q, length_k, d, d_v, seed=3)
    if layout == "expanded_rows":
        k, v = k[:, :, :1], v[:, :, :1]  # the leaves; broadcast over S below

    def views(q, k, v):
        if layout == "heads_last":
            q = q.transpose(1, 2).contiguous().transpose(1, 2)  # row stride H * D
        else:
            k, v = k.expand(b, h_kv, length_k, d), v.expand(b, h_kv, length_k, d_v)
        return q, k, v

    keep = make_case("causal", b, h, length_q, length_k).keep & (
        torch.arange(length_k) < lens[:, None, None, None]
    )
    # its own generator: the draw must not depend on which tests ran before
    grad = torch.randn(
        b, h, length_q, d_v, dtype=torch.float64, generator=torch.Generator().manual_seed(4)
    )
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    want, weights = naive_attention(*views(*leaves), keep)
    want_grads = torch.autograd.grad(want, leaves, grad)
    lo = [t.detach().float().requires_grad_() for t in (q, k, v)]
    mask = masks.causal() & masks.lengths(lens)
    got = mh.attention(*views(*lo), mask, backend="fused")
    got_grads = torch.autograd.grad(got, lo, grad.float())
    # float32 products over D and sums over S: relative error ~1e-6 on values of order 1-300
    assert (got.double() - want).abs().max() <= 1e-5
    bounds = [1e-5 * max(10.0, e.abs().max().item()) for e in want_grads]
    if layout == "expanded_rows":
        # with one key row for all S the true dK is 0: dS = P (dO V^T - rowsum(dO O)) cancels
        # to rounding, summed over L queries and S copies of the row. float32 leaves ~1e-6 of
        # the size of what cancels: the same sums over |dO| |V| and |Q| (about 1e-7 of it
        # measured over 30 draws of dO; a bound of 1e-4 sat at the measured 0.8-1.2e-4)
        vv = v.abs().expand(b, h_kv, length_k, d_v).repeat_interleave(h // h_kv, 1)
        sizes = ((grad.abs() @ vv.transpose(-1, -2)) * weights.detach()).transpose(-1, -2) @ q.abs()
        sizes = sizes.view(b, h_kv, h // h_kv, length_k, d).sum((2, 3), keepdim=True)[:, :, 0]
        bounds[1] = 1e-6 * sizes.max().item() / d**0.5
    for a, e, bound in zip(got_grads, want_grads, bounds):
        assert (a.double() - e).abs().max() <= bound


@pytest.mark.skipif(sys.platform != "linux", reason="the large-buffer pool is Linux's (mmap)")
def test_large_buffer_pool_keeps_the_newest_buffers():
    """Eight earlier shapes fill the pool of freed large buffers; a new shape's weights buffer
    must still be kept for its next call (a pool that kept its first buffers and unmapped every
    later one made a full benchmark suite's weights calls 1.4x slower than the same calls
    alone: each one faulted in and zeroed 134 MB of fresh pages)."""
    kernel = fused.build()
    q = torch.randn(1, 1, 2048, 64)

    def weights_call(length_k):  # its only buffer of >= 8 MiB: weights (1, 1, 2048, S) float32
        k = torch.randn(1, 1, length_k, 64)
        with torch.inference_mode():
            mh.attention_with_weights(q, k, k, backend="fused")

    for i in range(8):  # 8, 10, ..., 22 MiB: each larger than any buffer waiting, 8 entries
        weights_call(1024 + 256 * i)
    weights_call(8192)  # 64 MiB, more than twice any waiting buffer: mapped anew, then kept
    _, _, hits, misses = kernel.pool_stats()
    weights_call(8192)
    _, _, hits_after, misses_after = kernel.pool_stats()
    assert (hits_after - hits, misses_after - misses) == (1, 0)


def test_parallel_loops_reach_every_thread():
    """at::parallel_for is a header template: an extension built without OpenMP ran every task
    on the calling thread, whatever torch.set_num_threads said."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert fused.build().parallel_threads(8) == 2
    finally:
        torch.set_num_threads(before)


def test_half_inputs_keep_their_dtype_and_lse_is_float32():
    q, k, v = qkv(1, 2, 2, 9, 11, 8, dtype=torch.bfloat16)
    call = prepare(q, k, v, masks.causal(), None, None, 0.0, False)
    out, lse, _ = torch.ops.multihead.fused_attention(*fused._args(call))
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    ref = torch.logsumexp((q.float() @ k.float().transpose(-2, -1)) * 8**-0.5 + torch.where(
        make_case("causal", 1, 2, 9, 11).keep, 0.0, float("-inf")
    ), dim=-1)  # fmt: skip
    torch.testing.assert_close(lse, ref, rtol=0, atol=1e-5)


def _in_layout(layout: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (2, 4, 6, 5), k and v (2, 2 or 4, 9, 5) in float32, as views of the given layout."""
    g = torch.Generator().manual_seed(4)
    if layout == "contiguous":
        return qkv(2, 4, 2, 6, 9, 5, dtype=torch.float32)
    if layout == "permuted":  # a packed projection's (B, L, 3, H, D) split into heads
        q = torch.randn(2, 6, 3, 4, 5, generator=g).permute(2, 0, 3, 1, 4)[0]
        _, k, v = torch.randn(2, 9, 3, 4, 5, generator=g).permute(2, 0, 3, 1, 4)
        return q, k, v
    if layout == "sliced":  # every other head, part of the rows and of a wider last dim
        q = torch.randn(2, 8, 7, 9, generator=g)[:, ::2, 1:, :5]
        k, v = (torch.randn(2, 2, 11, 8, generator=g)[:, :, 2:, 3:] for _ in range(2))
        return q, k, v
    # expanded: one key and value row broadcast over S, one batch entry over B
    q = torch.randn(1, 4, 6, 5, generator=g).expand(2, -1, -1, -1)
    k, v = (torch.randn(2, 2, 1, 5, generator=g).expand(-1, -1, 9, -1) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("layout", ["contiguous", "permuted", "sliced", "expanded"])
def test_ops_pass_torch_library_opcheck_in_every_layout(layout):
    """Schema, fake kernels and autograd registration agree with the real kernels, whatever
    the inputs' strides: every result is a new contiguous tensor (the backward's fake kernel
    once promised dq, dk and dv in the strides of q, k and v, which a compiled training step
    on permuted q, k, v views rejected)."""
    q, k, v = _in_layout(layout)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    modifier = mb.alibi(4) + mb.softcap(3.0) + mb.sinks(sinks)
    call = prepare(q, k, v, masks.causal(), modifier, None, 0.0, False)
    args = fused._args(call)
    leaves = [t.detach().requires_grad_() for t in (q, k, v, sinks)]
    with_grad = (*leaves[:3], *args[3:11], leaves[3])
    torch.library.opcheck(torch.ops.multihead.fused_attention.default, with_grad)
    plain = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    for heads in ([], [3, 1]):
        chosen = torch.tensor(heads, dtype=torch.long)
        torch.library.opcheck(torch.ops.multihead.fused_attention_weights.default, (*plain, chosen))
    out, lse, _ = torch.ops.multihead.fused_attention(*plain)
    grad = torch.randn(out.shape).transpose(2, 3).contiguous().transpose(2, 3)  # strided too
    q, k, v, items, chunks, keep, bias, table, shift, scale, softcap, _ = plain
    backward = (grad, q, k, v, out, lse, items, chunks, keep, bias, table, shift, scale, softcap)
    torch.library.opcheck(
        torch.ops.multihead.fused_attention_backward.default, (*backward, False, True)
    )


class _PackedAttention(torch.nn.Module):
    """The usual packed-projection layout: q, k, v are permuted views of one projection."""

    def __init__(self, e: int = 32, h: int = 4) -> None:
        super().__init__()
        self.h = h
        self.qkv, self.out = torch.nn.Linear(e, 3 * e), torch.nn.Linear(e, e)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, e = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.h, e // self.h).permute(2, 0, 3, 1, 4)
        y = mh.attention(q, k, v, masks.causal(), bias=mb.softcap(4.0), backend="fused")
        return self.out(y.transpose(1, 2).reshape(b, n, e))


def test_compiled_training_step_on_permuted_views_equals_eager():
    """torch.compile(fullgraph=True) of a training step with backend="fused" on permuted q, k,
    v views: outputs and gradients equal eager's. Run on AOTAutograd's graphs with every
    custom op's fake kernel checked against the real one (the cross-reference backend): the
    check Inductor's generated code makes, without building C++."""
    torch.manual_seed(0)
    module = _PackedAttention()
    x = torch.randn(2, 7, 32)
    eager = module(x)
    want = torch.autograd.grad(eager.square().sum(), list(module.parameters()))
    torch._dynamo.reset()
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager_decomp_partition_crossref")
    got_out = compiled(x)
    got = torch.autograd.grad(got_out.square().sum(), list(module.parameters()))
    torch._dynamo.reset()
    torch.testing.assert_close(got_out, eager, rtol=0, atol=1e-6)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", ["none", "causal", "window_both", "documents&causal"])
def test_softcap_and_sinks_in_float32_and_bfloat16(kind):
    """The cap's tanh runs as vector code in float32: outputs and weights within 1e-5 of the
    float64 formula (with an ALiBi term beside the cap and the sinks), and FlashAttention's
    2x rule in bf16 for outputs, weights and gradients."""
    b, h, h_kv, length_q, length_k, d = 2, 4, 2, 37, 45, 16
    q, k, v = qkv(b, h, h_kv, length_q, length_k, d, seed=9)
    q = 3 * q  # scores of several units: the cap bends them
    case = make_case(kind, b, h, length_q, length_k, seed=9)
    g = torch.Generator().manual_seed(9)
    logits = 2 * torch.randn(h, generator=g, dtype=torch.float64)
    slopes = torch.rand(h, generator=g, dtype=torch.float64)
    alibi = mb.alibi(slopes=slopes).to_dense(length_q, length_k, dtype=torch.float64)
    want, want_w = naive_attention(q, k, v, case.keep, bias=alibi, softcap=2.0, sinks=logits)
    modifier = mb.softcap(2.0) + mb.sinks(logits.float()) + mb.alibi(slopes=slopes.float())
    lo = [t.float() for t in (q, k, v)]
    out, w = mh.attention_with_weights(*lo, case.mask, bias=modifier, backend="fused")
    plain = mh.attention(*lo, case.mask, bias=modifier, backend="fused")
    for got, ref in ((out, want), (w, want_w), (plain, want)):
        assert (got.double() - ref).abs().max() <= 1e-5

    half = [t.to(torch.bfloat16) for t in (q, k, v)]
    capped = mb.softcap(2.0) + mb.sinks(logits.float())
    grad_out = torch.randn(b, h, length_q, d, generator=g)

    def run(q, k, v):
        return mh.attention(q, k, v, case.mask, bias=capped, backend="fused")

    rule = twice_naive_errors(run, *half, case.keep, grad_out, softcap=2.0, sinks=logits.float())
    for name, error, bound in rule:
        assert error <= bound, f"{name}: error {error:.3g} > bound {bound:.3g}"
    w_half = mh.attention_with_weights(*half, case.mask, bias=capped, backend="fused").weights
    assert w_half.dtype == torch.bfloat16
    rounded = [t.double() for t in half]
    ref_w = naive_attention(*rounded, case.keep, softcap=2.0, sinks=logits.float())[1]
    naive_w = naive_attention(*half, case.keep, softcap=2.0, sinks=logits.float())[1]
    floor = torch.finfo(torch.bfloat16).eps * ref_w.abs().max()
    bound = 2 * (naive_w.double() - ref_w).abs().max() + floor
    assert (w_half.double() - ref_w).abs().max() <= bound


@pytest.mark.parametrize("mask", [None, masks.causal()], ids=["none", "causal"])
def test_compiled_function_has_no_graph_break(mask):
    torch._dynamo.reset()
    q, k, v = qkv(2, 4, 2, 33, 33, 8, dtype=torch.float32)

    def f(q, k, v):
        return mh.attention(q, k, v, mask, backend="fused")

    eager = f(q, k, v)
    report = torch._dynamo.explain(f)(q, k, v)
    assert report.graph_break_count == 0 and report.graph_count == 1
    compiled = torch.compile(f, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(q, k, v), eager, rtol=0, atol=0)
    torch._dynamo.reset()


def test_exported_program_calls_the_op():
    class Attend(torch.nn.Module):
        def forward(self, q, k, v):
            return mh.attention(q, k, v, masks.causal(), backend="fused")

    q, k, v = qkv(1, 2, 2, 8, 8, 4, dtype=torch.float32)
    program = torch.export.export(Attend(), (q, k, v))
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert "multihead.fused_attention.default" in targets
    torch.testing.assert_close(program.module()(q, k, v), Attend()(q, k, v), rtol=0, atol=0)


def test_the_block_peaks_are_measured_or_zero_on_any_cpu():
    """The bf16 block peak is measured where torch's bf16 microkernel runs and 0 elsewhere:
    on a CPU with neither AMX nor AVX512-BF16 torch raises instead of falling back, and
    ``bench kernels`` reads this peak on every machine. bf16 products are used only where
    they run."""
    kernel = fused.build()
    assert kernel.block_peak(64, 0.02, False) > 0
    half = kernel.block_peak(64, 0.02, True)
    assert (half > 0) is kernel.half_available()
    assert kernel.half_available() or not kernel.half_products()


@pytest.mark.parametrize(
    "kind,scale",
    [("none", None), ("causal", 10.0), ("window_both", None), ("lengths_per_query", None),
     ("documents", 10.0), ("dense", None)],
)  # fmt: skip
@pytest.mark.parametrize("layout", ["odd_dim", "heads_inside_rows", "odd_row_stride"])
def test_bf16_block_products_keep_the_2x_rule(kind, scale, layout):
    """bf16 inputs run their block products on the bf16 microkernel where it is faster
    (``half_products``: keys and values packed in pairs, float statistics, the weights rounded
    to bf16 for the product with V) and widened to float elsewhere; either way outputs,
    weights and gradients keep FlashAttention's 2x rule. More than one key block and chunks
    starting at odd offsets (windows, documents, lengths), in three layouts that the key
    packing handles apart: an odd head dim (a zero column), an even one with the heads inside
    each row as a module's projection gives them (a pair of dims is one 32-bit unit), and an
    even one whose rows are an odd number of values apart (no such units)."""
    b, h, h_kv, length_q, length_k = 2, 2, 1, 75, 1100
    d = 15 if layout == "odd_dim" else 16
    g = torch.Generator().manual_seed(17)
    q = torch.randn(b, h, length_q, d, generator=g).to(torch.bfloat16)
    if layout == "heads_inside_rows":  # (B, S, H_kv, D) seen as (B, H_kv, S, D)
        k, v = (
            torch.randn(b, length_k, h_kv, d, generator=g).to(torch.bfloat16).transpose(1, 2)
            for _ in range(2)
        )
    else:
        wide = d + (layout == "odd_row_stride")
        k, v = (
            torch.randn(b, h_kv, length_k, wide, generator=g).to(torch.bfloat16)[..., -d:]
            for _ in range(2)
        )
    case = make_case(kind, b, h, length_q, length_k, seed=17)
    grad_out = torch.randn(b, h, length_q, d, generator=g)

    def run(q, k, v):
        return mh.attention(q, k, v, case.mask, scale=scale, backend="fused")

    for name, error, bound in twice_naive_errors(run, q, k, v, case.keep, grad_out, scale):
        assert error <= bound, f"{name}: error {error:.3g} > bound {bound:.3g}"
    w = mh.attention_with_weights(q, k, v, case.mask, scale=scale, backend="fused").weights
    rounded = [t.double() for t in (q, k, v)]
    ref = naive_attention(*rounded, case.keep, scale=scale)[1]
    naive = naive_attention(q, k, v, case.keep, scale=scale)[1]
    bound = 2 * (naive.double() - ref).abs().max() + torch.finfo(torch.bfloat16).eps * ref.max()
    assert w.dtype == torch.bfloat16 and (w.double() - ref).abs().max() <= bound


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5])
def test_sentence_length_rows_keep_the_2x_rule(dtype, window):
    """Packed sentences as embeddings run them: documents of every length modulo the vector
    width (a row's keys end anywhere inside a vector, whose tail the softmax runs through the
    same vector code), alone and under a window (rows with keep bits). Against float64 on the
    same rounded inputs: within twice the error of the naive formula in ``dtype``, plus one
    ulp of the largest output (the weights' rounding to bf16 for their product with V)."""
    lengths = [1, 2, 15, 16, 17, 31, 33, 47, 64, 109, 3]
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    length, h, d = ids.numel(), 3, 32
    q, k, v = (t.to(dtype) for t in qkv(1, h, h, length, length, d, seed=21))
    mask = masks.documents(ids)
    keep = ids[:, None] == ids[None, :]
    if window is not None:
        mask = mask & masks.sliding_window(window)  # keys i - window .. i
        behind = torch.arange(length)[:, None] - torch.arange(length)[None, :]
        keep = keep & (behind >= 0) & (behind <= window)
    out = mh.attention(q, k, v, mask, backend="fused")
    ref = naive_attention(*(t.double() for t in (q, k, v)), keep)[0]
    naive = naive_attention(q, k, v, keep)[0]
    bound = 2 * (naive.double() - ref).abs().max() + torch.finfo(dtype).eps * ref.abs().max()
    assert out.dtype == dtype
    assert (out.double() - ref).abs().max() <= bound


@pytest.mark.parametrize("kind", ["none", "documents", "lengths"])
def test_bf16_packing_is_the_same_in_every_layout(kind):
    """The same keys and values give the same bits whichever way the key packing reads them:
    as 32-bit pairs of dims (rows 4-byte aligned, even head dim) or value by value (rows an
    odd number of values apart), with NaN and inf in values no query sees (zeroed as they
    are packed)."""
    b, h, length_q, length_k, d = 2, 4, 40, 1300, 32
    q, k, v = (t.to(torch.bfloat16) for t in qkv(b, h, 2, length_q, length_k, d, seed=8))
    mask = make_case(kind, b, h, length_q, length_k, seed=8).mask
    if kind == "lengths":  # the last 3 keys are seen by no query
        mask = masks.lengths(torch.tensor([1000, length_k - 3]))
        v[:, :, -3:] = torch.tensor([torch.nan, torch.inf, -torch.inf]).to(torch.bfloat16)[:, None]

    def odd_rows(t: torch.Tensor) -> torch.Tensor:
        wide = torch.zeros(*t.shape[:3], d + 1, dtype=t.dtype)
        wide[..., 1:] = t
        return wide[..., 1:]

    aligned = mh.attention(q, k, v, mask, backend="fused")
    assert odd_rows(k).stride(2) % 2 == 1
    unaligned = mh.attention(q, odd_rows(k), odd_rows(v), mask, backend="fused")
    assert torch.equal(aligned, unaligned)
    if kind == "lengths":
        assert torch.isfinite(aligned).all()


@pytest.fixture
def careful(monkeypatch) -> list[int]:
    """One entry per call that took the NaN rule's careful path, from here on."""
    from multihead.backends import _nonfinite

    calls: list[int] = []
    real = _nonfinite._rows_seeing
    monkeypatch.setattr(_nonfinite, "_rows_seeing", lambda *a: calls.append(1) or real(*a))
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nan_rule_on_the_blocked_path(dtype, careful):
    """Beyond decoding, keys and values are checked once per block of 512 keys when they are
    packed, and a task reading part of a flagged block checks its own rows: NaN in padding
    that no query sees (past the lengths, inside a block that is read) stays out of every
    result without the careful path; NaN in a visible value makes exactly its rows NaN."""
    b, h, length_q, length_k, d = 2, 2, 40, 700, 16
    q, k, v = (t.to(dtype) for t in qkv(b, h, 1, length_q, length_k, d, seed=2))
    lens = torch.tensor([600, 650])
    mask = masks.lengths(lens)
    want = mh.attention(q, k, v, mask, backend="fused")
    k_pad, v_pad = k.clone(), v.clone()
    k_pad[0, 0, 620], v_pad[1, 0, 699] = torch.nan, torch.inf
    got = mh.attention(q, k_pad, v_pad, mask, backend="fused")
    assert torch.equal(got, want) and careful == []
    v_bad = v.clone()
    v_bad[1, 0, 10] = torch.nan  # every row of batch entry 1 sees key 10
    got = mh.attention(q, k, v_bad, mask, backend="fused")
    assert torch.isnan(got[1]).all() and torch.equal(got[0], want[0]) and careful == [1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_no_row_reads_are_neither_packed_nor_checked(dtype, careful):
    """A window's rows read a few key blocks of a long sequence: only those are packed and
    checked, so NaN in a block no row reads changes nothing and takes no careful path, and
    the result is the clean inputs' (and, in float32, the reference's to float32 rounding)."""
    q, k, v = (t.to(dtype) for t in qkv(1, 2, 2, 100, 3000, 16, seed=4))
    window = masks.sliding_window(64)  # the 100 rows see keys 2836..2999: the last block
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[0, 0, 10], v_bad[0, 1, 1000] = torch.nan, torch.inf
    got = mh.attention(q, k_bad, v_bad, window, backend="fused")
    assert careful == [] and torch.equal(got, mh.attention(q, k, v, window, backend="fused"))
    if dtype == torch.float32:  # bf16 against the formula: test_bf16_block_products_keep_...
        want = mh.attention(q, k, v, window, backend="reference")
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 4])
def test_decoding_screens_its_reads_by_the_products(dtype, rows, careful):
    """Decoding reads keys and values in place and screens them through the scores and the
    outputs, checking a key block again only where the screen fires: NaN in a visible key or
    value makes the rows NaN through the careful path; finite inputs whose scores or outputs
    overflow are not NaN input, so they leave the kernel as it computes them, without the
    careful path (and without an error: NonFiniteInput never escapes)."""
    g = torch.Generator().manual_seed(3)
    h, h_kv, s, d = 4, 2, 600, 32

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    q, k, v = rand(1, h, rows, d), rand(1, h_kv, s, d), rand(1, h_kv, s, d)
    want = mh.attention(q, k, v, None, backend="fused")
    assert torch.isfinite(want).all() and careful == []
    # scores of about 1e38 * sqrt(d); outputs summing 600 weights of 1 times 1e38
    huge_scores = (rand(1, h, rows, d, scale=1e19), rand(1, h_kv, s, d, scale=1e19), v)
    huge_sums = (torch.zeros_like(q), k, torch.full_like(v, 1e38))
    for huge in (huge_scores, huge_sums):
        assert torch.isfinite(torch.cat([t.flatten() for t in huge])).all()
        mh.attention(*huge, None, backend="fused")
        assert careful == []
    for which, value in ((1, torch.nan), (1, torch.inf), (2, torch.nan), (2, -torch.inf)):
        bad = [q, k.clone(), v.clone()]
        bad[which][0, 1, 550, 3] = value  # kv head 1: query heads 2 and 3 see it
        got = mh.attention(*bad, None, backend="fused")
        assert torch.isnan(got[:, 2:]).all() and torch.equal(got[:, :2], want[:, :2])
    assert len(careful) == 4


def test_chosen_heads_come_from_one_pass_and_equal_the_full_call(monkeypatch):
    """attention_with_weights(heads=) on the kernel: one call gives every head's output and
    the weights of the chosen heads alone, in their order; they equal the full call's within
    1e-6 with a mask and a bias that differ per head and sink logits. A non-finite value
    makes the chosen heads' rows NaN as it does the full call's."""
    b, h, h_kv, length_q, length_k = 2, 8, 2, 70, 90
    q, k, v = qkv(b, h, h_kv, length_q, length_k, 16, dtype=torch.float32, seed=12)
    g = torch.Generator().manual_seed(12)
    per_head = torch.rand(b, h, length_q, length_k, generator=g) < 0.7
    mask = masks.causal() & masks.dense(per_head)
    modifier = mb.alibi(h) + mb.sinks(torch.randn(h, generator=g))
    full = mh.attention_with_weights(q, k, v, mask, bias=modifier, backend="fused")
    calls = []
    real = fused._args
    monkeypatch.setattr(
        fused, "_args", lambda call, **kw: calls.append(call.heads) or real(call, **kw)
    )
    part = mh.attention_with_weights(q, k, v, mask, bias=modifier, heads=[6, 1], backend="fused")
    assert calls == [(6, 1)] and part.weights.shape == (b, 2, length_q, length_k)
    assert (part.weights - full.weights[:, [6, 1]]).abs().max() <= 1e-6
    assert (part.output - full.output).abs().max() <= 1e-6
    v_bad = v.clone()
    v_bad[1, 1, 5] = torch.nan  # key/value head 1 serves query heads 4-7
    full = mh.attention_with_weights(q, k, v_bad, mask, bias=modifier, backend="fused")
    part = mh.attention_with_weights(
        q, k, v_bad, mask, bias=modifier, heads=[6, 1], backend="fused"
    )
    want = full.weights[:, [6, 1]]
    assert torch.equal(torch.isnan(part.weights), torch.isnan(want))
    assert torch.isnan(want[1, 0]).any() and not torch.isnan(want[:, 1]).any()


@pytest.fixture
def unbuilt(monkeypatch, tmp_path):
    """A process that has not tried to build the kernel, with an empty build cache and an
    installation without the package build's kernel."""
    from multihead.kernels import build

    monkeypatch.setenv("MULTIHEAD_EXTENSION_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(build, "packaged", lambda kernel: (None, "not in this test"))
    monkeypatch.setattr(fused._LOADER, "module", None)
    monkeypatch.setattr(fused._LOADER, "error", None)
    monkeypatch.setattr(fused, "_looked", False)
    monkeypatch.setattr(registry, "_CHOICES", {})
    return tmp_path / "cache"


def test_missing_compiler_falls_back_and_says_why_in_one_line(monkeypatch, unbuilt):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.setenv("MULTIHEAD_FUSED_AUTO", "1")
    q, k, v = qkv(1, 2, 2, 6, 6, 4, dtype=torch.float32)
    # asking why not fused, or running auto, never starts a compile
    choice = mh.explain_backend(q, k, v, masks.sliding_window(2))
    assert choice.backend == "tiled"
    assert choice.reasons["fused"].startswith("not built on this machine yet: multihead doctor")
    torch.testing.assert_close(
        mh.attention(q, k, v, masks.sliding_window(2)),
        mh.attention(q, k, v, masks.sliding_window(2), backend="reference"),
    )
    assert not unbuilt.exists()
    # an explicit backend="fused" tries the build, and the failure is said in one line
    with pytest.raises(ValueError, match=r"backend 'fused' cannot run this call: .*install g\+\+"):
        mh.attention(q, k, v, backend="fused")
    reason = mh.explain_backend(q, k, v, masks.sliding_window(2)).reasons["fused"]
    assert "\n" not in reason
    assert "no C++ compiler '/nonexistent/c++' found" in reason


def test_failed_build_reports_the_compiler_error(monkeypatch, unbuilt):
    from torch.utils import cpp_extension

    def broken(*args, **kwargs):
        raise RuntimeError("Error building extension\n[1/2] c++ -O3 ...\nx.cpp:3:1: error: boom")

    monkeypatch.setattr(cpp_extension, "load", broken)
    assert fused.build_error() == "the C++ kernel could not be built: x.cpp:3:1: error: boom"
    assert fused.build_error() is not None  # remembered: no second attempt
    q, k, v = qkv(1, 2, 2, 6, 6, 4)
    assert "error: boom" in mh.explain_backend(q, k, v).reasons["fused"]


@pytest.mark.slow
def test_builds_from_a_clean_cache_and_past_a_lock_left_by_a_killed_build(monkeypatch, unbuilt):
    """The first use compiles into the per-user cache (about half a minute on two cores).

    torch's build lock file, left behind by a process killed while building or loading, made
    every later load wait for it forever; a build now holds an OS lock that dies with its
    holder, and clears the left-over file."""
    import threading

    assert fused.build_error() is None
    assert fused.origin().startswith("the per-user cache")
    built = list(unbuilt.glob("multihead_fused_*/*.so"))
    assert len(built) == 1
    q, k, v = qkv(1, 2, 1, 5, 7, 4)
    want, _ = naive_attention(q, k, v)
    torch.testing.assert_close(mh.attention(q, k, v, backend="fused"), want, rtol=0, atol=1e-12)

    monkeypatch.setattr(fused._LOADER, "module", None)
    stale = built[0].parent / "lock"
    stale.touch()
    loader = threading.Thread(target=fused.build_error, daemon=True)
    loader.start()
    loader.join(timeout=120)  # a no-op ninja run and an import: seconds
    assert not loader.is_alive(), "the load is still waiting for the left-over lock file"
    assert fused._LOADER.module is not None and not stale.exists()


def test_turned_off_by_environment(monkeypatch, unbuilt):
    monkeypatch.setenv("MULTIHEAD_FUSED", "0")
    assert fused.build_error() == "turned off by MULTIHEAD_FUSED=0"
    assert not unbuilt.exists()


@pytest.fixture
def measuring(monkeypatch):
    monkeypatch.setenv("MULTIHEAD_FUSED_AUTO", "1")
    monkeypatch.setattr(fused, "_MEASURED", {})
    monkeypatch.setattr(registry, "_CHOICES", {})  # auto's remembered choices: none yet
    times: list[float] = []
    monkeypatch.setattr(fused, "_best_time", lambda fn, repeats=3: (fn(), times.pop(0))[1])
    return times


def test_auto_picks_fused_only_where_it_measured_faster(measuring):
    q, k, v = qkv(2, 4, 2, 100, 100, 16, dtype=torch.float32)
    assert "not been timed yet" in mh.explain_backend(q, k, v).reasons["fused"]
    measuring += [1.0, 2.0]  # fused, then sdpa (auto's choice without it)
    mh.attention(q, k, v)  # the first call of the class times it
    choice = mh.explain_backend(q, k, v)
    assert choice.backend == "fused"
    assert "measured faster than sdpa on this machine" in choice.reasons["sdpa"]
    mh.attention(q, k, v)
    mh.attention(q[:, :, :70], k, v)  # the same shape class: remembered, nothing measured again
    assert mh.explain_backend(q[:, :, :70], k, v).backend == "fused"
    measuring += [1.95, 2.0]  # a new class (L=256); 2.5% faster is noise
    q2, k2, v2 = qkv(2, 4, 2, 256, 256, 16, dtype=torch.float32)
    mh.attention(q2, k2, v2)
    assert mh.explain_backend(q2, k2, v2).backend == "sdpa"
    assert measuring == []


def test_auto_times_a_proxy_of_long_calls(measuring, monkeypatch):
    """The measurement runs the call's middle PROXY_ROWS query rows against the keys they
    see, with the mask cropped to them (the same kernel paths at a bounded cost), never the
    whole call: a long call's
    first use costs little more than the call, and a rival that materializes every weight
    does so for the proxy's rows only. The call itself then runs whole."""
    from multihead.backends import _measure

    seen: list[tuple[str, int, object, int]] = []
    real_fused, real_sdpa = fused.BACKEND.run, registry.BACKENDS["sdpa"].run

    def spy(name, run):
        def wrapped(call):
            seen.append((name, call.shape[3], call.mask, call.shape[4]))
            return run(call)

        return wrapped

    monkeypatch.setattr(fused, "run", spy("fused", real_fused))
    monkeypatch.setattr(fused, "BACKEND", replace(fused.BACKEND, run=fused.run))
    monkeypatch.setitem(registry._registered, "fused", fused.BACKEND)
    monkeypatch.setitem(
        registry._registered, "sdpa", replace(registry.BACKENDS["sdpa"], run=spy("sdpa", real_sdpa))
    )
    q, k, v = qkv(1, 2, 2, 1000, 1000, 8, dtype=torch.float32)
    measuring += [1.0, 2.0]
    out = mh.attention(q, k, v, masks.causal())
    timed = seen[:-1]
    assert {name for name, _, _, _ in timed} == {"fused", "sdpa"}
    assert all(rows == _measure.PROXY_ROWS for _, rows, _, _ in timed)
    # rows [372, 628) of the causal 1000 x 1000 problem: row i sees keys [0, i]
    assert all(keys == 628 for _, _, _, keys in timed)
    cropped = timed[0][2].to_dense(_measure.PROXY_ROWS, 628)[0, 0]
    assert cropped.sum(-1).tolist() == list(range(373, 629))
    assert seen[-1][:2] == ("fused", 1000)  # then the call itself, on the winner
    want, _ = naive_attention(q, k, v, masks.causal().to_dense(1000, 1000))
    assert (out.double() - want).abs().max() < 1e-5


def test_chosen_heads_are_chosen_by_the_plain_call_and_measure_no_weights(measuring, monkeypatch):
    """attention_with_weights(heads=) picks its backend as the call without weights is picked:
    in a model the other layers have measured that class already, and its proxy never
    writes every head's weights. The kernel then runs one pass for the chosen heads."""
    q, k, v = qkv(1, 4, 2, 600, 600, 16, dtype=torch.float32, seed=3)
    mask = masks.causal()
    measuring += [1.0, 2.0]  # the plain class: the kernel, then sdpa
    mh.attention(q, k, v, mask)  # another layer of the model
    assert mh.explain_backend(q, k, v, mask).backend == "fused"
    calls = []
    real = fused._args
    monkeypatch.setattr(
        fused, "_args", lambda call, **kw: calls.append(call.heads) or real(call, **kw)
    )
    part = mh.attention_with_weights(q, k, v, mask, heads=[3, 0])
    assert calls == [(3, 0)]  # one pass on the kernel, no measurement run
    assert measuring == [] and len(fused._MEASURED) == 1
    assert "not been timed yet" in mh.explain_backend(q, k, v, mask, weights=True).reasons["fused"]
    want = mh.attention_with_weights(q, k, v, mask, backend="reference")
    torch.testing.assert_close(part.weights, want.weights[:, [3, 0]], rtol=0, atol=1e-6)
    torch.testing.assert_close(part.output, want.output, rtol=0, atol=1e-6)


def test_auto_measures_nothing_for_calls_fused_cannot_run(measuring):
    q, k, v = qkv(1, 2, 2, 8, 8, 4, dtype=torch.float32)
    assert mh.explain_backend(q, k, v, dropout_p=0.2).backend != "fused"
    assert fused._MEASURED == {}


@pytest.mark.parametrize("length_q", [1, 16])
@pytest.mark.parametrize("kind", ["none", "causal", "lengths"])
def test_decode_splits_keys_across_threads_and_merges_exactly(kind, length_q):
    """L <= 16 over a long cache with fewer (batch, head) pairs than threads: each pair's keys
    are cut into parts computed in parallel and merged by their (max, sum)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        b, h, length_k = 2, 2, 2100  # 9 key blocks; lengths gives batch 1 no key at all
        q, k, v = qkv(1 if kind != "lengths" else b, h, 1, length_q, length_k, 16)
        case = make_case(kind, q.shape[0], h, length_q, length_k)
        want, _ = naive_attention(q, k, v, case.keep)
        got = mh.attention(q, k, v, case.mask, backend="fused")
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        assert torch.equal(got, mh.attention(q, k, v, case.mask, backend="fused"))
    finally:
        torch.set_num_threads(before)


def test_split_decode_in_float32_equals_the_one_pass_result():
    """One (batch, head) pair over 4,000 keys on two threads is cut into parts (fewer tasks
    than threads); the same row among eight heads (eight tasks: no split) is one pass. The
    merge by (max, sum) reorders float32 sums only: within float32 rounding of the one pass
    (eps 1.2e-7 times a few terms' worth of reordering; the outputs are O(1))."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        q, k, v = qkv(1, 1, 1, 1, 4000, 64, dtype=torch.float32, seed=5)
        split = mh.attention(q, k, v, backend="fused")
        one_pass = mh.attention(*(t.expand(1, 8, -1, -1) for t in (q, k, v)), backend="fused")
        torch.testing.assert_close(split[0, 0], one_pass[0, 3], rtol=2e-6, atol=2e-7)
        want, _ = naive_attention(*(t.double() for t in (q, k, v)))
        torch.testing.assert_close(split.double(), want, rtol=0, atol=2e-6)
    finally:
        torch.set_num_threads(before)


def _kernel_queries(monkeypatch) -> list[tuple[int, ...]]:
    """The query shapes the kernel itself receives, from here on."""
    seen: list[tuple[int, ...]] = []
    module = fused.build()

    class Spy:
        def __getattr__(self, name):
            real = getattr(module, name)
            if name != "forward":
                return real
            return lambda q, *rest: seen.append(tuple(q.shape)) or real(q, *rest)

    monkeypatch.setattr(fused._LOADER, "module", Spy())
    return seen


@pytest.mark.parametrize("kind", ["none", "lengths", "key_padding"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoding_folds_grouped_query_heads_into_rows(kind, dtype, monkeypatch):
    """One query row, 8 query heads over 2 key/value heads: the 4 heads of a group are the
    rows of one (B, H_kv, 4, D) kernel call (each key read once per group), with the result
    of the unfolded formula, in float32 to float32 rounding and in bf16 within the 2x rule."""
    b, h, h_kv, length_k, d = 2, 8, 2, 1300, 32
    q, k, v = (t.to(dtype) for t in qkv(b, h, h_kv, 1, length_k, d, seed=8))
    lens = torch.tensor([1300, 777])
    mask = {
        "none": None,
        "lengths": masks.lengths(lens),
        "key_padding": masks.key_padding(torch.arange(length_k)[None] < lens[:, None]),
    }[kind]
    keep = None if mask is None else mask.to_dense(1, length_k).expand(b, h, 1, -1)
    seen = _kernel_queries(monkeypatch)
    got = mh.attention(q, k, v, mask, backend="fused")
    assert seen == [(b, h_kv, h // h_kv, d)] and got.shape == (b, h, 1, d)
    if dtype == torch.float32:
        want, _ = naive_attention(q.double(), k.double(), v.double(), keep)
        torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-6)
    else:
        errors = twice_naive_errors(
            lambda q, k, v: mh.attention(q, k, v, mask, backend="fused"), q, k, v, keep
        )
        for name, error, bound in errors:
            assert error <= bound, f"{name}: error {error:.3g} > bound {bound:.3g}"


def test_decoding_calls_that_differ_by_head_do_not_fold(monkeypatch):
    """Sinks (one logit per head) and a mask that differs by head keep the heads apart."""
    b, h, h_kv, length_k, d = 1, 4, 2, 300, 16
    q, k, v = qkv(b, h, h_kv, 1, length_k, d, dtype=torch.float32, seed=9)
    per_head = torch.rand(b, h, 1, length_k, generator=torch.Generator().manual_seed(1)) < 0.7
    per_head[..., 0] = True
    seen = _kernel_queries(monkeypatch)
    got = mh.attention(q, k, v, masks.dense(per_head), backend="fused")
    want, _ = naive_attention(q.double(), k.double(), v.double(), per_head)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-6)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    got = mh.attention(q, k, v, bias=mb.sinks(sinks), backend="fused")
    want = mh.attention(q, k, v, bias=mb.sinks(sinks), backend="reference")
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6)
    assert seen == [(b, h, 1, d), (b, h, 1, d)]


@pytest.mark.parametrize("length_q", [1, 3, 5])
def test_bf16_decoding_reads_the_cache_in_place_within_the_2x_rule(length_q):
    """Decoding over a bf16 cache reads keys and values as they are stored (no float copy of
    the cache; the scores by the CPU's bf16 dot products where it has them and the head dim is
    a multiple of 32) and keeps the 2x rule, for 2, 6 and 10 query rows per key (1, 3, 8 + 2
    rows at a time); an odd head dim takes the widening code's tails."""
    for d in (128, 64, 15):
        q, k, v = (t.to(torch.bfloat16) for t in qkv(2, 4, 2, length_q, 1500, d, seed=length_q + d))

        def run(q, k, v):
            return mh.attention(q, k, v, masks.causal(), backend="fused")

        keep = masks.causal().to_dense(length_q, 1500)
        for name, error, bound in twice_naive_errors(run, q, k, v, keep):
            assert error <= bound, f"d={d} {name}: error {error:.3g} > bound {bound:.3g}"


def test_nan_rule_while_decoding_over_a_bf16_cache():
    """The bf16 cache is checked on its bits as it is read: ±inf or NaN in a key or value a
    row sees makes that row NaN, and only that row's head group."""
    q, k, v = (t.to(torch.bfloat16) for t in qkv(1, 4, 2, 1, 900, 32, seed=3))
    clean = mh.attention(q, k, v, backend="fused")
    k_bad = k.clone()
    k_bad[0, 1, 700, 3] = torch.inf
    out = mh.attention(q, k_bad, v, backend="fused")
    assert torch.isnan(out[0, 2:]).all() and torch.equal(out[0, :2], clean[0, :2])
    v_bad = v.clone()
    v_bad[0, 0, 5, 31] = torch.nan
    out = mh.attention(q, k, v_bad, backend="fused")
    assert torch.isnan(out[0, :2]).all() and torch.equal(out[0, 2:], clean[0, 2:])


def test_auto_measures_training_calls_with_their_backward(measuring, monkeypatch):
    """A call that needs gradients is timed forward and backward, on copies: the caller's
    tensors gain no .grad from the measurement."""
    q, k, v = qkv(1, 2, 2, 40, 40, 8, dtype=torch.float32, requires_grad=True)
    seen = []
    real = torch.autograd.grad
    monkeypatch.setattr(torch.autograd, "grad", lambda *a, **kw: seen.append(1) or real(*a, **kw))
    measuring += [1.0, 2.0]
    mh.attention(q, k, v, masks.causal())
    assert len(seen) == 2 * 2  # a warm-up and a timed step on each side
    assert mh.explain_backend(q, k, v, masks.causal()).backend == "fused"
    assert q.grad is None and k.grad is None and v.grad is None


def test_nan_rule_is_checked_while_reading_not_by_a_second_pass(monkeypatch):
    """The guard's pass over q, k and v (a second read of a whole KV cache at decode) is
    skipped for the kernel, which reports NaN or ±inf in the blocks it reads."""
    from multihead.backends import _nonfinite

    q, k, v = qkv(1, 2, 2, 3, 2100, 8)
    window = masks.sliding_window(100)  # rows see keys 1997..2099
    want = mh.attention(q, k, v, window, backend="reference")
    checked = []
    real = _nonfinite.finite
    monkeypatch.setattr(_nonfinite, "finite", lambda *t: checked.append(1) or real(*t))
    clean = mh.attention(q, k, v, backend="fused")
    assert checked == []
    v_bad = v.clone()
    v_bad[0, 1, 2000] = torch.nan
    k_bad = k.clone()
    k_bad[0, 0, 5] = -torch.inf
    out = mh.attention(q, k_bad, v_bad, backend="fused")
    assert torch.isnan(out).all()  # every row of both heads sees a bad key
    out = mh.attention(q, k_bad, v_bad, window, backend="fused")  # head 1 sees a bad key
    assert torch.isnan(out[0, 1]).all()
    torch.testing.assert_close(out[0, 0], want[0, 0], rtol=0, atol=1e-12)
    assert checked == []  # the careful path looks at rows, not at the whole tensors again
    mh.attention(q, k, v, backend="tiled")
    assert checked  # other backends keep the guard's pass
    assert torch.isfinite(clean).all()


def test_two_checkouts_of_the_same_sources_build_apart(tmp_path):
    """The build name covers the sources' paths as well as their contents: torch's build file
    records the paths, so two checkouts sharing one folder rebuilt each other's kernel at every
    first use (a minute each, one waiting on the other's lock)."""
    from multihead.kernels import build

    names = []
    for checkout in ("one", "two"):
        source = tmp_path / checkout / "kernel.cpp"
        source.parent.mkdir()
        source.write_text("int f() { return 1; }\n")
        names.append(build.build_name("multihead_x", [source], ["-O3"]))
    assert names[0] != names[1] and all(n.startswith("multihead_x_") for n in names)
    again = build.build_name("multihead_x", [tmp_path / "one" / "kernel.cpp"], ["-O3"])
    assert again == names[0]  # stable for one checkout
    (tmp_path / "one" / "kernel.cpp").write_text("int f() { return 2; }\n")
    changed = build.build_name("multihead_x", [tmp_path / "one" / "kernel.cpp"], ["-O3"])
    assert changed != names[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [4, 300])
def test_an_unmasked_prepared_call_takes_keys_of_any_length(dtype, rows):
    """``prepared`` for an unmasked call (a decoding step's rows, or more than a query tile)
    gives one function for keys of every length: each length's output is the kernel's
    ``run`` on that call, to the bit, whichever length came before (lengths repeat and go
    back)."""
    q, k, v = qkv(2, 3, 1, rows, 300, 16, seed=7)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    attend = fused.prepared(prepare(q, k[:, :, :50], v[:, :, :50], None, None, None, 0.0, False))
    assert attend is not None
    with torch.inference_mode():
        for length in (50, 51, 51, 300, 1, 50):
            call = prepare(q, k[:, :, :length], v[:, :, :length], None, None, None, 0.0, False)
            got = attend(q, k[:, :, :length], v[:, :, :length])
            assert torch.equal(got, fused.run(call)[0])


@pytest.mark.parametrize(("length_q", "length_k"), [(1, 1), (4, 300), (700, 40), (0, 5), (3, 0)])
def test_an_unmasked_work_list_is_the_planners(length_q, length_k):
    """Unmasked calls skip the planner: their work list is the one it makes for no mask."""
    from multihead.backends._plan import plan

    got = fused._unmasked_plan(length_q, length_k, "cpu")
    want = fused._flatten(plan(None, 2, length_q, length_k, 64, "cpu"), "cpu")
    assert all(torch.equal(g, w) and g.dtype == w.dtype for g, w in zip(got, want, strict=True))
