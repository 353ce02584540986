"""Masks: dense lowering against definitions written out independently, tile answers, converters."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from helpers import COMBOS, MASK_KINDS, make_case
from hypothesis import given, settings
from hypothesis import strategies as st

from multihead import masks
from multihead.masks import TileKind

SHAPES = [(5, 5), (4, 9), (9, 4), (1, 7), (13, 1)]
KINDS = [k for k in MASK_KINDS if k != "none"]


@pytest.mark.parametrize("length_q,length_k", SHAPES, ids=[f"L{a}-S{b}" for a, b in SHAPES])
@pytest.mark.parametrize("kind", KINDS)
def test_dense_lowering_matches_definition(kind, length_q, length_k):
    case = make_case(kind, 3, 2, length_q, length_k)
    got = case.mask.to_dense(length_q, length_k)
    torch.testing.assert_close(
        got.expand(3, 2, length_q, length_k), case.keep.expand(3, 2, length_q, length_k)
    )


def test_block_is_a_slice_of_dense():
    case = make_case("documents&causal", 2, 1, 11, 11)
    full = case.mask.to_dense(11, 11)
    part = case.mask.block(11, 11, 3, 8, 2, 10, batch=1)
    assert torch.equal(part[0], full[1, :, 3:8, 2:10])


def _check_tiles(kind, b, length_q, length_k, tile, seed):
    case = make_case(kind, b, 2, length_q, length_k, seed=seed)
    keep = case.keep.expand(b, 2, length_q, length_k)
    exact = kind not in COMBOS
    for batch in range(b):
        for q0 in range(0, length_q, tile):
            q1 = min(q0 + tile, length_q)
            block = keep[batch, :, q0:q1]  # [h, rows, S]
            cols = torch.nonzero(block.any(dim=0).any(dim=0)).flatten()
            ans = case.mask.tile(length_q, length_k, q0, q1, batch=batch)
            where = f"{kind} batch={batch} rows=[{q0},{q1}) answer={ans}"
            if ans.kind == TileKind.EMPTY:
                assert cols.numel() == 0, where
                assert ans.start == ans.stop, where
                continue
            assert 0 <= ans.start < ans.stop <= length_k, where
            if cols.numel():
                assert ans.start <= int(cols[0]) and int(cols[-1]) < ans.stop, where
            inner = block[:, :, ans.start : ans.stop]
            if ans.kind == TileKind.FULL:
                assert bool(inner.all()), where
            every_row_sees = bool(block.any(dim=-1).all())
            if exact and every_row_sees:
                assert (ans.start, ans.stop) == (int(cols[0]), int(cols[-1]) + 1), where
                assert (ans.kind == TileKind.FULL) == bool(inner.all()), where


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    kind=st.sampled_from(KINDS),
    b=st.integers(1, 3),
    length_q=st.integers(1, 40),
    length_k=st.integers(1, 40),
    tile=st.integers(1, 16),
    seed=st.integers(0, 1000),
)
def test_tile_answers_agree_with_dense(kind, b, length_q, length_k, tile, seed):
    _check_tiles(kind, b, length_q, length_k, tile, seed)


@pytest.mark.parametrize("kind", KINDS)
def test_tile_answers_on_a_fixed_grid(kind):
    for tile in (1, 3, 8):
        _check_tiles(kind, 3, 17, 23, tile, seed=7)
        _check_tiles(kind, 3, 23, 17, tile, seed=8)


def test_tiles_skip_and_fill_as_expected():
    window = masks.sliding_window(4)
    # rows 0..7 of a 64 x 64 window see keys 0..7 only
    assert window.tile(64, 64, 0, 8) == masks.Tile(0, 8, TileKind.PARTIAL)
    # a query tile of 1 row inside the band is fully visible
    assert window.tile(64, 64, 20, 21) == masks.Tile(16, 21, TileKind.FULL)
    lens = masks.lengths(torch.tensor([5, 0]))
    assert lens.tile(4, 8, 0, 4, batch=0) == masks.Tile(0, 5, TileKind.FULL)
    assert lens.tile(4, 8, 0, 4, batch=1).kind == TileKind.EMPTY
    # bottom-right causal with L > S: the first L - S queries see nothing
    assert masks.causal().tile(10, 4, 0, 6).kind == TileKind.EMPTY


def test_repr_draws_a_picture():
    text = repr(masks.causal())
    assert text.splitlines()[0] == "causal(align='bottom_right')"
    assert "###..." in text and "######" in text
    docs = repr(masks.documents(torch.tensor([0, 0, 1])))
    assert "##." in docs and "..#" in docs
    assert masks.sliding_window(1).to_string(3, 3) == "#..\n##.\n.##"


def _drawn(mask) -> tuple[str, torch.Tensor]:
    """The header line of repr(mask) with its size, and batch entry 0's picture as a bool
    tensor (True for "#")."""
    return _header(mask), _pictures(mask)[0][0]


def _header(mask) -> str:
    return repr(mask).splitlines()[1]


def _pictures(mask) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each drawn batch entry's picture as (every pair visible "#", some pair visible "#"
    or "+") bool tensors."""
    groups, rows = [], []
    for line in repr(mask).splitlines()[2:]:
        line = line.strip()
        if line.startswith("batch "):
            if rows:
                groups.append(rows)
            rows = []
        else:
            rows.append(line)
    groups.append(rows)
    return [
        (torch.tensor([[c == "#" for c in r] for r in g]),
         torch.tensor([[c in "#+" for c in r] for r in g]))
        for g in groups
    ]  # fmt: skip


def _expected(mask, length_q, length_k, rows, cols):
    keep = mask.to_dense(length_q, length_k)[0, 0].expand(length_q, length_k)
    return keep[:rows, :cols]


def _scaled(keep: torch.Tensor, step_q: int, step_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(every, some) over blocks of step_q x step_k of an (L, S) bool tensor, written as loops."""
    length_q, length_k = keep.shape
    rows, cols = -(-length_q // step_q), -(-length_k // step_k)
    every = torch.zeros(rows, cols, dtype=torch.bool)
    some = torch.zeros(rows, cols, dtype=torch.bool)
    for r in range(rows):
        for c in range(cols):
            block = keep[r * step_q : (r + 1) * step_q, c * step_k : (c + 1) * step_k]
            every[r, c], some[r, c] = bool(block.all()), bool(block.any())
    return every, some


# the masks the new user's tour printed (each raised RuntimeError): their tensors fix L or S
# or both, and the picture must use those sizes
SIZED = {
    "key_padding": (masks.key_padding(torch.tensor([[True, True, False]])), 4, 3),
    "lengths_per_query": (masks.lengths(torch.tensor([[1, 2, 3]])), 3, 6),
    "dense_broadcast_query": (masks.dense(torch.ones(1, 1, 1, 5, dtype=torch.bool)), 4, 5),
    "causal&key_padding": (
        masks.causal() & masks.key_padding(torch.tensor([[True, True, False]])),
        4,
        3,
    ),
    "lengths_longer_than_the_example": (masks.lengths(torch.tensor([9, 3])), 9, 9),
    "query_lens": (masks.lengths(torch.tensor([2, 3]), torch.tensor([5, 1])), 5, 6),
    "documents": (masks.documents(torch.tensor([[0, 0, 1]])), 3, 3),
}


@pytest.mark.parametrize("name", list(SIZED))
def test_repr_draws_masks_at_the_size_their_tensors_fix(name):
    mask, length_q, length_k = SIZED[name]
    header, picture = _drawn(mask)
    assert f"L={length_q}" in header and f"S={length_k}" in header
    assert torch.equal(picture, _expected(mask, length_q, length_k, length_q, length_k))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("length_q,length_k", [(3, 7), (30, 70)], ids=["small", "scaled"])
def test_repr_works_for_every_kind_and_shape(kind, length_q, length_k):
    mask = make_case(kind, 2, 2, length_q, length_k).mask
    header = _header(mask)
    size = re.search(r"L=(\d+).*S=(\d+)", header)
    drawn_q, drawn_k = int(size.group(1)), int(size.group(2))
    step_q, step_k = -(-drawn_q // 16), -(-drawn_k // 48)
    keep = mask.to_dense(drawn_q, drawn_k).expand(-1, -1, drawn_q, drawn_k)
    pictures = _pictures(mask)
    assert len(pictures) == min(mask.batch_size or 1, 2)
    for b, (every, some) in enumerate(pictures):
        want_every, want_some = _scaled(keep[b if keep.shape[0] > 1 else 0, 0], step_q, step_k)
        assert torch.equal(every, want_every) and torch.equal(some, want_some), b
    if (step_q, step_k) != (1, 1):
        assert f"one character per {step_q} queries x {step_k} keys" in header


def test_print_shows_the_structure_of_a_large_mask():
    """getting-started's mask printed a 4 x 48 corner that was all "#" before: it is drawn
    whole now, scaled, for each batch entry, so the causal edge and the shorter second
    sequence show."""
    mask = masks.causal() & masks.lengths(torch.tensor([120, 75]))
    header = _header(mask)
    assert header.startswith("  e.g. L=120, S=120; one character per 8 queries x 3 keys (# = all")
    i, j = np.arange(120)[:, None], np.arange(120)[None]
    for b, length in enumerate((120, 75)):
        truth = torch.from_numpy((j <= i) & (j < length))  # bottom-right with L = S: j <= i
        every, some = _pictures(mask)[b]
        assert (torch.equal(every, _scaled(truth, 8, 3)[0])
                and torch.equal(some, _scaled(truth, 8, 3)[1])), b  # fmt: skip
        assert every.any() and not some.all()  # "#" and "." both there: the structure shows
    _, some = _pictures(mask)[1]
    assert not some[:, 25:].any()  # no key at or past 75 seen in batch entry 1


def test_repr_of_masks_that_disagree_on_a_size_says_so():
    mask = masks.dense(torch.ones(3, 4, dtype=torch.bool)) & masks.key_padding(
        torch.ones(1, 5, dtype=torch.bool)
    )
    assert "not drawn: cannot combine masks with different key lengths" in repr(mask)


def test_top_left_and_bottom_right_agree_when_square():
    a = masks.causal().to_dense(6, 6)
    b = masks.causal(align="top_left").to_dense(6, 6)
    assert torch.equal(a, b)
    assert not torch.equal(
        masks.causal().to_dense(3, 6), masks.causal(align="top_left").to_dense(3, 6)
    )


def test_from_torch_bool_masks_flip_polarity():
    blocked = torch.tensor([[False, True], [False, False]])
    kpm = torch.tensor([[False, True], [False, False]])
    mask, bias = masks.from_torch(attn_mask=blocked, key_padding_mask=kpm)
    assert bias is None
    expected = (~blocked)[None, None] & (~kpm)[:, None, None, :]
    assert torch.equal(mask.to_dense(2, 2).expand(2, 1, 2, 2), expected)


def test_from_torch_float_masks_split_into_mask_and_bias():
    am = torch.tensor([[0.5, -torch.inf], [0.0, 2.0]])
    kpm = torch.tensor([[0.0, -1.0]])
    mask, bias = masks.from_torch(attn_mask=am, key_padding_mask=kpm)
    assert torch.equal(mask.to_dense(2, 2)[0, 0], torch.tensor([[True, False], [True, True]]))
    assert torch.equal(bias, torch.tensor([[[[0.5, -1.0], [0.0, 1.0]]]]))


def test_from_torch_3d_mask_needs_num_heads():
    m3 = torch.zeros(2 * 3, 4, 5, dtype=torch.bool)
    m3[4, 1, 2] = True  # batch 1, head 1, query 1, key 2 blocked
    with pytest.raises(ValueError, match=r"pass num_heads=H"):
        masks.from_torch(attn_mask=m3)
    mask, _ = masks.from_torch(attn_mask=m3, num_heads=3)
    keep = mask.to_dense(4, 5)
    assert keep.shape == (2, 3, 4, 5)
    assert not keep[1, 1, 1, 2] and int((~keep).sum()) == 1
    with pytest.raises(ValueError, match=r"B \* num_heads"):
        masks.from_torch(attn_mask=m3, num_heads=4)


def test_from_torch_rejects_bad_input():
    with pytest.raises(TypeError, match=r"bool \(True = blocked\) or float"):
        masks.from_torch(attn_mask=torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"finite values and -inf only"):
        masks.from_torch(attn_mask=torch.tensor([[torch.nan, 0.0]]))
    with pytest.raises(ValueError, match=r"key_padding_mask must be a 2-D \(B, S\)"):
        masks.from_torch(key_padding_mask=torch.zeros(2, dtype=torch.bool))
    assert masks.from_torch() == (None, None)


def test_from_keras():
    km = torch.tensor([[[1, 0, 1], [1, 1, 0]]])
    keep = masks.from_keras(km).to_dense(2, 3)
    assert torch.equal(keep, km.bool()[:, None])
    with pytest.raises(ValueError, match=r"\(B, L, S\) \(attention_mask\) or \(B, S\)"):
        masks.from_keras(torch.ones(3, dtype=torch.int64))
    with pytest.raises(TypeError, match=r"bool or integer"):
        masks.from_keras(torch.ones(1, 2, 3))


def test_combining_masks_with_different_batch_sizes_fails():
    with pytest.raises(ValueError, match=r"different batch sizes"):
        masks.lengths(torch.tensor([1, 2])) & masks.lengths(torch.tensor([1, 2, 3]))
    with pytest.raises(TypeError, match=r"combine only with other masks"):
        masks.causal() & 3


def test_mask_constructors_reject_bad_arguments():
    with pytest.raises(ValueError, match=r"before must be >= 0"):
        masks.sliding_window(-1)
    with pytest.raises(TypeError, match=r"before must be an int"):
        masks.sliding_window(1.5)
    with pytest.raises(ValueError, match=r"align must be 'bottom_right' or 'top_left'"):
        masks.causal(align="left")
    with pytest.raises(TypeError, match=r"valid_lens must be an integer tensor"):
        masks.lengths(torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match=r"valid_lens must have shape \(B,\) or \(B, L\)"):
        masks.lengths(torch.ones(1, 2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"key_padding\(keep\) takes a \(B, S\)"):
        masks.key_padding(torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"a dense mask must be 2-D .* use masks.key_padding"):
        masks.dense(torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"from_torch\(\.\.\., num_heads=H\)"):
        masks.dense(torch.ones(2, 3, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"same batch size"):
        masks.documents(torch.zeros(2, 3, dtype=torch.long), torch.zeros(3, 4, dtype=torch.long))


@pytest.mark.parametrize("kind", [k for k in MASK_KINDS if k != "none"])
@pytest.mark.parametrize("shape", [(5, 8), (8, 5), (6, 6)], ids=["L<S", "L>S", "L=S"])
def test_mask_mod_predicate_equals_the_dense_mask(kind, shape):
    length_q, length_k = shape
    case = make_case(kind, 2, 3, length_q, length_k, seed=1)
    b, h, i, j = torch.meshgrid(
        torch.arange(2), torch.arange(3), torch.arange(length_q), torch.arange(length_k),
        indexing="ij",
    )  # fmt: skip
    got = case.mask.mask_mod(length_q, length_k)(b, h, i, j)
    assert torch.equal(got, case.keep.expand(2, 3, length_q, length_k))


def test_masks_describe_themselves_to_planners():
    assert masks.sliding_window(3).structure_key == ("band", 3, 0, "bottom_right")
    combined = masks.causal() & masks.sliding_window(4, align="top_left")
    assert combined.structure_key == (
        "&",
        ("band", None, 0, "bottom_right"),
        ("band", 4, 0, "top_left"),
    )
    assert (masks.causal() & masks.lengths(torch.tensor([2]))).structure_key is None
    assert masks.causal().torch_is_causal(4, 4) and not masks.causal().torch_is_causal(3, 4)
    assert masks.causal(align="top_left").torch_is_causal(3, 4)
    assert not masks.sliding_window(2).torch_is_causal(4, 4)
    assert masks.key_padding(torch.ones(1, 4, dtype=torch.bool)).tile_rows(9, 4) == 9
    assert masks.sliding_window(100, 28).tile_rows(1000, 1000) == 128
    assert masks.dense(torch.ones(2, 2, dtype=torch.bool)).arbitrary
    assert (masks.causal() | masks.dense(torch.ones(2, 2, dtype=torch.bool))).arbitrary
    assert not masks.causal().arbitrary
    ids = torch.tensor([0, 0, 1, 1, 1])
    assert masks.documents(ids).blocks(5, 5) == [(0, 2, 0, 2), (2, 5, 2, 5)]
    assert masks.causal().blocks(5, 5) is None


def test_band_masks_report_their_visible_distances():
    assert masks.causal().visible_distances(3, 7) == (None, 4)
    assert masks.causal(align="top_left").visible_distances(3, 7) == (None, 0)
    assert masks.sliding_window(2, 1).visible_distances(5, 5) == (-2, 1)
    both = masks.causal() & masks.sliding_window(3, 5)
    assert both.visible_distances(4, 4) == (-3, 0)
    assert (masks.causal() | masks.sliding_window(3)).visible_distances(4, 4) is None
    assert masks.lengths(torch.tensor([2])).visible_distances(4, 4) is None
    for m in (masks.causal(), masks.sliding_window(2, 1), both):
        lo, hi = m.visible_distances(5, 7)
        d = torch.arange(7)[None, :] - torch.arange(5)[:, None]
        want = (d >= (lo if lo is not None else -99)) & (d <= (hi if hi is not None else 99))
        assert torch.equal(m.to_dense(5, 7)[0, 0], want)
