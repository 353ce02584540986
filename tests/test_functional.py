"""attention() on every backend and mask kind, against the naive formula and the fp64 reference."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import MASK_KINDS, make_case, naive_attention, qkv

import multihead as mh
from multihead import masks

BACKENDS = ["reference", "sdpa", "tiled", "fused"]
# (B, H, H_kv, L, S, D, D_v)
SMALL = [(2, 4, 2, 7, 5, 6, 6), (2, 2, 2, 5, 9, 3, 4), (1, 3, 1, 6, 6, 5, 5)]
ODD = [(2, 4, 2, 113, 203, 59, 59), (1, 2, 1, 203, 113, 59, 33)]


def _ids(shapes):
    return ["B{}H{}Hkv{}-L{}S{}-D{}Dv{}".format(*s) for s in shapes]


def _run(backend, q, k, v, mask, **kw):
    return mh.attention(q, k, v, mask, backend=backend, **kw)


@pytest.mark.parametrize("shape", SMALL, ids=_ids(SMALL))
@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_float64_matches_naive_formula(backend, kind, shape):
    b, h, h_kv, length_q, length_k, d, d_v = shape
    q, k, v = qkv(b, h, h_kv, length_q, length_k, d, d_v)
    case = make_case(kind, b, h, length_q, length_k)
    want, want_w = naive_attention(q, k, v, case.keep)
    got = _run(backend, q, k, v, case.mask)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    if backend == "reference":
        _, w = mh.attention_with_weights(q, k, v, case.mask, backend=backend)
        torch.testing.assert_close(w, want_w, rtol=0, atol=1e-12)


@pytest.mark.parametrize("shape", ODD, ids=_ids(ODD))
@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_float32_against_float64_reference(backend, kind, shape):
    """The fp32 rule (docs/design.md, "Error rules"): max error vs the fp64 reference <= 1e-5
    (outputs), 1e-4 (gradients)."""
    b, h, h_kv, length_q, length_k, d, d_v = shape
    q, k, v = qkv(b, h, h_kv, length_q, length_k, d, d_v, requires_grad=True)
    case = make_case(kind, b, h, length_q, length_k)
    ref = mh.attention(q, k, v, case.mask, backend="reference")
    grad_out = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad_out)

    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    got = _run(backend, q32, k32, v32, case.mask)
    grads = torch.autograd.grad(got, (q32, k32, v32), grad_out.float())
    assert (got.double() - ref).abs().max() <= 1e-5
    for g, r in zip(grads, ref_grads):
        assert (g.double() - r).abs().max() <= 1e-4


@pytest.mark.parametrize("kind", ["none", "causal", "window_both", "lengths", "documents&causal"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_within_twice_naive_error(backend, kind, dtype):
    """FlashAttention's rule: error <= 2x the naive formula's error in the same dtype (+ 1 ulp)."""
    b, h, h_kv, length_q, length_k, d = 2, 4, 2, 67, 131, 40
    q, k, v = qkv(b, h, h_kv, length_q, length_k, d)
    case = make_case(kind, b, h, length_q, length_k)
    ref, _ = naive_attention(q, k, v, case.keep)
    lo = [t.to(dtype) for t in (q, k, v)]
    naive_err = (naive_attention(*lo, case.keep)[0].double() - ref).abs().max()
    got = _run(backend, *lo, case.mask)
    assert got.dtype == dtype
    ulp = torch.finfo(dtype).eps * ref.abs().max()
    assert (got.double() - ref).abs().max() <= 2 * naive_err + ulp


@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_gradcheck_float64(backend, kind):
    b, h, h_kv, length_q, length_k, d = 2, 2, 1, 4, 5, 3
    q, k, v = qkv(b, h, h_kv, length_q, length_k, d, requires_grad=True, seed=3)
    mask = make_case(kind, b, h, length_q, length_k, seed=3).mask
    bias = torch.randn(length_q, length_k, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda q, k, v, bias: _run(backend, q, k, v, mask, bias=bias), (q, k, v, bias)
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fully_masked_rows_are_exact_zeros_with_zero_gradients(backend, dtype):
    b, h, length_q, length_k, d = 2, 2, 6, 4, 8
    q, k, v = qkv(b, h, h, length_q, length_k, d, dtype=dtype, requires_grad=True)
    mask = masks.causal() & masks.lengths(torch.tensor([4, 0]))  # rows 0, 1 and batch 1 see nothing
    out = _run(backend, q, k, v, mask)
    out.sum().backward()
    dead_rows = [(0, slice(0, 2)), (1, slice(None))]
    for bi, rows in dead_rows:
        assert torch.equal(out[bi, :, rows], torch.zeros_like(out[bi, :, rows]))
        assert torch.equal(q.grad[bi, :, rows], torch.zeros_like(q.grad[bi, :, rows]))
    assert torch.equal(k.grad[1], torch.zeros_like(k.grad[1]))
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert (out[0, :, 2:] != 0).any()


def test_fully_masked_rows_give_zero_weights():
    q, k, v = qkv(1, 2, 2, 3, 4, 5)
    keep = torch.tensor([[True, False, True, False], [False] * 4, [True] * 4])
    _, w = mh.attention_with_weights(q, k, v, keep)
    assert torch.equal(w[0, :, 1], torch.zeros(2, 4, dtype=w.dtype))
    torch.testing.assert_close(w[0, :, [0, 2]].sum(-1), torch.ones(2, 2, dtype=w.dtype))
    assert torch.equal(w[0, :, 0, [1, 3]], torch.zeros(2, 2, dtype=w.dtype))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("length_q,length_k", [(0, 5), (4, 0), (0, 0)])
def test_empty_lengths(backend, length_q, length_k):
    q, k, v = qkv(2, 2, 2, length_q, length_k, 3, 4, requires_grad=True)
    out = _run(backend, q, k, v, masks.causal())
    assert out.shape == (2, 2, length_q, 4)
    assert torch.equal(out, torch.zeros_like(out))
    if out.numel():
        out.sum().backward()
        assert torch.equal(q.grad, torch.zeros_like(q))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["lengths", "key_padding"])
def test_keys_nobody_sees_may_hold_nan(backend, kind):
    b, h, length_q, length_k, d = 3, 2, 5, 8, 4
    q, k, v = qkv(b, h, h, length_q, length_k, d)
    case = make_case(kind, b, h, length_q, length_k)
    clean = _run(backend, q, k, v, case.mask)
    dead = ~case.keep.expand(b, h, length_q, length_k).any(dim=2)  # [B, H, S]
    assert dead.any()
    k2 = k.masked_fill(dead[..., None], torch.nan)
    v2 = v.masked_fill(dead[..., None], torch.inf)
    dirty = _run(backend, q, k2, v2, case.mask)
    torch.testing.assert_close(dirty, clean, rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bias_is_added_to_scores(backend):
    b, h, length_q, length_k, d = 2, 3, 5, 6, 4
    q, k, v = qkv(b, h, h, length_q, length_k, d)
    bias = torch.randn(b, h, length_q, length_k, dtype=torch.float64)
    case = make_case("window_both", b, h, length_q, length_k)
    want, _ = naive_attention(q, k, v, case.keep, bias=bias)
    torch.testing.assert_close(_run(backend, q, k, v, case.mask, bias=bias), want)
    want_nomask, _ = naive_attention(q, k, v, bias=bias[:1, :1])
    torch.testing.assert_close(_run(backend, q, k, v, None, bias=bias[:1, :1]), want_nomask)


@pytest.mark.parametrize("backend", BACKENDS)
def test_default_scale_is_inverse_sqrt_of_head_dim(backend):
    q, k, v = qkv(1, 1, 1, 4, 4, 16)
    want, _ = naive_attention(q, k, v, scale=1 / math.sqrt(16))
    wrong, _ = naive_attention(q, k, v, scale=1 / 16)
    got = _run(backend, q, k, v, None)
    torch.testing.assert_close(got, want)
    assert (got - wrong).abs().max() > 1e-3
    torch.testing.assert_close(
        _run(backend, q, k, v, None, scale=0.3), naive_attention(q, k, v, scale=0.3)[0]
    )


@pytest.mark.parametrize("backend", ["reference", "tiled"])
def test_dropout_is_unbiased_and_off_at_zero(backend):
    q, k, v = qkv(1, 1, 1, 3, 4, 2)
    exact = mh.attention(q, k, v)
    torch.manual_seed(0)
    draws = torch.stack(
        [mh.attention(q, k, v, dropout_p=0.5, backend="reference") for _ in range(4000)]
    )
    assert not torch.equal(draws[0], exact)
    # the mean of 4000 draws is within a few standard errors of the exact output
    stderr = draws.std(dim=0) / math.sqrt(draws.shape[0])
    assert ((draws.mean(dim=0) - exact).abs() <= 5 * stderr + 1e-12).all()
    torch.testing.assert_close(mh.attention(q, k, v, dropout_p=0.0, backend="sdpa"), exact)


def test_weights_are_returned_from_auto_and_match_reference():
    q, k, v = qkv(2, 4, 2, 9, 11, 8)
    case = make_case("documents&causal", 2, 4, 9, 11)
    out, w = mh.attention_with_weights(q, k, v, case.mask)
    _, want_w = naive_attention(q, k, v, case.keep)
    torch.testing.assert_close(w, want_w)
    torch.testing.assert_close(out, mh.attention(q, k, v, case.mask))


def test_bool_tensor_mask_is_dense_mask():
    q, k, v = qkv(1, 2, 2, 4, 4, 3)
    keep = torch.rand(4, 4, generator=torch.Generator().manual_seed(1)) > 0.3
    torch.testing.assert_close(
        mh.attention(q, k, v, keep), mh.attention(q, k, v, masks.dense(keep))
    )


def test_mask_on_cpu_works_for_inputs_on_same_device_and_noncontiguous_inputs():
    q, k, v = qkv(2, 3, 3, 5, 7, 4)
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # same values, other strides
    assert not qt.is_contiguous()
    case = make_case("causal&lengths", 2, 3, 5, 7)
    for backend in BACKENDS:
        torch.testing.assert_close(
            _run(backend, qt, k, v, case.mask), _run(backend, q, k, v, case.mask), rtol=0, atol=0
        )
