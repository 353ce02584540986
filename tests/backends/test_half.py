"""The half-precision CPU kernel: the 2x rule for outputs and gradients, on every mask kind."""

from __future__ import annotations

import pytest
import torch
from helpers import MASK_KINDS, make_case, qkv, twice_naive_errors

from multihead.backends import half, registry
from multihead.backends.call import prepare


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
        assert half.BACKEND.why_not(call) is None
        out = half.run(call)[0]
        assert out.dtype == dtype
        return out

    for name, error, bound in twice_naive_errors(run, q, k, v, case.keep, grad_out):
        assert error <= bound, name


def test_half_kernel_says_what_it_cannot_run():
    q, k, v = qkv(1, 1, 1, 4, 4, 2, dtype=torch.float32)
    why = half.BACKEND.why_not(prepare(q, k, v, None, None, None, 0.0, False))
    assert "takes bfloat16 or float16; received torch.float32" in why
    q, k, v = (t.bfloat16() for t in (q, k, v))
    assert "dropout" in half.BACKEND.why_not(prepare(q, k, v, None, None, None, 0.1, False))
    bias = torch.zeros(4, 4)
    assert "bias rule" in half.BACKEND.why_not(prepare(q, k, v, None, bias, None, 0.0, False))


@pytest.fixture
def measuring(monkeypatch):
    """auto's measurement of the half kernel turned on, with a clock that returns the times the
    test appends (the half kernel's, then its rival's) after running what it times."""
    monkeypatch.setenv("MULTIHEAD_HALF_AUTO", "1")
    monkeypatch.setattr(half, "_MEASURED", {})
    monkeypatch.setattr(registry, "_CHOICES", {})  # auto's remembered choices: none yet
    times: list[float] = []
    monkeypatch.setattr(half, "_best_time", lambda fn, repeats=3: (fn(), times.pop(0))[1])
    return times


@pytest.mark.parametrize("native", [True, False])
def test_auto_runs_it_only_where_it_measured_faster(monkeypatch, measuring, native):
    """Before, auto ran it wherever the CPU had native bf16 matmuls: on an Intel Xeon with
    AVX512-BF16 and no AMX that was 0.77x SDPA."""
    import multihead as mh
    from multihead import masks

    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: native)
    q, k, v = qkv(1, 2, 2, 8, 8, 4, dtype=torch.bfloat16)
    if native:  # explain_backend times nothing: the class is not timed yet
        untimed = mh.explain_backend(q, k, v)
        assert untimed.backend == "sdpa" and "not been timed yet" in untimed.reasons["half"]
        measuring += [1.0, 2.0]  # half, then sdpa (auto's choice without it): half leads
    mh.attention(q, k, v)  # the first call of the class times it
    choice = mh.explain_backend(q, k, v)
    assert choice.backend == ("half" if native else "sdpa")
    if native:
        assert "measured faster than sdpa on this machine" in choice.reasons["sdpa"]
        mh.attention(q, k, v)
        assert mh.explain_backend(q, k, v).backend == "half"  # remembered: not measured again
        measuring += [1.95, 2.0]  # causal is another class; 2.5% faster is noise
    mh.attention(q, k, v, masks.causal())
    causal = mh.explain_backend(q, k, v, masks.causal())
    assert causal.backend == "sdpa"
    if native:
        assert "did not measure faster than sdpa" in causal.reasons["half"]
    assert measuring == []  # without native matmuls nothing is measured
    # weights and biases stay on the float32 paths, unmeasured
    assert mh.explain_backend(q, k, v, weights=True).backend == "tiled"
    assert not half.fast(prepare(q, k, v, None, torch.zeros(8, 8), None, 0.0, False))


def test_auto_measures_nothing_when_turned_off(monkeypatch, measuring):
    import multihead as mh

    monkeypatch.setenv("MULTIHEAD_HALF_AUTO", "0")
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    q, k, v = qkv(1, 2, 2, 8, 8, 4, dtype=torch.bfloat16)
    assert mh.explain_backend(q, k, v).backend == "sdpa"
    assert half._MEASURED == {}


def test_the_measurement_times_the_real_backends(monkeypatch):
    """The real clock on a real call: the answer is a bool kept under the call's shape class,
    and the choice follows it."""
    import multihead as mh
    from multihead.backends import _measure

    monkeypatch.setenv("MULTIHEAD_HALF_AUTO", "1")
    monkeypatch.setattr(half, "_MEASURED", {})
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    monkeypatch.setattr(registry, "_CHOICES", {})
    q, k, v = qkv(1, 2, 2, 16, 16, 8, dtype=torch.bfloat16)
    mh.attention(q, k, v)
    chosen = mh.explain_backend(q, k, v).backend
    call = prepare(q, k, v, None, None, None, 0.0, False)
    (answer,) = half._MEASURED.values()
    assert list(half._MEASURED) == [_measure.shape_class(call)]
    assert chosen == ("half" if answer else "sdpa")
