"""multihead.keras.from_keras / to_keras against the real keras.layers.MultiHeadAttention.

Keras 3 on the torch backend is the reference: random weights (biases included, since Keras
initializes them to zero), outputs and per-head scores compared in float32.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from keras_cases import LAYOUTS, TOL, Layout, inputs, keras_layer, random_keras_mask

import multihead
from multihead import MultiHeadAttention, masks
from multihead.keras import from_keras, to_keras

MASK_MODES = ["none", "attention_mask", "causal", "attention_mask+causal"]


@pytest.mark.parametrize("mode", MASK_MODES)
@pytest.mark.parametrize("use_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay.name)
def test_from_keras_parity(keras, layout, use_bias, mode):
    theirs = keras_layer(keras, layout, use_bias)
    ours = from_keras(theirs)
    assert (ours.head_dim, ours.value_head_dim) == (
        layout.key_dim,
        layout.value_dim or layout.key_dim,
    )
    q, v, k = inputs(layout)
    am = random_keras_mask(3, layout.length_q, layout.length_k) if "attention" in mode else None
    causal = "causal" in mode
    keras_kwargs = {"attention_mask": am, "use_causal_mask": causal}
    want, want_scores = theirs(q, v, k, return_attention_scores=True, **keras_kwargs)
    want_fused = theirs(q, v, k, **keras_kwargs)  # Keras' other path (its dot_product_attention)

    parts = []
    if am is not None:
        parts.append(masks.from_keras(am))
    if causal:
        parts.append(masks.causal(align="top_left"))  # Keras' causal mask: j <= i
    mask = None if not parts else parts[0] if len(parts) == 1 else parts[0] & parts[1]
    # our call order is (query, key, value); Keras' is (query, value, key)
    got, got_w = ours.run(q, k, v, mask=mask)
    assert got.shape == want.shape and got_w.shape == want_scores.shape
    assert (got - want).abs().max() <= TOL
    assert (got - want_fused).abs().max() <= TOL
    assert (got_w - want_scores).abs().max() <= TOL


def test_bottom_right_causal_is_not_keras_causal(keras):
    # guards the table in docs/guides/migrating.md: with L != S our default causal() differs
    # from Keras'
    layout = LAYOUTS[1]  # L = 4 < S = 7
    theirs = keras_layer(keras, layout)
    ours = from_keras(theirs)
    q, v, k = inputs(layout)
    want = theirs(q, v, k, use_causal_mask=True)
    assert (ours(q, k, v, mask=masks.causal()) - want).abs().max() > 1e-2
    assert (ours(q, k, v, mask=masks.causal(align="top_left")) - want).abs().max() <= TOL


@pytest.mark.parametrize("use_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay.name)
def test_round_trip_is_exact(keras, layout, use_bias):
    theirs = keras_layer(keras, layout, use_bias, dropout=0.25)
    ours = from_keras(theirs)
    back = to_keras(ours)
    assert isinstance(back, keras.layers.MultiHeadAttention)
    assert back.get_config()["output_shape"] == (
        None if layout.output_shape in (None, layout.e) else (layout.output_shape,)
    )
    for name in ("num_heads", "key_dim", "value_dim", "use_bias", "dropout"):
        assert getattr(back, name) == getattr(theirs, name), name
    assert [w.path.split("/", 1)[1] for w in back.weights] == [
        w.path.split("/", 1)[1] for w in theirs.weights
    ]
    for a, b in zip(theirs.weights, back.weights):
        assert torch.equal(a.value, b.value), a.path
    q, v, k = inputs(layout)
    assert torch.equal(back(q, v, k), theirs(q, v, k))
    # and the other way: module -> Keras -> module keeps every tensor
    again = from_keras(back)
    for (name, a), b in zip(ours.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name


def test_to_keras_from_a_trained_module(keras):
    torch.manual_seed(3)
    ours = MultiHeadAttention(10, 2, kdim=6, vdim=7, head_dim=3, value_head_dim=4, out_dim=5)
    with torch.no_grad():  # nn.Linear biases are small at init: make them matter
        for p in ours.parameters():
            p.normal_(0, 0.5)
    theirs = to_keras(ours)
    layout = Layout("x", 2, 3, value_dim=4, output_shape=5, e=10, kdim=6, vdim=7, length_k=6)
    q, v, k = inputs(layout)
    keep = random_keras_mask(3, 5, 6)
    want, want_scores = theirs(q, v, k, attention_mask=keep, return_attention_scores=True)
    got, got_w = ours.eval().run(q, k, v, mask=masks.from_keras(keep))
    assert (got - want).abs().max() <= TOL
    assert (got_w - want_scores).abs().max() <= TOL


def test_dtype_travels(keras):
    ours = MultiHeadAttention(8, 2, value_head_dim=3).double()
    theirs = to_keras(ours)
    assert theirs.dtype_policy.name == "float64"
    assert all(w.dtype == "float64" for w in theirs.weights)
    back = from_keras(theirs)
    assert back.q_proj.weight.dtype == torch.float64
    for a, b in zip(ours.state_dict().values(), back.state_dict().values()):
        assert torch.equal(a, b)


def test_fully_masked_rows_differ_on_purpose(keras):
    # Keras 3.15 on its default path (no scores, no dropout: ops.dot_product_attention) turns
    # the mask into a -1e9-like bias, so a query with no visible key averages all values
    # uniformly. When it computes scores (return_attention_scores=True or dropout > 0) its
    # masked softmax zeroes hidden entries, and that row is 0, as here. We give 0 always:
    # weights 0, attention output 0, so the module's output is the output projection's bias.
    layout = Layout("x", 2, 3, e=6, vdim=6, length_q=3, length_k=4)
    theirs = keras_layer(keras, layout)
    ours = from_keras(theirs)
    q, v, _ = inputs(layout, batch=2)
    keep = torch.ones(2, 3, 4, dtype=torch.bool)
    keep[1, 2] = False  # batch 1, query 2 sees nothing
    visible = keep.any(-1)
    got, got_w = ours.run(q, v, mask=masks.from_keras(keep))
    assert torch.equal(got_w[1, :, 2], torch.zeros(2, 4))
    assert torch.equal(got[1, 2], ours.out_proj.bias)

    want = theirs(q, v, attention_mask=keep)  # Keras' default path: uniform
    values = ours.v_proj(v[1]).reshape(4, 2, 3)  # [S, H, D_v]
    uniform = values.mean(0).reshape(1, 6)  # every head averages all 4 values
    assert (want[1, 2] - ours.out_proj(uniform)[0]).abs().max() <= TOL
    assert (got[1, 2] - want[1, 2]).abs().max() > 1e-2  # the difference is real
    assert (got[visible] - want[visible]).abs().max() <= TOL  # every other row agrees

    want, want_scores = theirs(q, v, attention_mask=keep, return_attention_scores=True)
    assert torch.equal(want_scores[1, :, 2], torch.zeros(2, 4))  # Keras' scores path: 0
    assert (got - want).abs().max() <= TOL


def test_conversion_errors(keras):
    with pytest.raises(TypeError, match=r"expects a keras.layers.MultiHeadAttention.*Dense"):
        from_keras(keras.layers.Dense(3))
    with pytest.raises(ValueError, match=r"needs a built layer.*layer.built=False"):
        from_keras(keras.layers.MultiHeadAttention(2, 3))
    over_2d = keras.layers.MultiHeadAttention(2, 3)
    over_2d.build((None, 4, 5, 6), (None, 4, 5, 6))  # attends over two axes of (B, T1, T2, E)
    with pytest.raises(ValueError, match=r"attention_axes must be None.*\(1, 2\)"):
        from_keras(over_2d)
    for kwargs, match in (
        ({"use_gate": True}, r"gated attention.*use_gate=True"),
        ({"sliding_window": 3}, r"sliding_window\(w - 1, w - 1\).*sliding_window=3"),
        ({"output_shape": (2, 5)}, r"one-dimensional output_shape.*\(2, 5\)"),
    ):
        layer = keras.layers.MultiHeadAttention(2, 3, **kwargs)
        layer.build((None, None, 6), (None, None, 6))
        with pytest.raises(ValueError, match=match):
            from_keras(layer)
    with pytest.raises(ValueError, match=r"one key/value head per query head.*num_kv_heads=2"):
        to_keras(MultiHeadAttention(8, 4, num_kv_heads=2))


def test_the_core_layer_no_longer_converts_itself():
    # the conversion lives beside the Keras code, so modules/ never imports keras/
    assert not hasattr(MultiHeadAttention, "from_keras")
    assert not hasattr(MultiHeadAttention, "to_keras")
    root = Path(multihead.__file__).parent
    for path in sorted((root / "modules").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert "keras" not in (node.module or ""), f"{path.name} imports {node.module}"
