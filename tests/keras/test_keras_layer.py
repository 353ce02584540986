"""multihead.keras.MultiHeadAttention against keras.layers.MultiHeadAttention with the same
weights: masks in every form Keras takes, multihead masks, scores, gradients, saving, errors."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import numpy as np
import pytest
import torch
from keras_cases import LAYOUTS, TOL, inputs, keras_layer, random_keras_mask

import multihead.keras as mk
from multihead import masks
from multihead.keras._backend import import_keras


def twin(keras, layout, **kwargs):
    """(Keras' layer with random weights, ours with the same weights)."""
    theirs = keras_layer(keras, layout, **kwargs)
    ours = mk.MultiHeadAttention.from_config(theirs.get_config())
    key_shape = None if layout.kdim is None else (None, None, layout.kdim)
    ours.build((None, None, layout.e), (None, None, layout.vdim), key_shape)
    assert [w.shape for w in ours.weights] == [w.shape for w in theirs.weights]
    for mine, their in zip(ours.weights, theirs.weights):
        mine.assign(their.value)
    return theirs, ours


@pytest.mark.parametrize("mode", ["none", "attention_mask", "causal", "attention_mask+causal"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay.name)
def test_same_results_as_keras(keras, layout, mode):
    theirs, ours = twin(keras, layout)
    q, v, k = inputs(layout)
    kwargs = {
        "attention_mask": (
            random_keras_mask(3, layout.length_q, layout.length_k) if "attention" in mode else None
        ),
        "use_causal_mask": "causal" in mode,
    }
    want, want_scores = theirs(q, v, k, return_attention_scores=True, **kwargs)
    got, got_scores = ours(q, v, k, return_attention_scores=True, **kwargs)
    assert got.shape == want.shape and got_scores.shape == want_scores.shape
    assert (got - want).abs().max() <= TOL
    assert (got_scores - want_scores).abs().max() <= TOL
    assert (ours(q, v, k, **kwargs) - want).abs().max() <= TOL


def test_keras_padding_masks_from_an_embedding(keras):
    layout = LAYOUTS[0]
    theirs, ours = twin(keras, layout)
    ids = np.array([[3, 1, 4, 1, 5], [9, 2, 6, 0, 0], [5, 3, 0, 0, 0]])
    embed = keras.layers.Embedding(10, layout.e, mask_zero=True)
    x = embed(ids)
    real = torch.as_tensor(ids != 0)
    got, got_scores = ours(x, x, return_attention_scores=True)
    assert torch.equal(x._keras_mask, real)  # the caller's tensor keeps its mask
    assert torch.equal(got._keras_mask, real)  # and the output carries the query mask
    want, want_scores = theirs(x, x, return_attention_scores=True)
    assert (got[real] - want[real]).abs().max() <= TOL
    assert (got_scores - want_scores).abs().max() <= TOL  # padded keys have weight 0
    assert not got_scores.transpose(1, 2)[~real].any()  # a padded query attends to nothing
    # explicit query_mask / value_mask arguments mean the same
    plain = x.detach().clone()
    explicit = ours(plain, plain, query_mask=real, value_mask=real, return_attention_scores=True)
    assert torch.equal(explicit[0], got) and torch.equal(explicit[1], got_scores)


def test_multihead_masks_as_attention_mask(keras):
    layout = LAYOUTS[0]  # L = S = 5
    theirs, ours = twin(keras, layout)
    q, v, _ = inputs(layout)
    i, j = torch.arange(5)[:, None], torch.arange(5)[None, :]
    band = ((j - i).abs() <= 1).expand(3, 5, 5)
    want = theirs(q, v, attention_mask=band)
    got = ours(q, v, attention_mask=masks.sliding_window(1, 1))
    assert (got - want).abs().max() <= TOL
    lens = torch.tensor([5, 3, 1])
    keep = (torch.arange(5) < lens[:, None])[:, None, :].expand(3, 5, 5)
    want = theirs(q, v, attention_mask=keep, use_causal_mask=True)
    got = ours(q, v, attention_mask=masks.lengths(lens), use_causal_mask=True)
    assert (got - want).abs().max() <= TOL


def test_keras_mask_shapes_and_dtypes(keras):
    layout = LAYOUTS[1]  # L = 4, S = 7
    theirs, ours = twin(keras, layout)
    q, v, k = inputs(layout)
    shared = random_keras_mask(1, 4, 7)[0]  # (L, S): Keras broadcasts it over the batch
    per_head = torch.rand(3, 3, 4, 7, generator=torch.Generator().manual_seed(5)) > 0.5
    per_head[..., 0] = True
    for am in (shared, per_head, random_keras_mask(3, 4, 7).int(), random_keras_mask(3, 4, 7)[:1]):
        want, want_scores = theirs(q, v, k, attention_mask=am, return_attention_scores=True)
        got, got_scores = ours(q, v, k, attention_mask=am, return_attention_scores=True)
        assert (got - want).abs().max() <= TOL
        assert (got_scores - want_scores).abs().max() <= TOL
    with pytest.raises(TypeError, match=r"bool or integer.*mask > 0.5.*torch.float32"):
        ours(q, v, k, attention_mask=shared.float())
    with pytest.raises(ValueError, match=r"\(L, S\), \(B, L, S\) or \(B, H, L, S\).*\(7,\)"):
        ours(q, v, k, attention_mask=torch.ones(7, dtype=torch.bool))


def test_gradients_match_keras(keras):
    layout = LAYOUTS[-1]
    theirs, ours = twin(keras, layout)
    q, v, k = inputs(layout)
    keep = random_keras_mask(3, layout.length_q, layout.length_k)
    for layer in (theirs, ours):
        (layer(q, v, k, attention_mask=keep) ** 2).sum().backward()
    for a, b in zip(theirs.weights, ours.weights):
        # the fp32 rule's gradient tolerance (docs/design.md, "Error rules")
        assert (a.value.grad - b.value.grad).abs().max() <= 1e-4, a.path


def test_dropout_in_training_only(keras):
    layout = LAYOUTS[0]
    theirs, ours = twin(keras, layout, dropout=0.5)
    q, v, _ = inputs(layout)
    want, want_scores = theirs(q, v, return_attention_scores=True)  # inference: no dropout
    got = ours(q, v, training=False)
    assert (got - want).abs().max() <= TOL
    torch.manual_seed(0)
    dropped, dropped_scores = ours(q, v, return_attention_scores=True, training=True)
    assert (dropped - got).abs().max() > 1e-3
    # the scores are the weights before dropout, as in Keras
    assert (dropped_scores - want_scores).abs().max() <= TOL


def test_scores_spec_in_a_functional_model(keras):
    layer = mk.MultiHeadAttention(num_heads=2, key_dim=3)
    query, value = keras.Input((4, 6)), keras.Input((7, 5))
    out, scores = layer(query, value, return_attention_scores=True)
    assert tuple(out.shape) == (None, 4, 6)
    assert tuple(scores.shape) == (None, 2, 4, 7)  # Keras' own spec says (None, 2, 4, 4)
    model = keras.Model([query, value], [out, scores])
    real_out, real_scores = model([torch.randn(2, 4, 6), torch.randn(2, 7, 5)])
    assert real_out.shape == (2, 4, 6) and real_scores.shape == (2, 2, 4, 7)


def test_config_and_keras_file_round_trip(keras, tmp_path):
    assert keras.saving.get_registered_name(mk.MultiHeadAttention) == "multihead>MultiHeadAttention"
    layer = mk.MultiHeadAttention(3, 4, value_dim=5, output_shape=7, dropout=0.1, use_bias=False)
    again = mk.MultiHeadAttention.from_config(layer.get_config())
    assert again.get_config() == layer.get_config()
    query, value = keras.Input((4, 6)), keras.Input((5, 8))
    model = keras.Model([query, value], layer(query, value, use_causal_mask=True))
    x, y = torch.randn(2, 4, 6), torch.randn(2, 5, 8)
    path = tmp_path / "attention.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)  # no custom_objects
    assert type(loaded.layers[-1]) is mk.MultiHeadAttention
    assert torch.equal(loaded([x, y]), model([x, y]))


def test_unsupported_options(keras):
    for kwargs, match in (
        ({"use_gate": True}, r"gated attention.*use_gate=True"),
        ({"sliding_window": 4}, r"masks.sliding_window\(w - 1, w - 1\).*sliding_window=4"),
        ({"attention_axes": (1, 2)}, r"attention_axes must be None.*\(1, 2\)"),
        ({"output_shape": (2, 3)}, r"one-dimensional output_shape.*\(2, 3\)"),
    ):
        with pytest.raises(ValueError, match=match):
            mk.MultiHeadAttention(2, 3, **kwargs)
    assert mk.MultiHeadAttention(2, 3, attention_axes=-2).get_config()["attention_axes"] == (-2,)
    with pytest.raises(ValueError, match=r"query must be a 3-D \(B, L, E\).*\(2, 3, 4, 5\)"):
        mk.MultiHeadAttention(2, 3)(torch.randn(2, 3, 4, 5), torch.randn(2, 3, 4, 5))


def test_import_errors(monkeypatch):
    monkeypatch.setitem(sys.modules, "keras", None)  # keras not installed
    with pytest.raises(ImportError, match=r"pip install 'multihead\[keras\]'"):
        import_keras()
    monkeypatch.delitem(sys.modules, "keras")  # not imported yet, another backend asked for
    monkeypatch.setenv("KERAS_BACKEND", "jax")
    with pytest.raises(ImportError, match=r"KERAS_BACKEND=torch before.*KERAS_BACKEND='jax'"):
        import_keras()
    assert "keras" not in sys.modules  # refused before importing anything
    fake = types.ModuleType("keras")
    fake.__version__ = "3.15.1"
    fake.backend = types.SimpleNamespace(backend=lambda: "jax")
    monkeypatch.setitem(sys.modules, "keras", fake)  # already imported on jax
    with pytest.raises(ImportError, match=r"already imported with another.*backend\(\)='jax'"):
        import_keras()
    fake.__version__ = "2.15.0"
    with pytest.raises(ImportError, match=r"needs Keras 3.*'2.15.0'"):
        import_keras()


def test_import_multihead_never_imports_keras():
    code = (
        "import sys, torch, multihead as mh\n"
        "mha = mh.MultiHeadAttention(8, 2, head_dim=3, out_dim=5)\n"
        "mha(torch.randn(1, 3, 8), mask=mh.masks.causal())\n"
        "mh.MultiHeadAttention.from_torch(torch.nn.MultiheadAttention(8, 2))\n"
        "assert not [m for m in sys.modules if m == 'keras' or m.startswith('keras.')], 'keras'\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
