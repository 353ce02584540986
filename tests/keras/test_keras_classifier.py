"""The seed's EncoderLayer in Keras, and a text classifier trained with model.fit on the VADER
tweets, saved to a .keras file and reloaded (in this process and in a fresh one)."""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from keras_cases import TOL

import multihead.keras as mk
from multihead import masks

MAX_LEN = 32


def test_encoder_layer_against_keras_own_attention(keras):
    enc = mk.EncoderLayer(12, 3, 20, dropout_rate=0.1)
    ids = np.array([[3, 1, 4, 1, 5, 9], [2, 6, 5, 3, 0, 0]])
    x = keras.layers.Embedding(10, 12, mask_zero=True)(ids)
    real = torch.as_tensor(ids != 0)
    out = enc(x)  # inference: no dropout
    assert torch.equal(out._keras_mask, real)  # the padding mask flows on
    causal = enc(x, attention_mask=masks.causal(align="top_left"))

    # the same block written out with Keras' own MultiHeadAttention holding the same weights
    ref = keras.layers.MultiHeadAttention(3, 4)
    ref.build((None, None, 12), (None, None, 12))
    for mine, theirs in zip(enc.mha.weights, ref.weights):
        theirs.assign(mine.value)
    plain = x.detach().clone()

    def block(**mask_kwargs):
        attn = ref(plain, plain, query_mask=real, value_mask=real, **mask_kwargs)
        h = enc.layernorm1(plain + attn)
        return enc.layernorm2(h + enc.ffn2(enc.ffn1(h)))

    # padded query rows differ by design (Keras' fused path averages all keys there)
    assert (out[real] - block()[real]).abs().max() <= TOL
    assert (causal[real] - block(use_causal_mask=True)[real]).abs().max() <= TOL
    assert (causal[real] - out[real]).abs().max() > 1e-3  # the causal mask did something


def test_encoder_layer_errors(keras):
    with pytest.raises(ValueError, match=r"d_model must be divisible by num_heads.*num_heads=5"):
        mk.EncoderLayer(12, 5, 20)
    with pytest.raises(ValueError, match=r"dropout_rate must be in \[0, 1\).*dropout_rate=1.0"):
        mk.EncoderLayer(12, 3, 20, dropout_rate=1.0)
    with pytest.raises(TypeError, match=r"dff must be an int.*'64'"):
        mk.EncoderLayer(12, 3, "64")


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z']+", text.lower())


def _tweets(folder: Path, per_class: int) -> tuple[list[str], np.ndarray]:
    """The first ``per_class`` clearly positive (mean rating >= 1) and clearly negative
    (<= -1) tweets of the VADER ``folder``, shuffled with a fixed seed; labels 1 = positive."""
    rows = []
    path = folder / "tweets_GroundTruth.txt"
    with path.open(encoding="utf-8") as f:  # id<TAB>mean rating<TAB>text, CRLF line ends
        for line in f:
            _, rating, text = line.rstrip("\r\n").split("\t", 2)
            rows.append((float(rating), text))
    pos = [t for r, t in rows if r >= 1.0][:per_class]
    neg = [t for r, t in rows if r <= -1.0][:per_class]
    texts, labels = pos + neg, np.array([1] * len(pos) + [0] * len(neg))
    order = np.random.default_rng(0).permutation(len(texts))
    return [texts[i] for i in order], labels[order]


def _ids(texts: list[str], vocab: dict[str, int]) -> np.ndarray:
    """(N, MAX_LEN) int32 ids: 0 pads, 1 is an unknown word."""
    out = np.zeros((len(texts), MAX_LEN), dtype="int32")
    for i, text in enumerate(texts):
        ids = [vocab.get(w, 1) for w in _words(text)][:MAX_LEN]
        out[i, : len(ids)] = ids
    return out


@pytest.fixture(scope="module")
def trained(keras, tmp_path_factory, vader):
    """A classifier fitted on 320 tweets (80 held out), saved to a .keras file."""
    texts, labels = _tweets(vader, per_class=200)
    train = 320
    counts = collections.Counter(w for t in texts[:train] for w in _words(t))
    vocab = {w: i + 2 for i, (w, _) in enumerate(counts.most_common())}
    x = _ids(texts, vocab)
    keras.utils.set_random_seed(0)
    model = mk.text_classifier(len(vocab) + 2, MAX_LEN, 2)
    model.compile(keras.optimizers.Adam(3e-3), "sparse_categorical_crossentropy")
    history = model.fit(x[:train], labels[:train], epochs=3, batch_size=32, verbose=0)
    path = tmp_path_factory.mktemp("classifier") / "classifier.keras"
    model.save(path)
    return model, history.history, path, x[train:], labels[train:]


def test_classifier_learns_the_tweets(trained):
    model, history, _, x_test, y_test = trained
    assert history["loss"][-1] < 0.5 * history["loss"][0]
    # 80 held-out tweets, 40 per class: chance is 0.5 (standard deviation 0.056); the seeded
    # run reaches about 0.8
    accuracy = float((model.predict(x_test, verbose=0).argmax(-1) == y_test).mean())
    assert accuracy >= 0.7, accuracy


def test_saved_classifier_predicts_identically(keras, trained):
    model, _, path, x_test, _ = trained
    want = model.predict(x_test, verbose=0)
    loaded = keras.saving.load_model(path)  # no custom_objects
    assert [type(layer).__name__ for layer in loaded.layers].count("EncoderLayer") == 1
    assert isinstance(loaded.layers[2].mha, mk.MultiHeadAttention)
    np.testing.assert_array_equal(loaded.predict(x_test, verbose=0), want)


def test_fresh_process_loads_with_only_import_multihead_keras(trained, tmp_path):
    # no KERAS_BACKEND: importing multihead.keras first chooses torch by itself
    model, _, path, x_test, _ = trained
    np.save(tmp_path / "x.npy", x_test)
    code = (
        "import sys, numpy as np\n"
        "import multihead.keras\n"
        "import keras\n"
        "assert keras.backend.backend() == 'torch', keras.backend.backend()\n"
        "model = keras.saving.load_model(sys.argv[1])\n"
        "np.save(sys.argv[3], model.predict(np.load(sys.argv[2]), verbose=0))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    args = [str(path), str(tmp_path / "x.npy"), str(tmp_path / "p.npy")]
    done = subprocess.run(
        [sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    np.testing.assert_array_equal(np.load(tmp_path / "p.npy"), model.predict(x_test, verbose=0))
