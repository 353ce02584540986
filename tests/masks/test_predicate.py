"""masks.predicate(fn): lowering, tile answers, bounded evaluation, every backend, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import naive_attention, qkv
from hypothesis import given, settings
from hypothesis import strategies as st

import multihead as mh
from multihead import masks
from multihead.masks import TileKind
from multihead.masks import base as masks_base

IDS = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 3, 4, 4, 4, 4, 4, 4, 5, 5, 5, 6] * 3])
IDS = torch.cat([IDS, IDS.roll(5, dims=1)])  # [2, 72]: two batch entries, different documents


def _prefix_lm(b, h, q, k):
    return (k <= q) | (k < 5)


def _dilated(b, h, q, k):
    return ((q - k) % 3 == 0) & (k <= q)


def _per_head(b, h, q, k):
    return (q - k).abs() <= 2 * h + 1


def _same_document(b, h, q, k):
    return IDS[b, q] == IDS[b, k]


# name -> (mask, the same rule written as a loop over (b, h, i, j), B, H)
PREDICATES = {
    "prefix_lm": (masks.predicate(_prefix_lm), lambda b, h, i, j: j <= i or j < 5, 1, 1),
    "dilated": (masks.predicate(_dilated), lambda b, h, i, j: (i - j) % 3 == 0 and j <= i, 1, 1),
    "per_head": (
        masks.predicate(_per_head, num_heads=3),
        lambda b, h, i, j: abs(i - j) <= 2 * h + 1,
        1,
        3,
    ),
    "documents": (
        masks.predicate(_same_document, batch_size=2),
        lambda b, h, i, j: int(IDS[b, i]) == int(IDS[b, j]),
        2,
        1,
    ),
}


def _reference(name: str, length_q: int, length_k: int) -> torch.Tensor:
    """The rule evaluated one (b, h, i, j) at a time, in plain Python."""
    _, rule, nb, nh = PREDICATES[name]
    keep = np.zeros((nb, nh, length_q, length_k), dtype=bool)
    for b in range(nb):
        for h in range(nh):
            for i in range(length_q):
                for j in range(length_k):
                    keep[b, h, i, j] = rule(b, h, i, j)
    return torch.from_numpy(keep)


@pytest.mark.parametrize("name", PREDICATES)
def test_predicate_lowers_to_its_rule(name):
    mask, _, nb, nh = PREDICATES[name]
    want = _reference(name, 37, 53)
    got = mask.to_dense(37, 53).expand(nb, nh, 37, 53)
    assert torch.equal(got, want)
    for b in range(nb):
        block = mask.block(37, 53, 4, 29, 7, 50, batch=b).expand(1, nh, 25, 43)
        assert torch.equal(block, want[b : b + 1, :, 4:29, 7:50])


def _check_answers(mask, keep, length_q, length_k, tile, exact):
    """tile / rect_kind against the dense truth ``keep`` [B, H, L, S]: never wrong in the
    direction that matters, and exact when ``exact`` (tiles on the summary's cells)."""
    for b in range(keep.shape[0]):
        for q0 in range(0, length_q, tile):
            q1 = min(q0 + tile, length_q)
            rows = keep[b, :, q0:q1]
            cols = torch.nonzero(rows.any(dim=0).any(dim=0)).flatten()
            ans = mask.tile(length_q, length_k, q0, q1, batch=b)
            where = f"batch={b} rows=[{q0},{q1}) answer={ans}"
            if cols.numel() == 0:  # nothing to see: a finer tile than a cell may say PARTIAL
                assert ans.kind == TileKind.EMPTY or (not exact and ans.kind != TileKind.FULL), (
                    where
                )
                continue
            assert ans.kind != TileKind.EMPTY, where
            assert ans.start <= int(cols[0]) and int(cols[-1]) < ans.stop, where
            inner = rows[:, :, ans.start : ans.stop]
            assert ans.kind != TileKind.FULL or bool(inner.all()), where
            if exact:
                assert (ans.start, ans.stop) == (int(cols[0]), int(cols[-1]) + 1), where
                assert (ans.kind == TileKind.FULL) == bool(inner.all()), where
            for k0 in range(0, length_k, tile):
                k1 = min(k0 + tile, length_k)
                rect = rows[:, :, k0:k1]
                kind = mask.rect_kind(length_q, length_k, q0, q1, k0, k1, batch=b)
                want = TileKind.EMPTY if not rect.any() else TileKind.PARTIAL
                want = TileKind.FULL if rect.all() else want
                if exact:
                    assert kind == want, f"{where} keys=[{k0},{k1})"
                else:
                    assert kind in (want, TileKind.PARTIAL), f"{where} keys=[{k0},{k1})"


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    name=st.sampled_from(sorted(PREDICATES)),
    length_q=st.integers(1, 72),
    length_k=st.integers(1, 72),
    tile=st.integers(1, 40),
)
def test_tile_answers_agree_with_dense(name, length_q, length_k, tile):
    mask, _, nb, nh = PREDICATES[name]
    keep = mask.to_dense(length_q, length_k).expand(nb, nh, length_q, length_k)
    _check_answers(mask, keep, length_q, length_k, tile, exact=False)


@pytest.mark.parametrize("name", PREDICATES)
def test_tile_answers_are_exact_on_the_summary_cells(name):
    mask = PREDICATES[name][0]
    keep = _reference(name, 64, 72)
    _check_answers(mask, keep, 64, 72, masks_base._CELL, exact=True)


@pytest.mark.parametrize(
    "builtin, fn",
    [
        (masks.causal(align="top_left"), lambda b, h, q, k: k <= q),
        (
            masks.sliding_window(5, 2, align="top_left"),
            lambda b, h, q, k: (k - q >= -5) & (k - q <= 2),
        ),
    ],
    ids=["causal", "sliding_window"],
)
def test_predicate_answers_like_the_same_builtin_kind(builtin, fn):
    mask = masks.predicate(fn)
    for length_q, length_k in ((64, 64), (48, 96), (96, 48)):
        assert torch.equal(mask.to_dense(length_q, length_k), builtin.to_dense(length_q, length_k))
        for q0 in range(0, length_q, 16):
            # tiles on the summary's cells: the predicate's answer is the built-in's
            got = mask.tile(length_q, length_k, q0, q0 + 16)
            want = builtin.tile(length_q, length_k, q0, q0 + 16)
            assert got == want, (length_q, length_k, q0)


BACKENDS = ["reference", "sdpa", "tiled", "fused"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", PREDICATES)
def test_every_backend_runs_a_predicate(backend, name):
    mask = PREDICATES[name][0]
    b, h = 2, 3  # masks that fix nothing broadcast over both
    q, k, v = qkv(b, h, h, 45, 72, 8, 8)
    keep = _reference(name, 45, 72).expand(b, h, 45, 72)
    want, _ = naive_attention(q, k, v, keep)
    got = mh.attention(q, k, v, mask, backend=backend)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.mark.slow  # Inductor compiles two FlexAttention kernels on the CPU (over a minute)
def test_predicate_and_builtin_kind_give_the_same_attention_on_flex():
    builtin = masks.causal() & masks.lengths(torch.tensor([50, 31]))
    mask = masks.predicate(lambda b, h, q, k: k <= q + 8) & masks.lengths(torch.tensor([50, 31]))
    q, k, v = qkv(2, 2, 2, 64, 72, 16, 16, dtype=torch.float32)
    try:
        got = mh.attention(q, k, v, mask, backend="flex")
    except ValueError as err:  # no FlexAttention on this build / device
        pytest.skip(str(err))
    want = mh.attention(q, k, v, builtin, backend="flex")
    # the same kernel on the same visible set: only the block masks differ
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_predicate_is_evaluated_in_bounded_pieces_once_per_shape(monkeypatch):
    monkeypatch.setattr(masks_base, "_BUDGET", 1 << 14)
    seen = []

    def band(b, h, q, k):
        seen.append(torch.broadcast_shapes(b.shape, h.shape, q.shape, k.shape).numel())
        return (k - q).abs() <= 40

    mask = masks.predicate(band)
    length = 1024
    answers = [mask.tile(length, length, q0, q0 + 64) for q0 in range(0, length, 64)]
    calls = len(seen)
    assert max(seen) <= 1 << 14 < length * length  # never L x S at once
    assert answers[3] == masks.Tile(152, 296, TileKind.PARTIAL)
    assert mask.rect_kind(length, length, 512, 528, 512, 528) == TileKind.FULL
    assert mask.rect_kind(length, length, 0, 16, 512, 528) == TileKind.EMPTY
    assert len(seen) == calls  # the second question read the cached summary


def test_predicate_combines_with_builtin_kinds():
    lens = torch.tensor([20, 33])
    mask = masks.predicate(_prefix_lm) & masks.lengths(lens)
    want = _reference("prefix_lm", 40, 40) & (torch.arange(40) < lens[:, None, None, None])
    assert torch.equal(mask.to_dense(40, 40).expand(2, 1, 40, 40), want)
    assert "predicate(_prefix_lm) & lengths" in repr(mask)


def test_predicate_repr_draws_its_picture():
    text = repr(masks.predicate(_prefix_lm))
    assert text.splitlines()[0] == "predicate(_prefix_lm)"
    assert "#####." in text


def test_predicate_rejects_bad_functions_and_sizes():
    with pytest.raises(TypeError, match=r"takes a function fn\(b, h, q, k\).*Received: .*int"):
        masks.predicate(3)
    q, k, v = qkv(3, 2, 2, 6, 6, 4, 4)
    with pytest.raises(ValueError, match=r"batch_size must be .*Received: batch_size=0"):
        masks.predicate(_prefix_lm, batch_size=0)
    with pytest.raises(ValueError, match=r"built for a batch size of 2 .*Received: B=3"):
        mh.attention(q, k, v, masks.predicate(_same_document, batch_size=2))
    with pytest.raises(ValueError, match=r"built for a head count of 3 .*Received: H=2"):
        mh.attention(q, k, v, masks.predicate(_per_head, num_heads=3))


def _two_args(q, k):
    return k <= q


def test_the_function_is_checked_when_the_mask_is_made():
    """Each of these was accepted, then failed inside the first backend with a raw TypeError
    or "Boolean value of Tensor with more than one value is ambiguous"."""
    with pytest.raises(
        TypeError,
        match=r"takes a function of four index tensors, fn\(b, h, q, k\) -> bool tensor .*"
        r"Received: _two_args\(q, k\)$",
    ):
        masks.predicate(_two_args)
    with pytest.raises(
        TypeError,
        match=r"combines its conditions with & \| ~ \(elementwise\), not with Python's and / or "
        r"/ not.*\(k <= q\) & \(k > q - 4\).*Received: <lambda> raised 'Boolean value of Tensor",
    ):
        masks.predicate(lambda b, h, q, k: (k <= q) and (k > q - 4))
    with pytest.raises(TypeError, match=r"must return a bool tensor.*Received: dtype torch.int64"):
        masks.predicate(lambda b, h, q, k: k - q)
    with pytest.raises(TypeError, match=r"must return a bool tensor.*Received: bool"):
        masks.predicate(lambda b, h, q, k: True)
    with pytest.raises(
        ValueError,
        match=r"combine its index tensors elementwise .* \(1, 1, 1, 7\), each dimension of its "
        r"result must be 1 or that index's size\. Received: shape \(5, 7, 1, 1\)",
    ):
        masks.predicate(lambda b, h, q, k: (k <= q).transpose(0, 2).transpose(1, 3))


# block answers drawn per (batch entry, head): 16 x 16 blocks, each visible or not
_TABLE = torch.rand(2, 2, 3, 5, generator=torch.Generator().manual_seed(0)) < 0.5
_TABLE[..., 0] = True  # every query sees its first block of keys


def _blocks(b, h, q, k):
    return _TABLE[b, h, q // 16, k // 16]


def _blocks_truth(length_q, length_k):
    i, j = np.arange(length_q)[:, None], np.arange(length_k)[None]
    return torch.from_numpy(_TABLE.numpy()[:, :, i // 16, j // 16])


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_predicate_of_b_and_h_is_never_silently_wrong(backend):
    """Before, a predicate that depends on the batch entry and the head, made without
    batch_size= and num_heads=, was evaluated for b = 0 and h = 0 alone: every backend was off
    by 0.89 against the rule. It is refused now; with both sizes every backend is exact."""
    q, k, v = qkv(2, 2, 2, 45, 72, 8, 8)
    want, _ = naive_attention(q, k, v, _blocks_truth(45, 72))
    try:
        mask = masks.predicate(_blocks)
    except ValueError:
        mask = None  # refused: the other way of never being silently wrong
    if mask is not None:
        got = mh.attention(q, k, v, mask, backend=backend)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    exact = masks.predicate(_blocks, batch_size=2, num_heads=2)
    torch.testing.assert_close(
        mh.attention(q, k, v, exact, backend=backend), want, rtol=0, atol=1e-12
    )
    assert torch.equal(exact.to_dense(45, 72), _blocks_truth(45, 72))


def test_a_predicate_of_b_or_h_names_the_sizes_it_needs():
    with pytest.raises(
        ValueError,
        match=r"_blocks depends on b and h \(its result varies along those axes\), so the mask "
        r"must be told B and H, or backends would evaluate it for b = 0 and h = 0 alone: pass "
        r"predicate\(fn, batch_size=B, num_heads=H\) with the inputs' sizes\. "
        r"Received: batch_size=None, num_heads=None",
    ):
        masks.predicate(_blocks)
    with pytest.raises(ValueError, match=r"_per_head depends on h .*Received: num_heads=None$"):
        masks.predicate(_per_head)
    with pytest.raises(ValueError, match=r"_same_document depends on b .*batch_size=B\)"):
        masks.predicate(_same_document)
    with pytest.raises(ValueError, match=r"_blocks depends on h .*Received: num_heads=None$"):
        masks.predicate(_blocks, batch_size=2)
