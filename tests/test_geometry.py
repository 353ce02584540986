"""The geometry masks and score modifiers share: alignment offsets, band kinds, crop windows."""

from __future__ import annotations

import pytest
import torch

from multihead import _geometry as G
from multihead import bias as mb
from multihead import masks


@pytest.mark.parametrize("align, want", [("bottom_right", 5), ("top_left", 0)])
def test_offset_places_query_zero(align, want):
    assert G.offset(align, 3, 8) == want
    # masks and score modifiers read the same offset
    assert masks.causal(align=align).visible_distances(3, 8) == (None, want)
    assert mb.alibi(2, align=align).offset(3, 8) == want


def test_band_kind_matches_the_dense_band():
    band = (-2, 1)  # key j visible from query i when -2 <= j - i <= 1
    i, j = torch.arange(12)[:, None], torch.arange(12)[None, :]
    keep = (j - i >= -2) & (j - i <= 1)
    for q0, q1, k0, k1 in [(0, 3, 0, 3), (0, 2, 6, 9), (4, 5, 3, 6), (2, 9, 0, 12)]:
        rect = keep[q0:q1, k0:k1]
        want = "empty" if not rect.any() else "full" if rect.all() else "partial"
        assert G.band_kind(band, q0, q1, k0, k1).value == want, (q0, q1, k0, k1)


def test_crops_of_masks_and_modifiers_share_one_window():
    window = G.Window(10, 12, 2, 6, 3, 12)
    assert window.shape == (4, 9) and window.shift == 1
    assert window.outer(0, 4, 0, 9) == (2, 6, 3, 12)
    assert window.inner(0, 3, 0, 5) == (0, 1, 0, 2)
    assert window.inner(7, 9, 0, 12) is None
    alibi = mb.alibi(2)
    crop = alibi.crop(10, 12, 2, 6, 3, 12)
    assert torch.equal(crop.to_dense(4, 9), alibi.to_dense(10, 12)[..., 2:6, 3:12])


def test_crops_outside_the_problem_are_refused_by_both():
    with pytest.raises(
        ValueError, match=r"crop must lie inside \(L, S\)=\(4, 4\).*queries \[0, 5\)"
    ):
        masks.causal().crop(4, 4, 0, 5, 0, 4)
    with pytest.raises(ValueError, match=r"crop must lie inside \(L, S\)=\(4, 4\).*keys \[3, 2\)"):
        mb.alibi(2).crop(4, 4, 0, 4, 3, 2)
    with pytest.raises(ValueError, match=r"cropped bias is for \(L, S\)=\(4, 4\).*\(5, 4\)"):
        mb.alibi(2).crop(8, 8, 0, 4, 0, 4).check(1, 2, 5, 4)


def test_align_is_checked_once_for_both():
    for build in (lambda: masks.causal(align="top"), lambda: mb.alibi(2, align="top")):
        with pytest.raises(ValueError, match=r"align must be 'bottom_right' or 'top_left'.*'top'"):
            build()
