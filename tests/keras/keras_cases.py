"""Shared cases for the Keras tests: layer layouts, random Keras layers, inputs, masks."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# the fp32 rule (docs/design.md, "Error rules"): both sides compute the same
# softmax(QK^T / sqrt(D)) V in float32 with different summation orders; measured differences
# are below 1e-6.
TOL = 1e-5


@dataclass(frozen=True)
class Layout:
    """A Keras layer's arguments and the input widths and lengths it is called with."""

    name: str
    num_heads: int
    key_dim: int
    value_dim: int | None = None
    output_shape: int | None = None
    e: int = 12  # query width E
    kdim: int | None = None  # key width (None: the key is the value)
    vdim: int = 12  # value width
    length_q: int = 5
    length_k: int = 5
    self_attention: bool = False


LAYOUTS = [
    Layout("self", 3, 4, self_attention=True),
    Layout("cross-L<S", 3, 4, length_q=4, length_k=7, vdim=6, kdim=8),
    Layout("cross-L>S", 2, 6, length_q=7, length_k=3),
    Layout("key_dim-not-E/H", 3, 5, e=10, vdim=10),
    Layout("value_dim", 3, 4, value_dim=6),
    Layout("output_shape", 3, 4, output_shape=7),
    Layout("all", 4, 3, value_dim=5, output_shape=9, e=10, kdim=6, vdim=8, length_k=6),
]


def keras_layer(keras, layout: Layout, use_bias: bool = True, seed: int = 0, **kwargs):
    """A built Keras MultiHeadAttention with random weights (biases too)."""
    layer = keras.layers.MultiHeadAttention(
        num_heads=layout.num_heads,
        key_dim=layout.key_dim,
        value_dim=layout.value_dim,
        output_shape=layout.output_shape,
        use_bias=use_bias,
        **kwargs,
    )
    key_shape = None if layout.kdim is None else (None, None, layout.kdim)
    layer.build((None, None, layout.e), (None, None, layout.vdim), key_shape)
    rng = np.random.default_rng(seed)
    for w in layer.weights:
        w.assign(rng.normal(0.0, 0.5, w.shape).astype("float32"))
    return layer


def inputs(layout: Layout, batch: int = 3, seed: int = 1):
    """(query, value, key) float32 tensors; key is None when the layout has none."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, layout.length_q, layout.e, generator=g)
    if layout.self_attention:
        return q, q, None
    v = torch.randn(batch, layout.length_k, layout.vdim, generator=g)
    k = (
        None
        if layout.kdim is None
        else torch.randn(batch, layout.length_k, layout.kdim, generator=g)
    )
    return q, v, k


def random_keras_mask(batch: int, length_q: int, length_k: int, seed: int = 2) -> torch.Tensor:
    """A (B, L, S) Keras mask (True = attend) in which every query keeps key 0."""
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(batch, length_q, length_k, generator=g) > 0.4
    keep[..., 0] = True  # no fully-masked row here: that convention differs on purpose
    return keep
