"""Each figure renders to a PNG of the expected size that is not blank."""

from __future__ import annotations

import pytest
import torch

from multihead.viz import head_heatmap, heatmap_grid, surface

pytest.importorskip("matplotlib")
TOKENS = ["[CLS]", "the", "cat", "sat", ".", "[SEP]"]


def _weights(layers=2, heads=3, n=6):
    torch.manual_seed(0)
    return torch.rand(layers, heads, n, n).softmax(-1)


def _png(fig, path, dpi=50):
    import numpy as np
    from PIL import Image

    fig.savefig(path, dpi=dpi)
    with Image.open(path) as im:
        return im.size, torch.from_numpy(np.asarray(im.convert("L"), dtype=np.float32))


@pytest.mark.parametrize(
    ("name", "make", "inches"),
    [
        ("grid", lambda w: heatmap_grid(w, TOKENS), (3 * 1.6 + 1.5, 2 * 1.6 + 1)),
        ("head", lambda w: head_heatmap(w[1, 2], TOKENS, title="layer 1 head 2"), (5.7, 4.7)),
        ("surface", lambda w: surface(w[0, 0], TOKENS, title="surface"), (8, 6.5)),
    ],
    ids=["grid", "head", "surface"],
)
def test_figure_renders(tmp_path, name, make, inches):
    size, pixels = _png(make(_weights()), tmp_path / f"{name}.png")
    assert size == (round(inches[0] * 50), round(inches[1] * 50))
    assert pixels.std() > 20  # not a blank page: real dark and light regions
    assert (pixels < 128).float().mean() > 0.02


def test_head_heatmap_writes_values_for_short_inputs():
    w = _weights()[0, 0]
    fig = head_heatmap(w, TOKENS)
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert len(texts) == 36 and f"{float(w[2, 3]):.2f}" in texts
    assert not head_heatmap(w, TOKENS, values=False).axes[0].texts


def test_grid_subsets_and_labels():
    """The grid's one image holds each chosen head's weights where grid_cells places them,
    background between them; the heads are named on top, the layers on the right."""
    import numpy as np

    from multihead.viz import grid_cells

    w = _weights()
    fig = heatmap_grid(w, TOKENS, layers=[1], heads=[0, 2])
    images = [ax for ax in fig.axes if ax.images]
    assert len(images) == 1
    mosaic = np.asarray(images[0].images[0].get_array().filled(np.nan))
    places = grid_cells(6, 1, 2)
    assert places == [[(0, 0), (0, 7)]] and mosaic.shape == (6, 13)
    for (top, left), head in zip(places[0], [0, 2]):
        assert np.array_equal(mosaic[top : top + 6, left : left + 6], w[1, head].numpy())
    assert np.isnan(mosaic[:, 6]).all()
    axes = [*fig.axes, *images[0].child_axes]  # the heads' and layers' axes are the image's
    texts = [t.get_text() for ax in axes for t in ax.get_xticklabels() + ax.get_yticklabels()]
    assert {"head 0", "head 2", "layer 1"} <= set(texts) and "head 1" not in texts
    assert texts.count("cat") == 3  # under each head, and down the left


def test_bad_figure_input():
    with pytest.raises(ValueError, match=r"one label per position \(6\)"):
        head_heatmap(_weights()[0, 0], TOKENS[:2])
    with pytest.raises(ValueError, match=r"one head's \(L, L\)"):
        surface(_weights()[0], TOKENS)
