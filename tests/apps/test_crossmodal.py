"""multihead train crossmodal: generated questions checked against the digit labels, patches
against the pixels, cross-attention with different widths, and the saved model."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import assert_run_summary, train_quick
from sklearn.datasets import load_digits

import multihead as mh
from multihead.apps import crossmodal


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The quick run's folder and what it printed."""
    return train_quick("crossmodal", tmp_path_factory)


@pytest.fixture(scope="module")
def run_dir(trained):
    return trained[0]


def test_the_run_ends_with_its_metrics_table_and_folder(trained):
    assert_run_summary(trained)


def _answer(words: list[str], label: int) -> int:
    """The answer read off the words alone, independently of the generator."""
    if words[2] in ("even", "odd"):
        return int((label % 2 == 0) == (words[2] == "even"))
    if words[2] == "greater":
        return int(label > int(words[4]))
    if words[2] == "less":
        return int(label < int(words[4]))
    return int(label == int(words[3]))


def test_questions_have_the_right_answers_and_are_balanced():
    labels = load_digits().target
    qs = crossmodal.make_questions(labels, 4, seed=3)
    assert len(qs.answer) == 4 * len(labels)
    truth = [_answer(w, int(labels[i])) for w, i in zip(qs.words, qs.image)]
    assert np.array_equal(qs.answer, truth)
    digit = np.array(qs.kind) == "is_digit"
    assert 0.45 < qs.answer[digit].mean() < 0.55  # half name the true digit
    ids, lengths = crossmodal.tokenize(qs.words[:2])
    assert [crossmodal.VOCAB[t] for t in ids[0, : lengths[0]]] == qs.words[0]


def test_patches_are_the_pixels():
    images = load_digits().images[:3]
    p = crossmodal.patches(images)  # (3, 16, 4)
    assert p.shape == (3, 16, 4)
    # patch 5 is row 1, column 1 of the 4 x 4 grid: pixels (2..3, 2..3), row-major
    assert torch.equal(
        p[:, 5], torch.as_tensor(images[:, 2:4, 2:4].reshape(3, 4) / 16, dtype=torch.float32)
    )


def test_cross_attention_uses_different_widths():
    model = crossmodal.CrossModalQA()
    assert (model.cross.embed_dim, model.cross.kdim, model.cross.vdim) == (32, 48, 48)
    ids, lengths = crossmodal.tokenize([["is", "it", "odd", "?"], ["is", "it", "a", "3", "?"]])
    logits, weights = model.run(ids, lengths, torch.rand(2, 16, 4))
    assert logits.shape == (2,) and weights.shape == (2, 4, 6, 16)
    assert torch.allclose(weights.sum(-1), torch.ones(2, 4, 6), atol=1e-6)


def test_metrics_and_saved_model(run_dir):
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert set(metrics["metrics"]) == {"model", "question_only", "image_only"}
    split = metrics["split"]
    assert not set(split["train_images"]) & set(split["test_images"])
    assert metrics["seed"] == 0 and metrics["wall_seconds"] > 0
    # rebuild the test questions from the stated split and seed, as anyone could
    digits = load_digits()
    test = np.array(split["test_images"])
    qs = crossmodal.make_questions(digits.target[test], split["questions_per_image"], 2)
    ids, lengths = crossmodal.tokenize(qs.words)
    image = crossmodal.patches(digits.images)[test[qs.image]]
    model = mh.load(run_dir / "model")
    prob = crossmodal.predict(model, ids, lengths, image)
    assert np.abs(prob[:50] - np.array(metrics["test_probabilities"])).max() < 1e-5
    accuracy = float(((prob > 0.5) == (qs.answer == 1)).mean())
    assert accuracy == pytest.approx(metrics["metrics"]["model"]["accuracy"], abs=1e-12)
    for name in metrics["figures"]:
        png = (run_dir / name).read_bytes()
        assert png[:4] == b"\x89PNG" and len(png) > 5_000
