"""The tiled backend: exact under every tile size, on both per-chunk kernels, without ever
building an L x S mask."""

from __future__ import annotations

import pytest
import torch
from helpers import MASK_KINDS, make_case, naive_attention, qkv

import multihead as mh
from multihead import masks
from multihead.backends import _plan, tiled


def _forward_backward(backend, q, k, v, mask, grad_out, **kw):
    out = mh.attention(q, k, v, mask, backend=backend, **kw)
    return (out, *torch.autograd.grad(out, (q, k, v), grad_out))


@pytest.mark.parametrize("tile", [1, 3, 7, 16], ids=lambda t: f"tile{t}")
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_tile_boundaries_cut_through_every_structure(monkeypatch, kind, tile):
    """Small odd tiles cut documents, windows and padding at every possible place."""
    monkeypatch.setattr(_plan, "query_tile", lambda call: tile)
    monkeypatch.setattr(_plan, "_MIN_FULL_RUN", 2)  # also split ranges into many chunks
    monkeypatch.setattr(_plan, "_rectangle_items", lambda *args: None)  # tile documents too
    b, h, h_kv, length_q, length_k, d = 3, 4, 2, 23, 29, 5
    q, k, v = qkv(b, h, h_kv, length_q, length_k, d, requires_grad=True)
    case = make_case(kind, b, h, length_q, length_k, seed=tile)
    grad_out = torch.randn(b, h, length_q, d, dtype=torch.float64)
    want = _forward_backward("reference", q, k, v, case.mask, grad_out)
    got = _forward_backward("tiled", q, k, v, case.mask, grad_out)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)


@pytest.mark.parametrize("kind", MASK_KINDS)
def test_plain_torch_chunk_kernel_matches_reference(monkeypatch, kind):
    """The path used on other devices and for dropout, forced on CPU."""
    monkeypatch.setattr(tiled._Ctx, "use_flash", lambda self, q, v: False)
    monkeypatch.setattr(_plan, "query_tile", lambda call: 8)
    b, h, h_kv, length_q, length_k, d = 2, 4, 2, 21, 19, 6
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        q, k, v = qkv(b, h, h_kv, length_q, length_k, d, requires_grad=True)
        lo = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        case = make_case(kind, b, h, length_q, length_k)
        grad_out = torch.randn(b, h, length_q, d, dtype=torch.float64)
        want = _forward_backward("reference", q, k, v, case.mask, grad_out)
        got = _forward_backward("tiled", *lo, case.mask, grad_out.to(dtype))
        for g, w in zip(got, want):
            assert (g.double() - w).abs().max() <= tol


def test_dropout_pattern_is_identical_in_forward_and_backward():
    q, k, v = qkv(2, 2, 1, 9, 11, 4, requires_grad=True, seed=5)
    mask = masks.sliding_window(3, 2) & masks.lengths(torch.tensor([11, 6]))

    def f(q, k, v):
        torch.manual_seed(1234)  # the same draw on every call makes the function deterministic
        return mh.attention(q, k, v, mask, dropout_p=0.3, backend="tiled")

    assert torch.equal(f(q, k, v), f(q, k, v))
    assert torch.autograd.gradcheck(f, (q, k, v))
    torch.manual_seed(1)
    other = mh.attention(q, k, v, mask, dropout_p=0.3, backend="tiled")
    assert not torch.equal(f(q, k, v), other)


def test_structured_masks_are_never_materialized(monkeypatch):
    """Sliding window over L = S = 2**15: a dense bool mask would be 1 GiB. Every block the
    kernel asks for is a small tile."""
    length = 2**15
    seen = []
    band = type(masks.sliding_window(1))
    band_block = band.block

    def guarded(self, length_q, length_k, q0, q1, k0, k1, **kw):
        seen.append((q1 - q0) * (k1 - k0))
        if (q1 - q0) * (k1 - k0) > 2**20:
            raise AssertionError(f"block of {(q1 - q0)} x {(k1 - k0)} requested")
        return band_block(self, length_q, length_k, q0, q1, k0, k1, **kw)

    monkeypatch.setattr(band, "block", guarded)
    q, k, v = qkv(1, 1, 1, length, length, 4, dtype=torch.float32, requires_grad=True)
    out = mh.attention(q, k, v, masks.sliding_window(256), backend="tiled")
    out.sum().backward()
    assert seen and max(seen) <= 2**20
    # spot-check a few rows against the formula on their own window
    for i in (0, 300, length - 1):
        lo = max(0, i - 256)
        want, _ = naive_attention(
            q[:, :, i : i + 1].double(), k[:, :, lo : i + 1].double(), v[:, :, lo : i + 1].double()
        )
        assert (out[:, :, i : i + 1].double() - want).abs().max() <= 1e-5


def test_empty_tiles_are_skipped():
    mask = masks.lengths(torch.tensor([0, 300])) & masks.causal()
    items = tiled.plan(mask, 2, 600, 600, 100, "cpu")
    # batch 0 sees nothing; batch 1 sees keys < 300, so queries < 300 have a causal triangle
    assert {item.batch.start for item in items} == {1}
    visible = sum((item.q1 - item.q0) * (c.stop - c.start) for item in items for c in item.chunks)
    assert visible < 600 * 300


def test_weights_keep_fast_output_and_match_reference():
    q, k, v = qkv(2, 4, 2, 37, 41, 8)
    case = make_case("documents&causal", 2, 4, 37, 41)
    out, w = mh.attention_with_weights(q, k, v, case.mask)
    assert mh.explain_backend(q, k, v, case.mask, weights=True).backend == "tiled"
    ref_out, ref_w = mh.attention_with_weights(q, k, v, case.mask, backend="reference")
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-12)
    torch.testing.assert_close(w, ref_w, rtol=0, atol=1e-12)


@pytest.mark.parametrize("kind", ["none", "causal", "lengths", "key_padding", "documents", "dense"])
def test_weights_by_tile(kind):
    b, h, h_kv, length_q, length_k = 2, 6, 3, 13, 17
    q, k, v = qkv(b, h, h_kv, length_q, length_k, 5)
    case = make_case(kind, b, h, length_q, length_k)
    _, want = naive_attention(q, k, v, case.keep)
    got = mh.attention_with_weights(q, k, v, case.mask, backend="tiled").weights
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    # a per-head dense mask included: its rows for the chosen heads go with them
    part = mh.attention_with_weights(q, k, v, case.mask, heads=[1, 3], backend="tiled").weights
    torch.testing.assert_close(part, want[:, 1:5:2], rtol=0, atol=1e-12)
    one = mh.attention_with_weights(q, k, v, case.mask, heads=[5], backend="tiled").weights
    torch.testing.assert_close(one, want[:, [5]])


def test_heads_errors():
    q, k, v = qkv(1, 4, 2, 3, 3, 2)
    with pytest.raises(ValueError, match=r"heads must be query-head indices in \[0, 4\)"):
        mh.attention_with_weights(q, k, v, heads=[4], backend="tiled")
    with pytest.raises(ValueError, match=r"Received: query heads H=4, key/value heads H_kv=3"):
        kv = torch.cat([k, k[:, :1]], dim=1)
        mh.attention_with_weights(q, kv, kv, heads=[1], backend="tiled")


def test_tiled_computes_bias_gradients():
    q, k, v = qkv(1, 2, 2, 40, 40, 3)
    bias = torch.randn(40, 40, dtype=torch.float64, requires_grad=True)
    m = masks.sliding_window(5)
    assert mh.explain_backend(q, k, v, m, bias=bias).backend == "tiled"
    (got,) = torch.autograd.grad(mh.attention(q, k, v, m, bias=bias).sum(), bias)
    (want,) = torch.autograd.grad(
        mh.attention(q, k, v, m, bias=bias, backend="reference").sum(), bias
    )
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_window_tiles_run_as_two_causal_triangles():
    items = tiled.plan(masks.sliding_window(256), 1, 2048, 2048, 256, "cpu")
    inner = items[3]
    assert [(c.stop - c.start, c.pattern) for c in inner.chunks] == [(256, "triu"), (256, "tril")]
    assert all(c.keep is None or c.pattern for item in items for c in item.chunks)
    # the plan of a band-only mask is cached
    assert tiled.plan(masks.sliding_window(256), 1, 2048, 2048, 256, "cpu") is items


def test_triangle_chunks_match_reference_at_real_tile_sizes():
    q, k, v = qkv(1, 2, 1, 700, 700, 8, requires_grad=True)
    grad_out = torch.randn(1, 2, 700, 8, dtype=torch.float64)
    for mask in (
        masks.sliding_window(100),
        masks.sliding_window(64, align="top_left"),
        masks.causal(),
    ):
        want = _forward_backward("reference", q, k, v, mask, grad_out)
        got = _forward_backward("tiled", q, k, v, mask, grad_out)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-12)


def test_tiles_across_document_boundaries_are_split():
    ids = torch.repeat_interleave(torch.arange(4), torch.tensor([300, 500, 100, 124]))
    items = tiled.plan(masks.documents(ids), 1, 1024, 1024, 256, "cpu")
    masked = sum(
        (i.q1 - i.q0) * (c.stop - c.start) for i in items for c in i.chunks if c.keep is not None
    )
    total = sum((i.q1 - i.q0) * (c.stop - c.start) for i in items for c in i.chunks)
    visible = int(masks.documents(ids).to_dense(1024, 1024).sum())
    assert total < 1.1 * visible and masked < 0.1 * total


def test_padded_query_rows_are_trimmed():
    lens = torch.tensor([300, 1000])
    items = tiled.plan(masks.lengths(lens, query_lens=lens), 2, 1000, 1000, 1000, "cpu")
    assert [
        (i.batch.start, i.q0, i.q1, [(c.start, c.stop, c.keep) for c in i.chunks]) for i in items
    ] == [
        (0, 0, 300, [(0, 300, None)]),
        (1, 0, 1000, [(0, 1000, None)]),
    ]


@pytest.mark.parametrize(
    "kind", ["none", "window_both", "documents&causal", "lengths_padded_queries"]
)
def test_weights_with_and_without_gradients_match_reference(kind):
    q, k, v = qkv(2, 4, 2, 300, 290, 8, requires_grad=True)
    case = make_case(kind, 2, 4, 300, 290)
    bias = torch.randn(300, 290, dtype=torch.float64)
    _, ref_w = mh.attention_with_weights(q, k, v, case.mask, bias=bias, backend="reference")
    _, w = mh.attention_with_weights(q, k, v, case.mask, bias=bias, backend="tiled")
    torch.testing.assert_close(w, ref_w, rtol=0, atol=1e-12)
    grad = torch.randn_like(w)
    torch.testing.assert_close(
        torch.autograd.grad(w, (q, k), grad),
        torch.autograd.grad(ref_w, (q, k), grad),
        rtol=0,
        atol=1e-10,
    )
    with torch.no_grad():  # the fast path reuses the forward pass's log-sum-exp
        _, w_fast = mh.attention_with_weights(q, k, v, case.mask, bias=bias, backend="tiled")
    torch.testing.assert_close(w_fast, ref_w, rtol=0, atol=1e-12)


def test_weights_when_a_key_block_inside_the_range_is_hidden():
    """A tile of document 0 spans document 1's keys, whose blocks are all hidden and dropped:
    the chunks have a gap that the weights must leave at 0."""
    ids = torch.tensor([0] * 256 + [1] * 600 + [0] * 256)
    length = ids.numel()
    q, k, v = qkv(1, 2, 2, length, length, 4, requires_grad=True)
    mask = masks.documents(ids)
    items = tiled.plan(mask, 1, length, length, 256, "cpu")
    assert any(a.stop < b.start for i in items for a, b in zip(i.chunks, i.chunks[1:]))
    _, want = mh.attention_with_weights(q, k, v, mask, backend="reference")
    with torch.no_grad():
        _, got = mh.attention_with_weights(q, k, v, mask, backend="tiled")
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    _, got = mh.attention_with_weights(q, k, v, mask, backend="tiled")  # with grad
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_packed_documents_plan_one_full_item_per_document():
    ids = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 5])
    key_ids = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 3])  # id 5 has no keys: its row sees none
    items = tiled.plan(masks.documents(ids, key_ids), 1, 10, 10, 256, "cpu")
    got = [(it.q0, it.q1, [(c.start, c.stop, c.keep) for c in it.chunks]) for it in items]
    assert got == [(0, 3, [(0, 3, None)]), (3, 5, [(3, 5, None)]), (5, 9, [(5, 9, None)])]
    q, k, v = qkv(1, 2, 2, 10, 10, 4)
    mask = masks.documents(ids, key_ids)
    out = mh.attention(q, k, v, mask, backend="tiled")
    keep = ids[:, None] == key_ids[None, :]
    torch.testing.assert_close(out, naive_attention(q, k, v, keep)[0], rtol=0, atol=1e-12)
    assert torch.all(out[:, :, 9] == 0)


def test_documents_with_interleaved_keys_use_the_tiled_plan():
    ids = torch.tensor([[0, 0, 1, 1, 2, 2], [0, 1, 0, 1, 0, 1]])  # row 1: keys interleaved
    mask = masks.documents(ids)
    assert mask.blocks(6, 6, batch=0) == [(0, 2, 0, 2), (2, 4, 2, 4), (4, 6, 4, 6)]
    assert mask.blocks(6, 6, batch=1) is None
    assert _plan._rectangle_items(mask, [slice(0, 1), slice(1, 2)], 6, 6) is None
    q, k, v = qkv(2, 3, 3, 6, 6, 4)
    keep = (ids[:, :, None] == ids[:, None, :])[:, None]
    torch.testing.assert_close(
        mh.attention(q, k, v, mask, backend="tiled"),
        naive_attention(q, k, v, keep)[0],
        rtol=0,
        atol=1e-12,
    )


def test_returned_weights_as_accurate_as_eager_softmax_for_large_scores():
    """Scores near 200 (ulp 1.5e-5): weights from the kernel's log-sum-exp alone were 5x less
    accurate than an eager fp32 softmax; each row is renormalized to stay within 2x."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 300, 32, generator=g) * s for s in (6, 6, 1))
    mask = masks.lengths(torch.tensor([300, 120]))
    _, got = mh.attention_with_weights(q, k, v, mask, backend="tiled")
    keep = mask.to_dense(300, 300)
    scores = (q.double() @ k.double().transpose(-1, -2) / 32**0.5).masked_fill(~keep, -torch.inf)
    exact = scores.softmax(-1)
    eager = (q @ k.transpose(-1, -2) / 32**0.5).masked_fill(~keep, -torch.inf).softmax(-1)
    eager_error = (eager.double() - exact).abs().max()
    assert eager_error > 1e-6  # the case is hard enough to tell the two apart
    assert (got.double() - exact).abs().max() <= 2 * eager_error


@pytest.mark.parametrize("batched_ids", [False, True], ids=["shared_ids", "per_row_ids"])
def test_equal_packed_documents_run_as_one_batched_call(monkeypatch, batched_ids):
    """Texts packed after sorting by length: runs of equal lengths become one kernel call."""
    sizes = [3, 3, 3, 5, 5, 2, 7, 7, 7, 7]
    ids = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    b = 2 if batched_ids else 1
    if batched_ids:
        ids = torch.stack([ids, ids.flip(0)])  # the second row has the runs in reverse
    mask = masks.documents(ids)
    length = len(ids[0]) if batched_ids else len(ids)
    calls = []
    original = tiled._chunk_forward

    def spy(ctx, q, k, v, *args):
        calls.append(q.shape[0])
        return original(ctx, q, k, v, *args)

    monkeypatch.setattr(tiled, "_chunk_forward", spy)
    q, k, v = qkv(b, 2, 2, length, length, 4, requires_grad=True)
    grad_out = torch.randn(b, 2, length, 4, dtype=torch.float64)
    got = _forward_backward("tiled", q, k, v, mask, grad_out)
    # stacked batches of 3, 2, 1 and 4 documents (the second row has them in reverse order)
    assert calls == ([3, 2, 1, 4, 4, 1, 2, 3] if batched_ids else [3, 2, 1, 4])
    want = _forward_backward("reference", q, k, v, mask, grad_out)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)
