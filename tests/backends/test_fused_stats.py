"""Attention statistics folded inside the fused kernel's pass (``multihead.attention_stats``
where the kernel is built): against float64 formulas over the weights, never through the
weights, bitwise reproducible, and handing inputs with NaN to the slice sweep."""

from __future__ import annotations

import pytest
import torch
from helpers import make_case, naive_attention, qkv

import multihead as mh
from multihead import bias as mb
from multihead import masks
from multihead.backends import fused, reduce

pytestmark = pytest.mark.skipif(
    fused.build_error() is not None, reason=f"fused kernel not built: {fused.build_error()}"
)

ALL = ["key_mass", "window_mass", "entropy", "head_mean"]


def _formulas(w: torch.Tensor, window: int) -> dict[str, torch.Tensor]:
    """The statistics from the weights (B, h, L, S), in float64."""
    return {
        "key_mass": w.sum(2),
        "window_mass": w[:, :, -window:].sum(2),
        "entropy": -torch.special.xlogy(w, w).sum(-1),
        "head_mean": w.mean(1),
    }


@pytest.fixture
def no_weights(monkeypatch):
    """The statistics must not come from the weights: the registry's sweep refuses."""

    def refuse(*args, **kwargs):
        raise AssertionError("the statistics went through the weights")

    monkeypatch.setattr(reduce, "sweep", refuse)


KINDS = ["none", "causal", "window_both", "lengths_per_query", "documents&causal", "dense"]


@pytest.mark.parametrize("length_q,length_k", [(1, 300), (150, 290), (300, 1100)])
@pytest.mark.parametrize("kind", KINDS)
def test_statistics_match_the_float64_formulas(kind, length_q, length_k, no_weights):
    """float32 inputs, chosen heads out of order, GQA and a dense bias; (300, 1100) has key
    blocks no row of a query block sees and items with spans of several key blocks."""
    b, h, h_kv, d = 2, 4, 2, 16
    q, k, v = qkv(b, h, h_kv, length_q, length_k, d, seed=3)
    case = make_case(kind, b, h, length_q, length_k, seed=3)
    bias = torch.randn(1, h, length_q, length_k, dtype=torch.float64)
    want_out, w = naive_attention(q, k, v, case.keep, bias=bias)
    heads, window = [3, 0, 2], 7
    lo = [t.float() for t in (q, k, v, bias)]
    for split in (ALL, ["key_mass", "entropy"], ["head_mean", "entropy"], ["entropy"]):
        out, got = mh.attention_stats(
            *lo[:3], case.mask, bias=lo[3], stats=split, window=7 if "window_mass" in split
            else None, heads=heads,
        )  # fmt: skip
        assert list(got) == split
        # float32: scores of |s| <= ~10 carry ~1e-6 relative error into exp; a key's mass sums
        # up to L of them
        assert (out.double() - want_out).abs().max() <= 2e-6
        want = _formulas(w[:, heads], window)
        for name in split:
            assert got[name].dtype == torch.float32
            scale = max(1.0, want[name].abs().max().item())
            assert (got[name].double() - want[name]).abs().max() <= 2e-6 * scale, name


def test_float64_bf16_softcap_sinks_and_relative_bias(no_weights):
    """float64 to 1e-12; bf16 inputs with float32 statistics from the unrounded weights (so
    closer to the formula on the same bf16 values than the bf16 weights themselves); a cap,
    sinks (the weights sum below 1) and ALiBi."""
    b, h, h_kv, length_q, length_k, d = 2, 4, 2, 70, 90, 16
    q, k, v = qkv(b, h, h_kv, length_q, length_k, d, seed=4)
    keep = make_case("causal", b, h, length_q, length_k).keep
    g = torch.Generator().manual_seed(4)
    logits = 2 * torch.randn(h, generator=g, dtype=torch.float64)
    slopes = torch.rand(h, generator=g, dtype=torch.float64)
    alibi = mb.alibi(slopes=slopes).to_dense(length_q, length_k, dtype=torch.float64)
    _, w = naive_attention(q, k, v, keep, bias=alibi, softcap=2.0, sinks=logits)
    want = _formulas(w, 4)
    modifier = mb.softcap(2.0) + mb.sinks(logits) + mb.alibi(slopes=slopes)
    _, got = mh.attention_stats(q, k, v, masks.causal(), bias=modifier, stats=ALL, window=4)
    for name in ALL:
        assert (got[name] - want[name]).abs().max() <= 1e-12 * max(1, want[name].abs().max())

    half = [t.to(torch.bfloat16) for t in (q, k, v)]
    modifier = mb.softcap(2.0) + mb.sinks(logits.float()) + mb.alibi(slopes=slopes.float())
    _, w = naive_attention(*[t.double() for t in half], keep, bias=alibi, softcap=2.0,
                           sinks=logits)  # fmt: skip
    want = _formulas(w, 4)
    _, got = mh.attention_stats(*half, masks.causal(), bias=modifier, stats=ALL, window=4)
    rounded = _formulas(
        mh.attention_with_weights(*half, masks.causal(), bias=modifier).weights.double(), 4
    )
    for name in ALL:
        assert got[name].dtype == torch.float32
        error = (got[name].double() - want[name]).abs().max()
        assert error <= 1e-5 * max(1, want[name].abs().max()), name
        assert error <= (rounded[name] - want[name]).abs().max(), name


@pytest.mark.parametrize("threads", [1, 2])
def test_bitwise_deterministic_for_a_thread_count(threads):
    """A key's sum is added to by one unit of work in a fixed order, whichever thread runs it."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q, k, v = qkv(2, 4, 2, 700, 700, 16, dtype=torch.float32)
        runs = [
            mh.attention_stats(q, k, v, masks.causal(), stats=ALL, window=50)[1] for _ in range(3)
        ]
        for name in ALL:
            assert torch.equal(runs[0][name], runs[1][name])
            assert torch.equal(runs[0][name], runs[2][name])
    finally:
        torch.set_num_threads(before)


def test_the_same_as_the_slice_sweep(monkeypatch):
    """The kernel's pass and the sweep through the weights (the path without the kernel) give
    the same statistics."""
    q, k, v = qkv(1, 4, 4, 130, 130, 8, dtype=torch.float32, seed=8)
    mask = masks.sliding_window(40)
    fast = mh.attention_stats(q, k, v, mask, stats=ALL, window=9, heads=[1, 2])
    monkeypatch.setattr(fused, "built", lambda: False)
    swept = mh.attention_stats(q, k, v, mask, stats=ALL, window=9, heads=[1, 2])
    torch.testing.assert_close(fast[0], swept[0], rtol=0, atol=1e-6)
    for name in ALL:
        torch.testing.assert_close(fast[1][name], swept[1][name], rtol=1e-5, atol=1e-6)


def test_nan_inputs_go_to_the_sweep_and_keep_the_nan_rule():
    """A NaN in a key that some rows see: those rows' statistics are NaN, the others' are
    finite, as the weights (NaN in a row whose output is NaN) give them."""
    q, k, v = qkv(1, 2, 2, 20, 20, 8, dtype=torch.float32, seed=2)
    k[0, 0, 10, 3] = float("nan")
    out, got = mh.attention_stats(q, k, v, masks.causal(), stats=["entropy"])
    entropy = got["entropy"]
    assert entropy[0, 0, 10:].isnan().all() and entropy[0, 0, :10].isfinite().all()
    assert entropy[0, 1].isfinite().all()
    assert out[0, 0, 10:].isnan().all()


def test_gradients_take_the_sweep():
    """The output of a call that needs gradients keeps them (the sweep's autograd path)."""
    q, k, v = qkv(1, 2, 2, 12, 12, 8, dtype=torch.float32, requires_grad=True)
    out, _ = mh.attention_stats(q, k, v, masks.causal(), stats=["key_mass"])
    out.sum().backward()
    assert q.grad is not None and q.grad.abs().sum() > 0
