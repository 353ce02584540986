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

__all__ = ["head_heatmap", "heatmap_grid", "surface"]

_LABELS_UP_TO = 40  # more tokens than this and tick labels become unreadable
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
    # the figure stays within MAX_INCHES on each side whatever the depth and width
    cell = min(cell, (MAX_INCHES - 1.5) / len(heads), (MAX_INCHES - 1) / len(layers))
    fig = _figure(figsize=(cell * len(heads) + 1.5, cell * len(layers) + 1), layout="constrained")
    axes = fig.subplots(len(layers), len(heads), squeeze=False)
    image = None
    for r, layer in enumerate(layers):
        for c, head in enumerate(heads):
            ax = axes[r][c]
            image = ax.imshow(w[layer, head].numpy(), cmap="viridis", vmin=0.0, vmax=1.0)
            ax.set_xticks([])
            ax.set_yticks([])
            if r == 0:
                ax.set_title(f"head {head}", fontsize=8)
            if c == 0:
                ax.set_ylabel(f"layer {layer}", fontsize=8)
    if len(tokens) <= 16:  # labels on the outer edge only, where there is room
        for c in range(len(heads)):
            _label(axes[-1][c], tokens, rows=False, size=5)
        for r in range(len(layers)):
            _label(axes[r][0], tokens, cols=False, size=5)
    fig.colorbar(image, ax=axes, shrink=0.6, label="weight")
    fig.suptitle("attention weights (rows: queries, columns: keys)")
    return fig


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
