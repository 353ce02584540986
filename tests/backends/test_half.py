"""The half-precision CPU kernel: the 2x rule for outputs and gradients, on every mask kind."""

from __future__ import annotations

import pytest
import torch
from helpers import MASK_KINDS, make_case, qkv, twice_naive_errors

from multihead.backends import half
from multihead.backends._call import prepare


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_half_kernel_within_twice_naive_error(kind, dtype, monkeypatch):
    monkeypatch.setattr(half, "ROWS", 16)  # several blocks per tile, cut anywhere
    b, h, h_kv, length_q, length_k, d = 2, 4, 2, 67, 131, 40
    q, k, v = qkv(b, h, h_kv, length_q, length_k, d, dtype=dtype, seed=3)
    case = make_case(kind, b, h, length_q, length_k, seed=3)
    grad_out = torch.randn(b, h, length_q, d, dtype=torch.float64)

    def run(q, k, v):
        call = prepare(q, k, v, case.mask, None, None, 0.0, False)
        assert half.unsupported(call) is None
        out = half.run(call)[0]
        assert out.dtype == dtype
        return out

    for name, error, bound in twice_naive_errors(run, q, k, v, case.keep, grad_out):
        assert error <= bound, name


def test_half_kernel_says_what_it_cannot_run():
    q, k, v = qkv(1, 1, 1, 4, 4, 2, dtype=torch.float32)
    why = half.unsupported(prepare(q, k, v, None, None, None, 0.0, False))
    assert "takes bfloat16 or float16; received torch.float32" in why
    q, k, v = (t.bfloat16() for t in (q, k, v))
    assert "dropout" in half.unsupported(prepare(q, k, v, None, None, None, 0.1, False))
    bias = torch.zeros(4, 4)
    assert "bias rule" in half.unsupported(prepare(q, k, v, None, bias, None, 0.0, False))


@pytest.mark.parametrize("native", [True, False])
def test_auto_uses_it_only_with_native_half_matmuls(monkeypatch, native):
    import multihead as mh
    from multihead import masks

    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: native)
    q, k, v = qkv(1, 2, 2, 8, 8, 4, dtype=torch.bfloat16)
    for mask in (None, masks.causal()):
        choice = mh.explain_backend(q, k, v, mask)
        assert choice.backend == ("half" if native else "sdpa")
        if native:
            assert "half-precision kernel runs the matmuls in bf16/fp16" in choice.reasons["sdpa"]
    # weights and biases stay on the float32 paths
    assert mh.explain_backend(q, k, v, weights=True).backend == "tiled"
    assert not half.fast(prepare(q, k, v, None, torch.zeros(8, 8), None, 0.0, False))
