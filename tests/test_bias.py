"""Score modifiers: ALiBi and T5 buckets against their papers and transformers, on every backend."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import MASK_KINDS, make_case, naive_attention, qkv

import multihead as mh
from multihead import bias as mb
from multihead import masks
from multihead.backends import tiled

BACKENDS = ["reference", "sdpa", "tiled", "fused"]


def _alibi_by_formula(slopes: list[float], length_q: int, length_k: int) -> torch.Tensor:
    """-m_h (i' - j) with i' = i + S - L, written out in float64 (Press et al. 2022)."""
    out = torch.empty(1, len(slopes), length_q, length_k, dtype=torch.float64)
    for h, m in enumerate(slopes):
        for i in range(length_q):
            for j in range(length_k):
                out[0, h, i, j] = -m * (i + length_k - length_q - j)
    return out


def test_alibi_slopes_follow_the_paper():
    # H = 8: the geometric sequence 1/2, 1/4, ..., 1/256 (section 3 of the paper)
    assert mb.alibi_slopes(8).tolist() == [2.0**-i for i in range(1, 9)]
    # H = 12: the 8 slopes of H = 8, then slopes 1, 3, 5, 7 of H = 16 (2^(-k/2)):
    # 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5
    want = [2.0**-i for i in range(1, 9)] + [2.0 ** -(k / 2) for k in (1, 3, 5, 7)]
    assert mb.alibi_slopes(12).tolist() == pytest.approx(want, rel=1e-15)


@pytest.mark.parametrize("heads", [1, 4, 6, 12, 16])
def test_alibi_slopes_equal_bloom(heads):
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    # BLOOM's alibi for an all-ones mask is slope * key position, one row per (batch, head)
    bloom = build_alibi_tensor(torch.ones(1, 3), heads, torch.float64)[:, 0, 1]
    # BLOOM computes its slopes in float32 as base ** k: the base 2^(-8/m) is rounded (relative
    # error eps / 2), the power k <= H multiplies that error by k, and the result is rounded
    rtol = (heads / 2 + 1) * torch.finfo(torch.float32).eps
    torch.testing.assert_close(mb.alibi_slopes(heads), bloom, rtol=rtol, atol=0)


@pytest.mark.parametrize("shape", [(5, 5), (3, 7)], ids=["L=S", "L<S"])
def test_alibi_values_equal_the_formula(shape):
    length_q, length_k = shape
    slopes = mb.alibi_slopes(4)
    got = mb.alibi(slopes=slopes).to_dense(length_q, length_k, dtype=torch.float64)
    want = _alibi_by_formula(slopes.tolist(), length_q, length_k)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    both = mb.alibi(slopes=slopes, bidirectional=True).to_dense(3, 3, dtype=torch.float64)
    assert both[0, 1, 0, 2] == both[0, 1, 2, 0] == -2 * slopes[1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_causal_alibi_attention_equals_bloom(backend):
    """BLOOM adds slope * j and relies on softmax ignoring a per-row constant: the outputs of
    a causal model must be identical to ours, which adds slope * (j - i)."""
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    b, h, length = 2, 4, 37
    q, k, v = qkv(b, h, h, length, length, 8, seed=1)
    alibi = build_alibi_tensor(torch.ones(b, length), h, torch.float64).view(b, h, 1, length)
    keep = torch.ones(length, length, dtype=torch.bool).tril()
    want, _ = naive_attention(q, k, v, keep, bias=alibi)
    got = mh.attention(q, k, v, masks.causal(), bias=mb.alibi(h), backend=backend)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def _t5_layer(table: torch.Tensor, decoder: bool, max_distance: int):
    from transformers import T5Config
    from transformers.models.t5.modeling_t5 import T5Attention

    buckets, heads = table.shape
    config = T5Config(
        d_model=heads * 4,
        d_kv=4,
        num_heads=heads,
        relative_attention_num_buckets=buckets,
        relative_attention_max_distance=max_distance,
        is_decoder=decoder,
    )
    layer = T5Attention(config, has_relative_attention_bias=True).double()
    with torch.no_grad():
        layer.relative_attention_bias.weight.copy_(table)
    return layer


@pytest.mark.parametrize(
    "buckets,max_distance,bidirectional",
    [(32, 128, True), (32, 128, False), (8, 20, True), (16, 40, False)],
)
@pytest.mark.parametrize("shape", [(300, 300), (5, 260), (1, 140)], ids=["L=S", "L<S", "step"])
def test_relative_buckets_equal_t5_compute_bias(buckets, max_distance, bidirectional, shape):
    length_q, length_k = shape
    table = torch.randn(buckets, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    layer = _t5_layer(table, decoder=not bidirectional, max_distance=max_distance)
    modifier = mb.relative_buckets(table, bidirectional=bidirectional, max_distance=max_distance)
    # bottom-right alignment is T5 decoding with a cache: the queries are the last L positions
    want = layer.compute_bias(length_q, length_k, past_seen_tokens=length_k - length_q)
    got = modifier.to_dense(length_q, length_k, dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    top_left = mb.relative_buckets(
        table, bidirectional=bidirectional, max_distance=max_distance, align="top_left"
    )
    torch.testing.assert_close(
        top_left.to_dense(length_q, length_k, dtype=torch.float64),
        layer.compute_bias(length_q, length_k),
        rtol=0,
        atol=0,
    )


def _modifiers(h: int, length_q: int, length_k: int, *, grad: bool = False):
    g = torch.Generator().manual_seed(7)
    table = torch.randn(8, h, dtype=torch.float64, generator=g).requires_grad_(grad)
    slopes = torch.rand(h, dtype=torch.float64, generator=g).requires_grad_(grad)
    extra = torch.randn(length_q, length_k, dtype=torch.float64, generator=g).requires_grad_(grad)
    return {
        "alibi": (mb.alibi(slopes=slopes), (slopes,)),
        "alibi_bidirectional": (mb.alibi(slopes=slopes, bidirectional=True), (slopes,)),
        "t5": (mb.relative_buckets(table, max_distance=6), (table,)),
        "t5_decoder": (mb.relative_buckets(table, bidirectional=False, max_distance=6), (table,)),
        "sum": (
            mb.relative_buckets(table, max_distance=6) + mb.alibi(slopes=slopes) + extra,
            (table, slopes, extra),
        ),
    }


MODIFIERS = list(_modifiers(2, 1, 1))


@pytest.mark.parametrize("kind", ["none", "causal", "window_both", "lengths", "documents"])
@pytest.mark.parametrize("name", MODIFIERS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_computes_every_modifier(backend, name, kind):
    b, h, length_q, length_k = 2, 2, 23, 29
    q, k, v = qkv(b, h, h, length_q, length_k, 5, seed=2)
    modifier, _ = _modifiers(h, length_q, length_k)[name]
    case = make_case(kind, b, h, length_q, length_k, seed=2)
    dense = modifier.to_dense(length_q, length_k, dtype=torch.float64)
    want, want_w = naive_attention(q, k, v, case.keep, bias=dense)
    got = mh.attention(q, k, v, case.mask, bias=modifier, backend=backend)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    if backend != "sdpa":
        _, w = mh.attention_with_weights(q, k, v, case.mask, bias=modifier, backend=backend)
        torch.testing.assert_close(w, want_w, rtol=0, atol=1e-12)


@pytest.mark.parametrize("kind", ["none", "causal", "window_both", "lengths"])
@pytest.mark.parametrize("name", MODIFIERS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_gradcheck_every_backend_with_every_modifier(backend, name, kind):
    b, h, length_q, length_k = 2, 2, 4, 6
    q, k, v = qkv(b, h, 1, length_q, length_k, 3, seed=4, requires_grad=True)
    mask = make_case(kind, b, h, length_q, length_k, seed=4).mask
    build = {"alibi": 0, "alibi_bidirectional": 0, "t5": 0, "t5_decoder": 0, "sum": 0}
    assert name in build
    _, tensors = _modifiers(h, length_q, length_k, grad=True)[name]

    def f(q, k, v, *tensors):
        modifier = _rebuild(name, tensors)
        return mh.attention(q, k, v, mask, bias=modifier, backend=backend)

    assert torch.autograd.gradcheck(f, (q, k, v, *tensors))


def _rebuild(name, tensors):
    if name == "alibi":
        return mb.alibi(slopes=tensors[0])
    if name == "alibi_bidirectional":
        return mb.alibi(slopes=tensors[0], bidirectional=True)
    if name == "t5":
        return mb.relative_buckets(tensors[0], max_distance=6)
    if name == "t5_decoder":
        return mb.relative_buckets(tensors[0], bidirectional=False, max_distance=6)
    table, slopes, extra = tensors
    return mb.relative_buckets(table, max_distance=6) + mb.alibi(slopes=slopes) + extra


def test_t5_table_learns_through_the_tiled_kernel():
    q, k, v = qkv(1, 2, 2, 40, 40, 4, seed=5)
    table = torch.zeros(32, 2, dtype=torch.float64, requires_grad=True)
    modifier = mb.relative_buckets(table)
    assert mh.explain_backend(q, k, v, masks.causal(), bias=modifier).backend == "tiled"
    loss = mh.attention(q, k, v, masks.causal(), bias=modifier).square().sum()
    (got,) = torch.autograd.grad(loss, table)
    dense = modifier.to_dense(40, 40, dtype=torch.float64)
    keep = torch.ones(40, 40, dtype=torch.bool).tril()
    (want,) = torch.autograd.grad(
        naive_attention(q, k, v, keep, bias=dense)[0].square().sum(), table
    )
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert got.abs().sum() > 0


@pytest.mark.parametrize("kind", MASK_KINDS)
def test_modifiers_at_tile_edges(monkeypatch, kind):
    """Small odd tiles cut the strided bias views and triangles at every place."""
    from multihead.backends import _plan

    monkeypatch.setattr(_plan, "query_tile", lambda call: 5)
    monkeypatch.setattr(_plan, "_MIN_FULL_RUN", 2)
    b, h, length_q, length_k = 2, 2, 19, 23
    q, k, v = qkv(b, h, h, length_q, length_k, 4, seed=6)
    case = make_case(kind, b, h, length_q, length_k, seed=6)
    modifier = mb.alibi(h) + mb.relative_buckets(
        torch.randn(8, h, dtype=torch.float64), max_distance=9
    )
    dense = modifier.to_dense(length_q, length_k, dtype=torch.float64)
    got = mh.attention(q, k, v, case.mask, bias=modifier, backend="tiled")
    torch.testing.assert_close(
        got, naive_attention(q, k, v, case.keep, bias=dense)[0], rtol=0, atol=1e-12
    )


def test_modifier_on_a_length_whose_dense_bias_would_not_fit(monkeypatch):
    """L = S = 32768: a dense (L, S) float32 bias is 4 GiB. Any bias or mask block above 2^20
    entries fails the test, so the kernel must never build one."""
    length = 32768
    biggest = []

    def guard(original):
        def block(self, length_q, length_k, q0, q1, k0, k1, **kw):
            biggest.append((q1 - q0) * (k1 - k0))
            if (q1 - q0) * (k1 - k0) > 2**20:
                raise AssertionError(f"block of {q1 - q0} x {k1 - k0} requested")
            return original(self, length_q, length_k, q0, q1, k0, k1, **kw)

        return block

    monkeypatch.setattr(mb._Relative, "block", guard(mb._Relative.block))
    band = type(masks.sliding_window(1))
    monkeypatch.setattr(band, "block", guard(band.block))
    q, k, v = qkv(1, 2, 2, length, length, 4, dtype=torch.float32, seed=8)
    out = mh.attention(q, k, v, masks.sliding_window(200), bias=mb.alibi(2), backend="tiled")
    assert biggest and max(biggest) <= 2**20
    slopes = mb.alibi_slopes(2)
    for i in (0, 1000, length - 1):
        lo = max(0, i - 200)
        rel = torch.arange(lo, i + 1, dtype=torch.float64) - i
        bias = (slopes[:, None] * rel)[None, :, None, :]
        want, _ = naive_attention(
            q[:, :, i : i + 1].double(),
            k[:, :, lo : i + 1].double(),
            v[:, :, lo : i + 1].double(),
            bias=bias,
        )
        # float32 kernel against float64: the 1e-5 output rule
        assert (out[:, :, i : i + 1].double() - want).abs().max() <= 1e-5


@pytest.mark.parametrize("name", MODIFIERS)
def test_score_mod_agrees_with_the_dense_values(name):
    modifier, _ = _modifiers(2, 5, 7)[name]
    dense = modifier.to_dense(5, 7, dtype=torch.float64).expand(1, 2, 5, 7)
    b, h, i, j = torch.meshgrid(
        torch.arange(1), torch.arange(2), torch.arange(5), torch.arange(7), indexing="ij"
    )
    scores = torch.zeros(1, 2, 5, 7, dtype=torch.float64)
    torch.testing.assert_close(modifier.score_mod(5, 7)(scores, b, h, i, j), dense, rtol=0, atol=0)


def test_diagonals_are_the_values_along_each_distance():
    modifier = mb.relative_buckets(torch.randn(8, 3, dtype=torch.float64), max_distance=10)
    dense = modifier.to_dense(6, 9, dtype=torch.float64)[0]
    table = modifier.diagonals(6, 9, -8, 9, dtype=torch.float64)  # d = j - (i + 3)
    for i in range(6):
        for j in range(9):
            torch.testing.assert_close(dense[:, i, j], table[:, j - i - 3 + 8], rtol=0, atol=0)


def test_modifiers_add_with_each_other_and_tensors():
    extra = torch.randn(4, 6, dtype=torch.float64)
    a = mb.alibi(2)
    for total in (a + extra, extra + a):
        torch.testing.assert_close(
            total.to_dense(4, 6, dtype=torch.float64),
            a.to_dense(4, 6, dtype=torch.float64) + extra,
            rtol=0,
            atol=0,
        )
    assert "alibi(2 heads" in repr(a + extra) and "tensor bias of shape (1, 1, 4, 6)" in repr(
        a + extra
    )


def test_adding_none_adds_no_bias():
    """None is "no bias" wherever a bias is taken; adding it once raised AttributeError."""
    a = mb.alibi(2)
    assert a + None is a and None + a is a
    q, k, v = qkv(1, 2, 2, 5, 5, 4, seed=3)
    keep = torch.ones(5, 5, dtype=torch.bool).tril()
    slopes = torch.tensor([2.0**-4, 2.0**-8], dtype=torch.float64)  # ALiBi's for H=2
    distance = (torch.arange(5)[:, None] - torch.arange(5)).double()  # i - j
    torch.testing.assert_close(
        mh.attention(q, k, v, masks.causal(), bias=None + a + None),
        naive_attention(q, k, v, keep, bias=-slopes[:, None, None] * distance)[0],
        rtol=0,
        atol=1e-12,  # float64 both ways: only the order of the sums differs
    )


def test_chosen_heads_select_the_modifiers_heads():
    q, k, v = qkv(1, 4, 2, 6, 6, 3, seed=9)
    modifier = mb.alibi(4) + mb.relative_buckets(
        torch.randn(8, 4, dtype=torch.float64), max_distance=9
    )
    full = mh.attention_with_weights(q, k, v, masks.causal(), bias=modifier).weights
    part = mh.attention_with_weights(q, k, v, masks.causal(), bias=modifier, heads=[3, 1]).weights
    torch.testing.assert_close(part, full[:, [3, 1]], rtol=0, atol=1e-12)


@pytest.mark.parametrize("mask", [None, masks.causal(), masks.lengths(torch.tensor([600]))])
def test_strided_view_is_used_and_never_copied(monkeypatch, mask):
    """Chunks with ALiBi run on views of one (H, rows + cols - 1) table per chunk."""
    sizes = []
    original = tiled._Ctx.table_view

    def spy(self, item, chunk, *, band):
        view = original(self, item, chunk, band=band)
        sizes.append(view.untyped_storage().nbytes() // view.element_size())
        return view

    monkeypatch.setattr(tiled._Ctx, "table_view", spy)
    q, k, v = qkv(1, 2, 2, 600, 600, 4, dtype=torch.float32)
    mh.attention(q, k, v, mask, bias=mb.alibi(2))
    assert sizes and max(sizes) <= 2 * (600 + 600)  # H x (rows + cols - 1), not rows x cols


def test_band_masks_with_a_relative_bias_run_one_call_per_tile(monkeypatch):
    calls = []
    original = tiled._chunk_forward

    def spy(ctx, q, k, v, add, index, pattern, flash):
        calls.append((q.shape[2], k.shape[2], pattern))
        return original(ctx, q, k, v, add, index, pattern, flash)

    monkeypatch.setattr(tiled, "_chunk_forward", spy)
    q, k, v = qkv(1, 2, 2, 3000, 3000, 4, dtype=torch.float32)
    mh.attention(q, k, v, masks.causal(), bias=mb.alibi(2))
    # 1024-row tiles, each against every key up to its last row, bias and mask in one table
    assert calls == [(1024, 1024, "table"), (1024, 2048, "table"), (952, 3000, "table")]


def test_modifier_errors():
    with pytest.raises(ValueError, match=r"alibi takes num_heads or slopes, exactly one"):
        mb.alibi()
    with pytest.raises(ValueError, match=r"alibi takes num_heads or slopes, exactly one"):
        mb.alibi(4, slopes=torch.ones(4))
    with pytest.raises(ValueError, match=r"table must be a 2-D float tensor \(num_buckets, H\)"):
        mb.relative_buckets(torch.ones(32))
    with pytest.raises(ValueError, match=r"max_distance above the exactly bucketed"):
        mb.relative_buckets(torch.ones(32, 2), max_distance=4)
    q, k, v = qkv(1, 4, 4, 3, 3, 2)
    with pytest.raises(ValueError, match=r"has 2 heads but the query has H=4"):
        mh.attention(q, k, v, bias=mb.alibi(2))
    with pytest.raises(TypeError, match=r"bias must be a float tensor, a multihead.bias modifier"):
        mh.attention(q, k, v, bias=[[0.0]])
    with pytest.raises(ValueError, match=r"cannot add score modifiers with different head counts"):
        mb.alibi(2) + mb.alibi(4)
    table = torch.ones(8, 4)
    table[0, 0] = math.inf
    with pytest.raises(ValueError, match=r"table must be finite"):
        mh.attention(
            q.float(), k.float(), v.float(), bias=mb.relative_buckets(table, max_distance=8)
        )


# ------------------------------------------------------------------------------------------
# Soft-capping (Gemma 2) and attention sinks (gpt-oss): non-additive modifiers, against the
# naive formula written out in float64 (tests/helpers.py: naive_attention).

CAPPED_BACKENDS = ["reference", "tiled", "fused"]


def _capped_modifier(name: str, h: int, grad: bool = False):
    g = torch.Generator().manual_seed(11)
    logits = (2.0 * torch.randn(h, dtype=torch.float64, generator=g)).requires_grad_(grad)
    extra = mb.alibi(slopes=torch.rand(h, dtype=torch.float64, generator=g))
    return {
        "softcap": (mb.softcap(1.5), 1.5, None, None),
        "sinks": (mb.sinks(logits), None, logits, None),
        "softcap+sinks+alibi": (mb.softcap(0.75) + mb.sinks(logits) + extra, 0.75, logits, extra),
    }[name]


CAPPED = ["softcap", "sinks", "softcap+sinks+alibi"]


@pytest.mark.parametrize(
    "kind", ["none", "causal", "window_both", "lengths", "documents", "causal&lengths"]
)
@pytest.mark.parametrize("name", CAPPED)
@pytest.mark.parametrize("backend", CAPPED_BACKENDS)
def test_softcap_and_sinks_equal_the_formula(backend, name, kind):
    b, h, h_kv, length_q, length_k = 2, 4, 2, 23, 29
    q, k, v = qkv(b, h, h_kv, length_q, length_k, 5, seed=5)
    q = 3 * q  # scores of several units, so the cap bends them
    modifier, cap, logits, extra = _capped_modifier(name, h)
    case = make_case(kind, b, h, length_q, length_k, seed=5)
    dense = None if extra is None else extra.to_dense(length_q, length_k, dtype=torch.float64)
    want, want_w = naive_attention(q, k, v, case.keep, bias=dense, softcap=cap, sinks=logits)
    got, w = mh.attention_with_weights(q, k, v, case.mask, bias=modifier, backend=backend)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(w, want_w, rtol=0, atol=1e-12)
    plain = mh.attention(q, k, v, case.mask, bias=modifier, backend=backend)
    torch.testing.assert_close(plain, want, rtol=0, atol=1e-12)
    if logits is not None:  # a sink takes part of every visible row's weight
        rows = case.keep.expand(b, h, length_q, length_k).any(-1)
        assert bool((w.sum(-1)[rows] < 1).all()) and bool((w.sum(-1)[~rows] == 0).all())


@pytest.mark.parametrize("kind", ["none", "causal", "lengths"])
@pytest.mark.parametrize("name", CAPPED)
@pytest.mark.parametrize("backend", CAPPED_BACKENDS)
def test_gradcheck_softcap_and_sinks(backend, name, kind):
    b, h, length_q, length_k = 2, 2, 4, 6
    q, k, v = qkv(b, h, 1, length_q, length_k, 3, seed=6, requires_grad=True)
    mask = make_case(kind, b, h, length_q, length_k, seed=6).mask
    _, cap, logits, extra = _capped_modifier(name, h, grad=True)

    def f(q, k, v, *sink):
        modifier = mb.softcap(cap) if cap is not None else None
        if sink:
            modifier = mb.sinks(sink[0]) + modifier
        modifier = modifier + extra
        return mh.attention(q, k, v, mask, bias=modifier, backend=backend)

    inputs = (q, k, v) if logits is None else (q, k, v, logits)
    assert torch.autograd.gradcheck(f, inputs)


def test_selected_heads_keep_their_sinks():
    q, k, v = qkv(1, 4, 2, 7, 9, 3, seed=8)
    modifier = mb.sinks(torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64))
    full = mh.attention_with_weights(q, k, v, masks.causal(), bias=modifier)
    part = mh.attention_with_weights(q, k, v, masks.causal(), bias=modifier, heads=[3, 1])
    torch.testing.assert_close(part.weights, full.weights[:, [3, 1]], rtol=0, atol=1e-12)


def test_backends_without_softcap_or_sinks_refuse_them():
    q, k, v = qkv(1, 2, 2, 5, 5, 4, dtype=torch.float32)
    for modifier, what in ((mb.softcap(5.0), "soft-capping"), (mb.sinks(torch.zeros(2)), "sinks")):
        with pytest.raises(ValueError, match=rf"backend 'sdpa' cannot run this call: .* {what}"):
            mh.attention(q, k, v, masks.causal(), bias=modifier, backend="sdpa")
        chosen = mh.explain_backend(q, k, v, masks.causal(), bias=modifier)
        assert chosen.backend in CAPPED_BACKENDS + ["fused"]
        assert what in chosen.reasons["sdpa"]


def test_softcap_and_sinks_errors():
    for cap in (0, -1.0, math.inf, math.nan, "5", True):
        with pytest.raises(ValueError, match=r"softcap takes a finite positive number"):
            mb.softcap(cap)
    with pytest.raises(ValueError, match=r"sinks takes a 1-D float tensor"):
        mb.sinks(torch.zeros(2, 2))
    with pytest.raises(ValueError, match=r"sinks takes a 1-D float tensor"):
        mb.sinks(torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"holds at most one softcap"):
        mb.softcap(1.0) + mb.alibi(2) + mb.softcap(2.0)
    with pytest.raises(ValueError, match=r"holds at most one sinks"):
        mb.sinks(torch.zeros(2)) + mb.sinks(torch.ones(2))
    with pytest.raises(TypeError, match=r"softcap\(3\) is not an additive term"):
        mb.softcap(3.0).to_dense(2, 2)
    q, k, v = qkv(1, 4, 4, 3, 3, 2)
    with pytest.raises(ValueError, match=r"sinks need one logit per query head: H=4"):
        mh.attention(q, k, v, bias=mb.sinks(torch.zeros(2, dtype=torch.float64)))
    with pytest.raises(ValueError, match=r"sink logits must be finite"):
        mh.attention(q, k, v, bias=mb.sinks(torch.tensor([0.0, 1.0, math.inf, 0.0])))
    parts = mb.split(mb.alibi(4) + mb.softcap(2.0) + mb.sinks(torch.ones(4)))
    assert parts.softcap == 2.0 and parts.sinks.tolist() == [1.0] * 4
    assert repr(parts.additive).startswith("alibi(4 heads")
    assert mb.split(None) == (None, None, None)


@pytest.mark.parametrize("with_alibi", [False, True], ids=["softcap", "softcap+alibi"])
def test_statistics_of_a_capped_call_in_slices(with_alibi):
    """attention_stats sweeps a call with gradients in slices of query rows, cropping the bias
    to each slice: a soft-cap (the same for every row) crops to itself, a sum crops term by
    term. This raised "softcap(5) is not an additive term" before. Reference: the float64
    weights of the whole call, reduced by hand."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 700, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, 2, 3000, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    bias = mb.softcap(2.0) + (mb.alibi(2) if with_alibi else None)
    assert mb.softcap(2.0).crop(700, 3000, 100, 200, 0, 3000) is not None
    out, found = mh.attention_stats(q, k, v, masks.causal(), stats=["key_mass"], bias=bias)
    want_out, weights = mh.attention_with_weights(q, k, v, masks.causal(), bias=bias)
    torch.testing.assert_close(out, want_out, rtol=0, atol=1e-12)
    torch.testing.assert_close(found["key_mass"], weights.sum(2), rtol=0, atol=1e-10)
