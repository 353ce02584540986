"""Figures of attention weights: a layers x heads grid, one head with its values, a 3-D surface,
and (``multihead.viz.html``) a self-contained interactive head view.

Figures are built on ``matplotlib.figure.Figure`` directly (no pyplot state), so they work in
scripts, servers and tests alike; save them with ``fig.savefig(path)``. Needs the ``viz`` extra.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from torch import Tensor

from ..inspect import _check, _check_tokens

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["grid_cells", "head_heatmap", "heatmap_grid", "surface"]

_VALUES_UP_TO = 16  # write the value in each cell up to this many tokens
MAX_INCHES = 20.0  # no figure side is longer, whatever the model's depth or the text's length
_LABELS_UP_TO = 64  # token labels on the axes up to this many tokens


def _figure(**kwargs) -> Figure:
    try:
        from matplotlib.figure import Figure
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "multihead.viz needs matplotlib; install it with pip install 'multihead[viz]'"
        ) from err
    return Figure(**kwargs)


def _square(weights: Tensor, tokens: Sequence[str]) -> Tensor:
    if (
        not isinstance(weights, Tensor)
        or weights.dim() != 2
        or weights.shape[0] != weights.shape[1]
    ):
        shape = tuple(weights.shape) if isinstance(weights, Tensor) else type(weights).__name__
        raise ValueError(f"weights must be one head's (L, L). Received: weights.shape={shape}")
    _check_tokens(tokens, weights.shape[-1])
    return weights.detach().float().cpu()


def _label(ax, tokens: Sequence[str], *, rows: bool = True, cols: bool = True, size=7) -> None:
    n = len(tokens)
    if n > _LABELS_UP_TO:
        return
    if cols:
        ax.set_xticks(range(n), tokens, rotation=90, fontsize=size)
    if rows:
        ax.set_yticks(range(n), tokens, fontsize=size)


def heatmap_grid(
    weights: Tensor,
    tokens: Sequence[str],
    *,
    layers: Sequence[int] | None = None,
    heads: Sequence[int] | None = None,
    cell: float = 1.6,
) -> Figure:
    """A grid of heatmaps, one row per layer and one column per head.

    The grid is one image on one set of axes, the heatmaps side by side with a gap of
    background between them (``grid_cells`` gives each one's place): one axes per head, as
    BERT-base's 6 x 12 heads would take, makes matplotlib's layout the figure's main cost.
    Heads are named along the top, layers down the right; up to 16 tokens their labels run
    along the outer edges.

    Args:
        weights: (layers, H, L, L) of one sequence (see ``multihead.inspect.for_text``).
        tokens: the L token labels (queries down, keys across).
        layers, heads: subsets to draw (default all).
        cell: inches per heatmap.
    """
    w = _check(weights).detach().float().cpu()
    _check_tokens(tokens, w.shape[-1])
    layers = list(range(w.shape[0])) if layers is None else list(layers)
    heads = list(range(w.shape[1])) if heads is None else list(heads)
    n = w.shape[-1]
    # the figure stays within MAX_INCHES on each side whatever the depth and width
    cell = min(cell, (MAX_INCHES - 1.5) / len(heads), (MAX_INCHES - 1) / len(layers))
    fig = _figure(figsize=(cell * len(heads) + 1.5, cell * len(layers) + 1), layout="constrained")
    ax = fig.subplots()
    places = grid_cells(n, len(layers), len(heads))
    image = ax.imshow(_mosaic(w, layers, heads, places), cmap="viridis", vmin=0.0, vmax=1.0,
                      interpolation="nearest")  # fmt: skip
    for side in ax.spines.values():
        side.set_visible(False)
    _grid_labels(ax, tokens, layers, heads, places)
    fig.colorbar(image, ax=ax, shrink=0.6, label="weight", pad=0.06)
    fig.suptitle("attention weights (rows: queries, columns: keys)")
    return fig


def _mosaic(w: Tensor, layers: list[int], heads: list[int], places):
    """The one image of ``heatmap_grid``: each (layer, head) heatmap at its place, NaN (the
    background) between them."""
    import numpy as np

    n = w.shape[-1]
    mosaic = np.full((places[-1][-1][0] + n, places[-1][-1][1] + n), np.nan, dtype=np.float32)
    for r, layer in enumerate(layers):
        for c, head in enumerate(heads):
            top, left = places[r][c]
            mosaic[top : top + n, left : left + n] = w[layer, head].numpy()
    return mosaic


def _grid_labels(ax, tokens: Sequence[str], layers: list[int], heads: list[int], places) -> None:
    """Heads along the top and layers down the right of ``heatmap_grid``'s axes (secondary
    axes), token labels on the outer edges up to 16 tokens."""
    n = len(tokens)
    rows = [places[r][0][0] for r in range(len(layers))]
    cols = [places[0][c][1] for c in range(len(heads))]
    middle = (n - 1) / 2
    top = ax.secondary_xaxis("top")
    top.set_xticks([x + middle for x in cols], [f"head {h}" for h in heads], fontsize=8)
    right = ax.secondary_yaxis("right")
    right.set_yticks([y + middle for y in rows], [f"layer {layer}" for layer in layers],
                     fontsize=8, rotation=90, va="center")  # fmt: skip
    for secondary in (top, right):
        secondary.tick_params(length=0)
        for side in secondary.spines.values():
            side.set_visible(False)
    if n <= 16:  # token labels on the outer edge only, where there is room
        ax.set_xticks([x + i for x in cols for i in range(n)], list(tokens) * len(cols),
                      rotation=90, fontsize=5)  # fmt: skip
        ax.set_yticks([y + i for y in rows for i in range(n)], list(tokens) * len(rows),
                      fontsize=5)  # fmt: skip
        ax.tick_params(length=0)
    else:
        ax.set_xticks([])
        ax.set_yticks([])


def grid_cells(n: int, layers: int, heads: int) -> list[list[tuple[int, int]]]:
    """Where ``heatmap_grid`` puts each (L, L) heatmap in its one image: (top row, left
    column) of the heatmap of grid row r (a layer) and column c (a head), the heatmaps
    ``max(1, n // 6)`` background pixels apart."""
    step = n + max(1, n // 6)
    return [[(r * step, c * step) for c in range(heads)] for r in range(layers)]


def head_heatmap(
    weights: Tensor, tokens: Sequence[str], *, title: str = "", values: bool | None = None
) -> Figure:
    """One head's (L, L) weights with token labels; ``values`` writes each weight in its cell
    (default: when L <= 16)."""
    w = _square(weights, tokens)
    n = w.shape[0]
    values = n <= _VALUES_UP_TO if values is None else values
    size = min(MAX_INCHES - 1, max(4.0, 0.45 * n + 2))  # capped whatever L
    fig = _figure(figsize=(size + 1, size), layout="constrained")
    ax = fig.subplots()
    image = ax.imshow(w.numpy(), cmap="Blues", vmin=0.0, vmax=1.0)
    if n <= _LABELS_UP_TO:
        _label(ax, tokens, size=8)
    ax.set_xlabel("key (attended to)")
    ax.set_ylabel("query (attending)")
    if values:
        for i in range(n):
            for j in range(n):
                v = float(w[i, j])
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=6,
                        color="white" if v > 0.5 else "black")  # fmt: skip
    fig.colorbar(image, ax=ax, shrink=0.8, label="weight")
    if title:
        ax.set_title(title)
    return fig


def surface(weights: Tensor, tokens: Sequence[str], *, title: str = "") -> Figure:
    """One head's (L, L) weights as a 3-D surface over (key, query)."""
    import numpy as np

    w = _square(weights, tokens).numpy()
    n = w.shape[0]
    fig = _figure(figsize=(8, 6.5), layout="constrained")
    ax = fig.add_subplot(projection="3d")
    keys, queries = np.meshgrid(np.arange(n), np.arange(n))
    ax.plot_surface(keys, queries, w, cmap="viridis", linewidth=0, antialiased=True)
    _label(ax, tokens, size=6)
    ax.set_xlabel("key", labelpad=12)
    ax.set_ylabel("query", labelpad=12)
    ax.set_zlabel("weight")
    ax.set_zlim(0, max(1e-6, float(w.max())))
    if title:
        ax.set_title(title)
    return fig
