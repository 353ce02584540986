"""The FlexAttention backend: the block mask built from the masks' own answers, the kernel
against the reference for every mask kind and modifier, compile caching and failures, and
auto's choice.

Inductor compiles take 10-30 s on two cores, so most tests run FlexAttention eagerly. Eager
``flex_attention`` evaluates the predicate on every (query, key) pair and ignores the block
structure, which would hide a wrong block; ``_kernel_semantics`` therefore gives it a predicate
that sees what a compiled kernel sees (listed full blocks without the predicate, listed partial
blocks with it, everything else hidden). One test compiles for real.
"""

from __future__ import annotations

import random
import warnings

import pytest
import torch
from helpers import COMBOS, MASK_KINDS, make_case, naive_attention, qkv
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

import multihead as mh
from multihead import bias as mb
from multihead import masks
from multihead.backends import Call, flex, half
from multihead.masks import TileKind

# docs/design.md, "Error rules": float32 outputs within 1e-5 of the float64 reference
FP32_OUT = 1e-5


@pytest.fixture(autouse=True)
def _fresh_cache():
    """Kernels compiled (or faked) by one test never serve another."""
    flex.clear_cache()
    yield
    flex.clear_cache()


def _listed(count, index, n_k):
    """bool [B, H, n_q, n_k]: the key blocks a BlockMask lists for each query block."""
    listed = (torch.arange(index.shape[-1]) < count[..., None]).long()
    out = torch.zeros(*index.shape[:-1], n_k, dtype=torch.long)
    return out.scatter_add(-1, index.long(), listed) > 0


def _kernel_semantics(blocks: BlockMask) -> BlockMask:
    """The same blocks with a predicate that is exactly what a compiled kernel applies."""
    block_q, block_k = blocks.BLOCK_SIZE
    n_k = blocks.kv_indices.shape[-1]
    partial = _listed(blocks.kv_num_blocks, blocks.kv_indices, n_k)
    full = _listed(blocks.full_kv_num_blocks, blocks.full_kv_indices, n_k)
    mod = blocks.mask_mod

    def seen(b, h, q_idx, kv_idx):
        row = b if partial.shape[0] > 1 else b * 0
        i, j = q_idx // block_q, kv_idx // block_k
        return full[row, h * 0, i, j] | (partial[row, h * 0, i, j] & mod(b, h, q_idx, kv_idx))

    return BlockMask.from_kv_blocks(
        blocks.kv_num_blocks,
        blocks.kv_indices,
        blocks.full_kv_num_blocks,
        blocks.full_kv_indices,
        BLOCK_SIZE=blocks.BLOCK_SIZE,
        mask_mod=seen,
        seq_lengths=blocks.seq_lengths,
    )


def _eager_kernel(query, key, value, score_mod, blocks, scale, enable_gqa):
    if blocks is not None:
        blocks = _kernel_semantics(blocks)
    return flex_attention(
        query,
        key,
        value,
        score_mod=score_mod,
        block_mask=blocks,
        scale=scale,
        enable_gqa=enable_gqa,
    )


@pytest.fixture
def eager(monkeypatch):
    """Run the backend on eager FlexAttention with compiled-kernel block semantics."""
    monkeypatch.setattr(flex, "_compile", lambda tag: _eager_kernel)
    with warnings.catch_warnings():
        # eager FlexAttention advises torch.compile: here eager is the point
        warnings.filterwarnings("ignore", "flex_attention called without torch.compile")
        yield


# ---------------------------------------------------------------- Mask.rect_kind


def _rects(length_q, length_k, seed):
    rng = random.Random(seed)
    grid = [
        (q0, min(q0 + bq, length_q), k0, min(k0 + bk, length_k))
        for bq, bk in ((4, 4), (5, 3), (8, 8))
        for q0 in range(0, length_q, bq)
        for k0 in range(0, length_k, bk)
    ]
    loose = [
        (*sorted(rng.sample(range(length_q + 1), 2)), *sorted(rng.sample(range(length_k + 1), 2)))
        for _ in range(150)
    ]
    return grid + loose


def _check_rect_kinds(mask, keep, length_q, length_k, exact, seed=0):
    b = keep.shape[0]
    for batch in range(b):
        for q0, q1, k0, k1 in _rects(length_q, length_k, seed):
            got = mask.rect_kind(length_q, length_k, q0, q1, k0, k1, batch=batch)
            block = keep[batch, :, q0:q1, k0:k1]
            where = f"batch {batch}, queries [{q0}, {q1}), keys [{k0}, {k1}): {got}"
            if got == TileKind.EMPTY:
                assert not block.any(), where
            elif got == TileKind.FULL:
                assert block.all(), where
            elif exact:
                assert block.any() and not block.all(), where


@pytest.mark.parametrize("shape", [(23, 29), (29, 23), (16, 16)], ids=["L<S", "L>S", "L=S"])
@pytest.mark.parametrize("kind", [k for k in MASK_KINDS if k != "none"])
def test_rect_kind_agrees_with_the_dense_lowering(kind, shape):
    """EMPTY and FULL are never wrong for any mask; single masks answer exactly. The expected
    visibility is written out independently in tests/helpers.py."""
    b, h = 3, 4
    length_q, length_k = shape
    for seed in (0, 1):
        case = make_case(kind, b, h, length_q, length_k, seed=seed)
        keep = case.keep.expand(b, h, length_q, length_k)
        assert torch.equal(case.mask.to_dense(length_q, length_k).expand_as(keep), keep)
        _check_rect_kinds(case.mask, keep, length_q, length_k, kind not in COMBOS, seed)


def test_rect_kind_of_broadcast_dense_masks():
    """Dense masks whose query or key dimension has size 1 (it broadcasts)."""
    g = torch.Generator().manual_seed(4)
    per_key = torch.rand(3, 1, 1, 29, generator=g) < 0.5
    per_query = torch.rand(1, 2, 23, 1, generator=g) < 0.5
    for keep in (per_key, per_query, per_key & per_query):
        mask = masks.dense(keep)
        _check_rect_kinds(mask, keep.expand(3, 2, 23, 29), 23, 29, exact=True)


def test_rect_kind_of_interleaved_documents_and_crops():
    """Documents whose keys are not contiguous compare ids; a crop answers as the whole."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 3, (2, 26), generator=g)
    key_ids = torch.randint(0, 4, (2, 31), generator=g)
    interleaved = masks.documents(ids, key_ids)
    keep = ids[:, None, :, None] == key_ids[:, None, None, :]
    _check_rect_kinds(interleaved, keep, 26, 31, exact=True)
    for whole, size in ((interleaved, (26, 31)), (masks.sliding_window(3, 2), (26, 31))):
        crop = whole.crop(*size, 5, 21, 7, 30)
        dense = whole.to_dense(*size)[:, :, 5:21, 7:30].expand(2, 1, 16, 23)
        _check_rect_kinds(crop, dense, 16, 23, exact=True)


# ---------------------------------------------------------------- block_mask


def _blocks_of(blocks: BlockMask) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial, full) as bool [B, n_q, n_k], heads folded: FULL for every head, PARTIAL where
    some head sees something and not every head sees everything."""
    n_k = blocks.kv_indices.shape[-1]
    partial = _listed(blocks.kv_num_blocks, blocks.kv_indices, n_k)
    full = _listed(blocks.full_kv_num_blocks, blocks.full_kv_indices, n_k)
    all_full = full.all(dim=1)
    return (partial | full).any(dim=1) & ~all_full, all_full


@pytest.mark.parametrize("block", [4, 7])
@pytest.mark.parametrize("kind", [k for k in MASK_KINDS if k not in COMBOS and k != "none"])
def test_block_mask_equals_create_block_mask(kind, block):
    """For masks that answer exactly, the blocks equal those torch's create_block_mask finds by
    evaluating the predicate on every pair (tails past L and S count as partial in both)."""
    b, h, length_q, length_k = 3, 4, 23, 29
    case = make_case(kind, b, h, length_q, length_k)
    ours = flex.block_mask(case.mask, length_q, length_k, batch_size=b, block_size=block)
    theirs = create_block_mask(
        case.mask.mask_mod(length_q, length_k), b, h, length_q, length_k, "cpu", block
    )
    got, want = _blocks_of(ours), _blocks_of(theirs)
    for g, w in zip(got, want):
        assert torch.equal(g.expand_as(w), w)
    assert ours.seq_lengths == (length_q, length_k)


def test_block_mask_never_visits_every_pair(monkeypatch):
    """A sliding window over L = S = 2**16 (a dense bool mask would be 4 GiB): one tile per
    query block, a few rect_kind calls each, and no lowering or predicate evaluation at all."""
    length = 2**16
    window = masks.sliding_window(256)
    band = type(window)
    calls = {"tile": 0, "rect_kind": 0}
    for name in calls:
        real = getattr(band, name)

        def counted(self, *args, _real=real, _name=name, **kw):
            calls[_name] += 1
            return _real(self, *args, **kw)

        monkeypatch.setattr(band, name, counted)

    def refuse(*args, **kw):
        raise AssertionError("the mask was lowered")

    monkeypatch.setattr(band, "block", refuse)
    blocks = flex.block_mask(window, length, length)
    n = length // flex.BLOCK
    assert calls["tile"] == n
    assert calls["rect_kind"] <= 4 * n
    partial, full = _blocks_of(blocks)
    # 256 keys behind each query: the diagonal block and the one two to the left are cut by
    # the band (partial), the one between is full; the first query blocks have fewer
    assert int(partial.sum()) == 2 * n - 2 and int(full.sum()) == n - 1
    assert blocks.sparsity() == pytest.approx(100 * (1 - (3 * n - 3) / n**2))


# ---------------------------------------------------------------- the backend, eager


@pytest.mark.parametrize("block", [4, 16])
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_flex_matches_reference_for_every_mask_kind(eager, monkeypatch, kind, block):
    """Odd sizes, grouped-query heads, blocks that cut documents, windows and padding."""
    monkeypatch.setattr(flex, "BLOCK", block)
    b, h, h_kv, length_q, length_k, d = 3, 4, 2, 23, 29, 5
    q, k, v = qkv(b, h, h_kv, length_q, length_k, d, seed=block)
    case = make_case(kind, b, h, length_q, length_k, seed=block)
    want, _ = naive_attention(q, k, v, case.keep)
    with torch.no_grad():
        got = mh.attention(*(t.float() for t in (q, k, v)), case.mask, backend="flex")
    assert got.dtype == torch.float32
    assert (got.double() - want).abs().max() <= FP32_OUT


def _modifiers(h, length_q, length_k):
    g = torch.Generator().manual_seed(7)
    table = torch.randn(8, h, generator=g)
    extra = torch.randn(2, h, length_q, length_k, generator=g)
    return {
        "alibi": mb.alibi(h),
        "alibi_bidirectional": mb.alibi(h, bidirectional=True),
        "t5": mb.relative_buckets(table, max_distance=6),
        "t5_decoder": mb.relative_buckets(table, bidirectional=False, max_distance=6),
        "tensor": extra,
        "sum": mb.alibi(h) + mb.relative_buckets(table, max_distance=6) + extra[:1, :1],
    }


@pytest.mark.parametrize("kind", ["none", "causal", "window_both", "lengths", "documents"])
@pytest.mark.parametrize("name", list(_modifiers(2, 1, 1)))
def test_flex_matches_reference_with_every_modifier(eager, monkeypatch, name, kind):
    monkeypatch.setattr(flex, "BLOCK", 8)
    b, h, length_q, length_k = 2, 4, 21, 26
    q, k, v = qkv(b, h, 2, length_q, length_k, 6, seed=5)
    modifier = _modifiers(h, length_q, length_k)[name]
    case = make_case(kind, b, h, length_q, length_k, seed=5)
    dense = mb.as_modifier(modifier).to_dense(length_q, length_k, dtype=torch.float64)
    want, _ = naive_attention(q, k, v, case.keep, bias=dense)
    with torch.no_grad():
        got = mh.attention(
            *(t.float() for t in (q, k, v)), case.mask, bias=modifier, backend="flex"
        )
    assert (got.double() - want).abs().max() <= FP32_OUT


def test_bf16_follows_the_accuracy_rule_and_the_bias_rule(eager):
    """bf16: error at most 2x the naive formula's in bf16 plus one ulp of the output scale; and
    the float32 bias is added in float32, never rounded to bf16 (docs/design.md, "Error rules"
    and "The bias rule")."""
    b, h, length, d = 1, 2, 64, 16
    q, k, v = qkv(b, h, h, length, length, d, seed=9)
    bias = 30 * torch.randn(length, length, generator=torch.Generator().manual_seed(1))
    mask = masks.sliding_window(20)
    keep = mask.to_dense(length, length)
    want, _ = naive_attention(q, k, v, keep, bias=bias.double())
    lo = [t.bfloat16() for t in (q, k, v)]
    naive, _ = naive_attention(*lo, keep, bias=bias.bfloat16())
    with torch.no_grad():
        got = mh.attention(*lo, mask, bias=bias, backend="flex")
    ulp = torch.finfo(torch.bfloat16).eps * want.abs().max()
    assert (got.double() - want).abs().max() <= 2 * (naive.double() - want).abs().max() + ulp
    # the exact answer for these bf16 inputs and the float32 bias: the kernel may round the
    # weights to bf16 before multiplying by V (relative eps / 2 each, so at most
    # eps / 2 * max|v| in the output) and rounds the output (eps / 2 * max|v|); a bias of size
    # 30 rounded to bf16 would move scores by up to 0.125 and weights by about 12%
    exact, _ = naive_attention(*(t.double() for t in lo), keep, bias=bias.double())
    eps = torch.finfo(torch.bfloat16).eps
    assert (got.double() - exact).abs().max() <= eps * lo[2].double().abs().max()


def test_flex_follows_the_nan_rule(eager):
    """NaN in a padding key that no query may see stays out; NaN in a visible key makes exactly
    the rows that see it NaN (applied around every backend)."""
    q, k, v = (t.float() for t in qkv(1, 2, 2, 12, 12, 4, seed=3))
    k[0, :, 10] = float("nan")
    mask = masks.sliding_window(2)
    with torch.no_grad():
        out = mh.attention(q, k, v, mask & masks.lengths(torch.tensor([10])), backend="flex")
        assert torch.isfinite(out).all()
        out = mh.attention(q, k, v, mask, backend="flex")
    want = mask.to_dense(12, 12)[0, 0, :, 10]  # rows 10 and 11 see key 10
    assert torch.equal(torch.isnan(out).any(-1)[0, 0], want)


# ---------------------------------------------------------------- caching and failures


def test_compile_failure_is_caught_once_remembered_and_explained(monkeypatch):
    attempts = []

    def failing_compile(tag):
        def kernel(*args):
            attempts.append(tag)
            raise RuntimeError("C++ compile error\ng++ ... (details)")

        return kernel

    monkeypatch.setattr(flex, "_compile", failing_compile)
    q, k, v = (t.float() for t in qkv(1, 2, 2, 40, 40, 8))
    mask = masks.documents(torch.arange(40) // 13)
    with torch.no_grad():
        with pytest.warns(RuntimeWarning, match="could not be compiled.*run on 'tiled'"):
            out = mh.attention(q, k, v, mask, backend="flex")
        want, _ = naive_attention(q.double(), k.double(), v.double(), mask.to_dense(40, 40))
        assert (out.double() - want).abs().max() <= FP32_OUT
        assert len(attempts) == 1
        log = flex.compile_log()
        assert len(log) == 1 and log[0].error == "RuntimeError: C++ compile error"
        assert log[0].what.startswith("documents(")
        # other documents of the same structure and size: no second attempt
        other = masks.documents(torch.arange(40) // 7)
        reason = mh.explain_backend(q, k, v, other).reasons["flex"]
        assert reason.startswith("Inductor failed to compile FlexAttention for this mask")
        assert "C++ compile error" in reason
        with pytest.raises(ValueError, match="backend 'flex' cannot run this call: Inductor"):
            mh.attention(q, k, v, other, backend="flex")
        assert len(attempts) == 1
        # another structure is still tried
        with pytest.warns(RuntimeWarning):
            mh.attention(q, k, v, masks.sliding_window(5), backend="flex")
        assert len(attempts) == 2


def test_compiled_kernel_matches_reference_and_compiles_once_per_structure():
    """The one real Inductor compile: a window with padding, ALiBi, grouped-query heads, rows
    with no visible key and blocks cut at L and S. A new mask of the same structure (other
    lengths) reuses the kernel; compile time is logged apart."""
    b, h, h_kv, length, d = 2, 4, 2, 300, 16
    q, k, v = qkv(b, h, h_kv, length, length, d, seed=11)
    lo = [t.float() for t in (q, k, v)]
    bias = mb.alibi(h)

    def mask_for(lens):
        lens = torch.tensor(lens)
        return masks.sliding_window(100, 20) & masks.lengths(lens, query_lens=lens)

    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for lens in ([300, 170], [250, 0]):
        mask = mask_for(lens)
        keep = mask.to_dense(length, length)
        want, _ = naive_attention(q, k, v, keep, bias=bias.to_dense(length, length).double())
        with torch.no_grad():
            got = mh.attention(*lo, mask, bias=bias, backend="flex")
        assert (got.double() - want).abs().max() <= FP32_OUT
        assert torch.equal(got[1, :, lens[1] :], torch.zeros_like(got[1, :, lens[1] :]))
    log = flex.compile_log()
    assert len(log) == 1, log
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs + 1  # no recompile
    assert log[0].error is None and log[0].seconds > 0
    assert "B=2 H=4 2 kv heads, L=300 S=300 D=16 float32 on cpu" in log[0].what


def test_keys_reach_the_cpu_kernel_in_whole_blocks(monkeypatch):
    """Inductor's CPU kernel (torch 2.13) reads the last key block whole: with S = 104 the
    last (batch, head)'s rows multiplied their masked weights by what lay past the tensor's
    end and came out NaN now and then. The backend pads keys and values to whole blocks and
    hides the padding; the compiled kernel's answer equals the reference."""
    compile_ = flex._compile
    lengths = []

    def spying(tag):
        fn = compile_(tag)

        def run(*args):
            lengths.append(args[1].shape[-2])
            return fn(*args)

        return run

    monkeypatch.setattr(flex, "_compile", spying)
    b, h, length_q, length_k, d = 2, 2, 64, 104, 16
    q, k, v = qkv(b, h, h, length_q, length_k, d, seed=3)
    want, _ = naive_attention(q, k, v, None)
    with torch.no_grad():
        got = mh.attention(*(t.float() for t in (q, k, v)), backend="flex")
    assert lengths == [flex.BLOCK]
    assert (got.double() - want).abs().max() <= FP32_OUT


# ---------------------------------------------------------------- what flex cannot run


@pytest.mark.parametrize(
    "kw,grad,dtype,match",
    [
        ({"weights": True}, False, torch.float32, "does not return attention weights"),
        ({"dropout_p": 0.1}, False, torch.float32, "FlexAttention has no dropout"),
        ({}, True, torch.float32, "FlexAttention has no CPU backward"),
        ({}, False, torch.float64, "takes float32, bfloat16 or float16; received torch.float64"),
    ],
    ids=["weights", "dropout", "backward", "float64"],
)
def test_unsupported_calls_say_why(kw, grad, dtype, match):
    q, k, v = qkv(1, 2, 2, 8, 8, 4, dtype=dtype, requires_grad=grad)
    mask = masks.sliding_window(2)
    run = mh.attention_with_weights if kw.pop("weights", False) else mh.attention
    with pytest.raises(ValueError, match=f"backend 'flex' cannot run this call: .*{match}"):
        run(q, k, v, mask, backend="flex", **kw)
    weights = run is mh.attention_with_weights
    assert match in mh.explain_backend(q, k, v, mask, weights=weights, **kw).reasons["flex"]


def test_empty_sequences_and_export_are_refused(monkeypatch):
    q, k, v = qkv(1, 2, 2, 0, 8, 4, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"needs L > 0 and S > 0; received L=0, S=8"):
        mh.attention(q, k, v, backend="flex")
    monkeypatch.setattr(torch.compiler, "is_exporting", lambda: True)
    q, k, v = qkv(1, 2, 2, 4, 8, 4, dtype=torch.float32)
    assert "needs torch.compile" in mh.explain_backend(q, k, v).reasons["flex"]


# ---------------------------------------------------------------- auto


def _choose(length, mask, *, bias=None, grad=False, dtype=torch.float32, head_dim=16):
    q, k, v = qkv(1, 2, 2, length, length, head_dim, dtype=dtype, requires_grad=grad)
    return mh.explain_backend(q, k, v, mask, bias=bias)


def test_auto_picks_flex_on_cpu_only_where_it_measured_faster(monkeypatch):
    window = masks.sliding_window(256)
    choice = _choose(4096, window)
    assert choice.backend == "flex"
    assert choice.reasons["tiled"].startswith("supported, but flex is expected to be faster")
    assert "measured faster than tiled on long sliding windows" in choice.reasons["tiled"]
    # shorter sequences, wider windows, a bias, training, unbounded bands: tiled
    assert _choose(2048, window).backend == "tiled"
    assert _choose(4096, masks.sliding_window(2048)).backend == "tiled"
    assert _choose(4096, masks.sliding_window(256, 256)).backend == "flex"
    assert _choose(4096, masks.sliding_window(256, 257)).backend == "tiled"
    # bf16: tiled, or the half kernel where it measured faster than tiled (both ways here)
    for faster in (False, True):
        monkeypatch.setattr(half, "measured_faster", lambda call, rival, f=faster: f)
        chosen = _choose(4096, window, dtype=torch.bfloat16).backend
        assert chosen == ("half" if faster else "tiled")
    assert _choose(4096, window, bias=mb.alibi(2)).backend == "tiled"
    assert _choose(4096, masks.causal()).backend == "sdpa"
    assert _choose(4096, masks.lengths(torch.tensor([3000]))).backend == "tiled"
    training = _choose(4096, window, grad=True)
    assert training.backend == "tiled"
    assert "no CPU backward" in training.reasons["flex"]


@pytest.mark.parametrize(
    "mask,bias,expected",
    [
        (masks.sliding_window(3), None, "flex"),
        (masks.lengths(torch.tensor([5])), None, "flex"),
        (masks.documents(torch.tensor([0, 0, 0, 1, 1, 1, 1, 2])), None, "flex"),
        (masks.causal(), mb.alibi(2), "flex"),
        (None, mb.relative_buckets(torch.randn(8, 2), max_distance=6), "flex"),
        (None, None, "sdpa"),
        (masks.causal(), None, "sdpa"),
        (masks.dense(torch.rand(8, 8) < 0.5), None, "sdpa"),
        (None, torch.randn(8, 8), "sdpa"),
    ],
    ids=["window", "lengths", "documents", "alibi", "t5", "none", "causal", "dense", "tensor"],
)
def test_auto_uses_flex_as_the_cuda_path_for_structured_masks(monkeypatch, mask, bias, expected):
    monkeypatch.setattr(Call, "device_type", property(lambda call: "cuda"))
    choice = _choose(8, mask, bias=bias)
    assert choice.backend == expected
    if expected == "flex":
        assert "one compiled kernel skips the blocks the mask hides" in choice.reasons["sdpa"]
    # what flex cannot honour still goes elsewhere on a GPU
    q, k, v = qkv(1, 2, 2, 8, 8, 16, dtype=torch.float32)
    assert mh.explain_backend(q, k, v, mask, bias=bias, weights=True).backend == "tiled"


def test_flex_is_not_asked_on_cuda_for_head_dims_under_16(monkeypatch):
    """Inductor refuses to lower CUDA FlexAttention for D < 16 (seen on an H100, torch 2.11:
    every such call paid for a failed compile and a warning before running elsewhere)."""
    monkeypatch.setattr(Call, "device_type", property(lambda call: "cuda"))
    choice = _choose(8, masks.sliding_window(2), head_dim=8)
    assert choice.backend != "flex"
    assert choice.reasons["flex"] == (
        "Inductor's CUDA FlexAttention kernel needs head dims of at least 16; received D=8, D_v=8"
    )


# ---------------------------------------------------------------- bench


def test_bench_row_reports_compile_time_apart(eager, monkeypatch):
    from multihead.bench import kernels

    q, k, v = qkv(1, 2, 2, 64, 64, 8, dtype=torch.float32)
    mask = masks.sliding_window(8)
    out, notes = {}, {}
    kernels._add_flex_backend(out, notes, False, q, k, v, mask, None)
    assert notes["multihead, flex"].startswith("compile + first call ")
    assert notes["multihead, flex"].endswith(" s, not included")
    want, _ = naive_attention(q.double(), k.double(), v.double(), mask.to_dense(64, 64))
    assert (out["multihead, flex"]().double() - want).abs().max() <= FP32_OUT
    assert "multihead, tiled" not in out  # auto runs tiled here already
    out, notes = {}, {}
    kernels._add_flex_backend(out, notes, True, q, k, v, mask, None)
    assert out == {} and notes["multihead, flex"].startswith("skipped in --quick")

    def failing_compile(tag):
        def kernel(*args):
            raise RuntimeError("C++ compile error")

        return kernel

    monkeypatch.setattr(flex, "_compile", failing_compile)
    out, notes = {}, {}
    with pytest.warns(RuntimeWarning):
        kernels._add_flex_backend(out, notes, False, q, k, v, mask, None)
    assert out == {} and notes["multihead, flex"] == "skipped: RuntimeError: C++ compile error"


FIRST_WINDOW = """
import json, sys
import torch
import multihead as mh
from multihead import masks
from multihead.backends import flex, fused
q, k, v = (torch.randn(1, 2, 4096, 16) for _ in range(3))
window = masks.sliding_window(64)
assert mh.explain_backend(q, k, v, window).backend == "flex"  # the rule's choice, untimed
with torch.no_grad():
    mh.attention(q, k, v, window)
seen = {
    "built": fused.built(),
    "chosen": mh.explain_backend(q, k, v, window).backend,
    "dynamo": "torch._dynamo" in sys.modules,
    "compiles": len(flex.compile_log()),
    "supported": flex._compile_supported(),
}
import torch._dynamo
seen["torch_says"] = torch._dynamo.is_dynamo_supported()
print(json.dumps(seen))
"""


def test_the_first_long_window_call_of_a_process_compiles_nothing():
    """The first long float32 window of a new process ran 7.4 s against 0.1 s for the second:
    ``auto`` compiled flex for its measurement's proxy (5.1 s) and imported torch's compiler
    to ask whether this Python supports it (2.0 s). Now the kernel is timed against tiled, and
    the Python check (the same answer as torch's) imports nothing."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "MULTIHEAD_FUSED_AUTO": "1"}  # the measured choice, as users get it
    done = subprocess.run(
        [sys.executable, "-c", FIRST_WINDOW], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["built"]  # the install builds the kernel (tests/backends/test_kernel_install.py)
    assert seen["chosen"] == "fused"
    assert seen["compiles"] == 0 and not seen["dynamo"]
    assert seen["supported"] is seen["torch_says"] is True
