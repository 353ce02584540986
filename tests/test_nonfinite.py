"""The NaN rule and the bias rule, on every path ``auto`` can take and every backend.

NaN rule: NaN/Inf in a query row, or in a key/value that row may see, makes that row NaN;
non-finite values that no query may see never reach any result (outputs, weights, gradients).
Bias rule: a bias is added in float32 beside half-precision inputs, never rounded to them.
"""

from __future__ import annotations

import pytest
import torch
from helpers import MASK_KINDS, make_case, naive_attention, qkv

import multihead as mh
from multihead import MultiHeadAttention, masks

# (L, S): fewer queries than keys, more, and equal
SHAPES = [(4, 7), (7, 4), (6, 6)]
# every way a call reaches a backend: auto's choices (which differ with weights, gradients,
# bias and dropout) and each backend forced
PATHS = [
    "auto",
    "auto_weights",
    "auto_grad",
    "auto_bias",
    "auto_bias_grad",
    "auto_dropout",
    "reference",
    "sdpa",
    "tiled",
    "tiled_weights_grad",
    "fused",
    "fused_grad",
    "fused_weights",
]


def _run(path: str, q, k, v, mask):
    """(output or None, weights or None, gradients of q, k, v or None) for one path."""
    grad = path.endswith("grad")
    if grad:
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    bias = None
    if "bias" in path:
        bias = torch.linspace(-1, 1, q.shape[2] * k.shape[2], dtype=q.dtype)
        bias = bias.view(1, 1, q.shape[2], k.shape[2]).requires_grad_(grad)
    backend = path if path in ("reference", "sdpa", "tiled", "fused") else "auto"
    if path in ("tiled_weights_grad", "fused_grad", "fused_weights"):
        backend = path.split("_")[0]
    weights_on = "weights" in path
    call = mh.attention_with_weights if weights_on else mh.attention
    result = call(
        q,
        k,
        v,
        mask,
        bias=bias,
        dropout_p=0.3 if path == "auto_dropout" else 0.0,
        backend=backend,
    )
    out, w = result if weights_on else (result, None)
    grads = None
    if grad:
        loss = out.sum() + (w.sum() if w is not None else 0)
        grads = torch.autograd.grad(loss, (q, k, v))
    return out, w, grads


@pytest.mark.parametrize("shape", SHAPES, ids=["L<S", "L>S", "L=S"])
@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("path", PATHS)
def test_keys_no_query_sees_never_leak(path, kind, shape):
    length_q, length_k = shape
    b, h = 2, 2
    q, k, v = qkv(b, h, 1, length_q, length_k, 5, seed=3)
    case = make_case(kind, b, h, length_q, length_k, seed=3)
    # keys hidden from every query of every head sharing the kv head (GQA: H_kv = 1)
    dead = ~case.keep.expand(b, h, length_q, length_k).any(2).any(1)[:, None, :, None]
    torch.manual_seed(0)
    clean = _run(path, q, k, v, case.mask)
    poisoned_k = torch.where(dead, torch.nan, k)
    poisoned_v = torch.where(dead, torch.inf, v)
    torch.manual_seed(0)
    got = _run(path, q, poisoned_k, poisoned_v, case.mask)
    for want, have in zip(clean[:2], got[:2]):
        if want is not None:
            assert torch.isfinite(have).all()
            torch.testing.assert_close(have, want, rtol=0, atol=1e-12)
    if clean[2] is not None:
        for want, have in zip(clean[2], got[2]):
            assert torch.isfinite(have).all()
            torch.testing.assert_close(have, want, rtol=0, atol=1e-12)


def test_top_left_causal_with_fewer_queries_never_reads_later_keys():
    # the example: auto ran SDPA's is_causal over keys 4 and 5, which no query sees
    q = torch.randn(1, 1, 4, 8)
    k, v = torch.randn(1, 1, 6, 8), torch.randn(1, 1, 6, 8)
    k[..., 4:, :] = v[..., 4:, :] = float("nan")
    m = masks.causal(align="top_left")
    assert mh.explain_backend(q, k, v, m).backend == "sdpa"
    q.requires_grad_()
    k.requires_grad_()
    out = mh.attention(q, k, v, m)
    assert not out.isnan().any()
    dq, dk = torch.autograd.grad(out.sum(), (q, k))
    assert not dq.isnan().any() and not dk.isnan().any()
    assert torch.equal(dk[..., 4:, :], torch.zeros(1, 1, 2, 8))


@pytest.mark.parametrize("backend", ["auto", "reference", "sdpa", "tiled", "fused"])
@pytest.mark.parametrize("kind", ["none", "causal", "window", "lengths", "documents", "dense"])
@pytest.mark.parametrize("where", ["query", "key", "value"])
def test_non_finite_marks_exactly_the_rows_that_depend_on_it(backend, kind, where):
    b, h, length_q, length_k = 2, 2, 6, 6
    q, k, v = qkv(b, h, h, length_q, length_k, 4, seed=5)
    case = make_case(kind, b, h, length_q, length_k, seed=5)
    keep = case.keep.expand(b, h, length_q, length_k)
    bad_q, bad_k = 2, 3  # one query row, one key position (batch 0, head 1)
    t = {"query": q, "key": k, "value": v}[where].clone()
    t[0, 1, bad_q if where == "query" else bad_k, 1] = torch.nan
    args = {"query": (t, k, v), "key": (q, t, v), "value": (q, k, t)}[where]
    out = mh.attention(*args, case.mask, backend=backend)
    expect_bad = torch.zeros(b, h, length_q, dtype=torch.bool)
    if where == "query":
        expect_bad[0, 1, bad_q] = True
    else:
        expect_bad[0, 1] = keep[0, 1, :, bad_k]
    assert torch.equal(out.isnan().all(-1), expect_bad)
    assert not out[~expect_bad].isnan().any()
    want = mh.attention(q, k, v, case.mask, backend="reference")
    torch.testing.assert_close(out[~expect_bad], want[~expect_bad], rtol=0, atol=1e-12)


@pytest.mark.parametrize("backend", ["auto", "reference", "tiled", "fused"])
def test_nan_query_row_gives_nan_weights_for_that_row_only(backend):
    q, k, v = qkv(1, 2, 2, 5, 5, 4, seed=1)
    q[0, 0, 2, 0] = torch.nan
    _, w = mh.attention_with_weights(q, k, v, masks.causal(), backend=backend)
    assert w[0, 0, 2].isnan().all()
    assert not w[0, 0, [0, 1, 3, 4]].isnan().any() and not w[0, 1].isnan().any()


def test_corrupt_module_weights_give_nan_not_healthy_looking_output():
    mha = MultiHeadAttention(8, 2).eval()
    with torch.no_grad():
        mha.q_proj.weight[0, 0] = torch.nan
    out = mha(torch.randn(1, 4, 8))
    assert out.isnan().all()


def test_per_query_dense_mask_broadcast_over_keys():
    # a (1, 1, L, 1) mask: every key visible to the even queries, none to the odd ones;
    # tiled used to read key 0 only
    keep = torch.tensor([True, False] * 4).view(1, 1, 8, 1)
    q, k, v = qkv(1, 1, 1, 8, 8, 8, seed=2)
    want, want_w = naive_attention(q, k, v, keep)
    for backend in ("tiled", "reference", "sdpa", "fused", "auto"):
        got = mh.attention(q, k, v, masks.dense(keep), backend=backend)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    _, w = mh.attention_with_weights(q, k, v, masks.dense(keep))
    torch.testing.assert_close(w, want_w, rtol=0, atol=1e-12)
    mha = MultiHeadAttention(8, 2).double()
    x = torch.randn(1, 8, 8, dtype=torch.float64)
    _, w_mod = mha.run(x, mask=keep)
    assert torch.equal(w_mod[0, :, 1::2], torch.zeros(2, 4, 8))
    torch.testing.assert_close(
        w_mod[0, :, ::2].sum(-1), torch.ones(2, 4, dtype=torch.float64), rtol=0, atol=1e-12
    )


def _bias_truth(q, k, v, bias, keep=None):
    """float64 softmax(q k^T / sqrt(D) + bias) v of the same (rounded) inputs, with the float32
    bias as given: the bias rule says that is what every backend computes."""
    q, k, v = (t.detach().double() for t in (q, k, v))
    return naive_attention(q, k, v, keep, bias=bias.double())


@pytest.mark.parametrize(
    "dtype,value",
    [(torch.bfloat16, 32895.0), (torch.bfloat16, 32897.0), (torch.float16, 1e5)],
    ids=["bf16-32895", "bf16-32897", "fp16-1e5"],
)
def test_large_float32_bias_with_half_inputs(dtype, value):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=g).to(dtype) for _ in range(3))
    bias = torch.zeros(1, 1, 5, 5)
    bias[..., 0], bias[..., 1] = value, value - 1.5  # two keys compete 1.5 apart
    want, want_w = _bias_truth(q, k, v, bias)
    # outputs are rounded to the half dtype once and the kernels multiply the weights by V in
    # that dtype: up to 2 units of roundoff of the largest |v| per output
    tol = 2 * torch.finfo(dtype).eps * float(v.abs().max())
    for backend in ("reference", "sdpa", "tiled", "fused", "auto"):
        out = mh.attention(q, k, v, bias=bias, backend=backend)
        assert torch.isfinite(out).all(), backend
        assert (out.double() - want).abs().max() <= tol, backend
    for backend in ("reference", "tiled", "fused"):
        _, w = mh.attention_with_weights(q, k, v, bias=bias, backend=backend)
        assert torch.isfinite(w).all(), backend
        # one unit of half roundoff per weight, plus the float32 scores' own rounding: near
        # |score| = value a float32 ulp is value * 2^-23 and moves a weight w by at most
        # w (1 - w) <= 1/4 of that
        tol_w = torch.finfo(dtype).eps + 0.25 * value * torch.finfo(torch.float32).eps
        assert (w.double() - want_w).abs().max() <= tol_w, backend


def _extreme_bias_case(config: str, magnitude: float):
    """The two configurations of issue 17 item 15: (q, k, v, mask, keep, bias), bf16 inputs,
    a float32 bias uniform in [-magnitude, magnitude]."""
    g = torch.Generator().manual_seed(15)
    if config == "window":  # bottom-right window, L > S, D_v = 1, inputs (B, L, H, D) views
        length_q, length_k, d, d_v = 34, 14, 8, 1
        q, k, v = (
            torch.randn(2, n, 2, width, generator=g).bfloat16().transpose(1, 2)
            for n, width in ((length_q, d), (length_k, d), (length_k, d_v))
        )
        mask = masks.sliding_window(3)
        keep = make_case("window", 2, 2, length_q, length_k).keep
    else:  # causal & dense, L < S
        length_q, length_k, d = 88, 91, 8
        q, k, v = (torch.randn(1, 2, n, d, generator=g).bfloat16() for n in (88, 91, 91))
        dense = torch.rand(length_q, length_k, generator=g) < 0.5
        mask = masks.causal() & masks.dense(dense)
        keep = make_case("causal", 1, 2, length_q, length_k).keep & dense
    bias = (torch.rand(length_q, length_k, generator=g, dtype=torch.float64) * 2 - 1) * magnitude
    return q, k, v, mask, keep, bias.float()


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize(
    "magnitude", [1e30, 1e36, torch.finfo(torch.float32).max], ids=["1e30", "1e36", "f32max"]
)
@pytest.mark.parametrize("config", ["window", "causal&dense"])
def test_extreme_finite_bias_gives_hidden_keys_exactly_zero_weight(config, magnitude, grad):
    """Issue 17 item 15: with gradients on, the weights path summed every input (and the
    bias) to tie it into the graph; the sum overflowed to inf and inf * 0 made every output
    and weight NaN, hidden keys included."""
    q, k, v, mask, keep, bias = _extreme_bias_case(config, magnitude)
    q, k, v = (t.detach().requires_grad_(grad) for t in (q, k, v))
    want, want_w = _bias_truth(q, k, v, bias, keep)
    # biases of this size are ~1e29 apart, so both in float32 and in float64 each row that sees
    # a key puts weight exactly 1 on its largest-bias key: the weights are exact, and the
    # output is that key's value rounded once to bf16
    tol = 2 * torch.finfo(torch.bfloat16).eps * float(v.detach().abs().max())
    for backend in ("reference", "tiled", "auto"):
        out, w = mh.attention_with_weights(q, k, v, mask, bias=bias, backend=backend)
        assert torch.isfinite(out).all() and torch.isfinite(w).all(), backend
        assert torch.equal(w.double().masked_fill(keep, 0), torch.zeros_like(want_w)), backend
        assert torch.equal(w.double(), want_w), backend
        assert (out.double() - want).abs().max() <= tol, backend
        if grad:
            grads = torch.autograd.grad(out.float().sum() + w.float().sum(), (q, k, v))
            assert all(torch.isfinite(t).all() for t in grads), backend


def test_bias_is_kept_in_float32_on_every_backend():
    # 1.5 apart at 32768 is below bf16's spacing (256): rounding the bias to bf16 would make
    # the two keys tie (weights 0.5/0.5) instead of 0.82/0.18
    q = torch.zeros(1, 1, 1, 4, dtype=torch.bfloat16)
    k = torch.zeros(1, 1, 2, 4, dtype=torch.bfloat16)
    v = torch.tensor([[[[1.0] * 4, [0.0] * 4]]], dtype=torch.bfloat16)
    bias = torch.tensor([[[[32769.5, 32768.0]]]])
    expected = torch.sigmoid(torch.tensor(1.5)).item()  # 0.8176
    for backend in ("reference", "sdpa", "tiled", "fused"):
        out = mh.attention(q, k, v, bias=bias, backend=backend)
        assert abs(float(out[0, 0, 0, 0]) - expected) <= 4e-3, backend  # bf16 rounding of out
