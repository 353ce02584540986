"""The half-precision CPU kernel: the 2x rule for outputs and gradients, on every mask kind."""

from __future__ import annotations

import pytest
import torch
from helpers import MASK_KINDS, make_case, naive_attention, qkv

from multihead.backends import _half
from multihead.functional import _prepare


def _error(got, want):
    return (got.double() - want).abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_half_kernel_within_twice_naive_error(kind, dtype, monkeypatch):
    monkeypatch.setattr(_half, "ROWS", 16)  # several blocks per tile, cut anywhere
    b, h, h_kv, length_q, length_k, d = 2, 4, 2, 67, 131, 40
    q, k, v = qkv(b, h, h_kv, length_q, length_k, d, seed=3)
    case = make_case(kind, b, h, length_q, length_k, seed=3)
    grad_out = torch.randn(b, h, length_q, d, dtype=torch.float64)
    # float64 truth and its gradients
    q64, k64, v64 = (t.clone().requires_grad_() for t in (q, k, v))
    ref = naive_attention(q64, k64, v64, case.keep)[0]
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), grad_out)
    # the naive formula in the half dtype: its error sets the bound
    lo = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    naive = naive_attention(*lo, case.keep)[0]
    naive_grads = torch.autograd.grad(naive, lo, grad_out.to(dtype))
    # ours
    mine = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    call = _prepare(*mine, case.mask, None, None, 0.0, False)
    assert _half.unsupported(call) is None
    got = _half.run(call)
    grads = torch.autograd.grad(got, mine, grad_out.to(dtype))
    assert got.dtype == dtype
    ulp = torch.finfo(dtype).eps * ref.abs().max()
    assert _error(got, ref) <= 2 * _error(naive, ref) + ulp
    for g, n, r in zip(grads, naive_grads, ref_grads):
        assert _error(g, r) <= 2 * _error(n, r) + torch.finfo(dtype).eps * r.abs().max()


def test_half_kernel_says_what_it_cannot_run():
    q, k, v = qkv(1, 1, 1, 4, 4, 2, dtype=torch.float32)
    assert "bf16 or fp16" in _half.unsupported(_prepare(q, k, v, None, None, None, 0.0, False))
    q, k, v = (t.bfloat16() for t in (q, k, v))
    assert "dropout" in _half.unsupported(_prepare(q, k, v, None, None, None, 0.1, False))
    bias = torch.zeros(4, 4)
    assert "bias rule" in _half.unsupported(_prepare(q, k, v, None, bias, None, 0.0, False))


@pytest.mark.parametrize("native", [True, False])
def test_auto_uses_it_only_with_native_half_matmuls(monkeypatch, native):
    import multihead as mh
    from multihead import masks

    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: native)
    q, k, v = qkv(1, 2, 2, 8, 8, 4, dtype=torch.bfloat16)
    for mask in (None, masks.causal()):
        choice = mh.explain_backend(q, k, v, mask)
        assert choice.backend == ("tiled" if native else "sdpa")
        if native:
            assert "half-precision kernel runs the matmuls in bf16/fp16" in choice.reasons["sdpa"]
    # weights and biases stay on the float32 paths
    assert mh.explain_backend(q, k, v, return_weights=True).backend == "tiled"
    assert not _half.fast(_prepare(q, k, v, None, torch.zeros(8, 8), None, 0.0, False))
