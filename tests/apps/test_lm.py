"""``multihead train lm`` end to end on the VADER sentences, its bigram baseline against the
formula computed by hand, and ``multihead generate`` streaming the trained decoder's text."""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import math
from collections import Counter

import numpy as np
import pytest
from helpers import train_quick

import multihead as mh
from multihead.apps import Options, lm
from multihead.cli import main


@pytest.fixture(scope="module")
def trained(tmp_path_factory, vader):
    return train_quick("lm", tmp_path_factory, "--data", str(vader))


def test_the_run_writes_a_folder_the_loaders_open(trained, vader):
    out, printed = trained
    for name in ("config.json", "model.safetensors", "tokenizer.json", "metrics.json",
                 "loss_curve.png", "samples.txt", "held_out.txt"):  # fmt: skip
        assert (out / name).is_file(), name
    assert printed.rstrip().splitlines()[-1] == f"wrote {out}"
    model = mh.models.load(out)
    assert hasattr(model, "generate_text")  # a causal LM with its tokenizer
    metrics = json.loads((out / "metrics.json").read_text())
    # perplexity is exp(loss) for the model and both baselines, on the same held-out tokens
    for row in metrics["metrics"].values():
        assert row["perplexity"] == pytest.approx(math.exp(row["loss"]), rel=1e-4)
    assert (
        metrics["metrics"]["model"]["perplexity"]
        < metrics["metrics"]["unigram_add_one"]["perplexity"]
    )
    assert metrics["parameters"] == sum(p.numel() for p in model.parameters())
    # the held-out texts, one per line: exactly the split's held-out share, none trained on
    held = (out / "held_out.txt").read_text(encoding="utf-8").splitlines()
    want = lm._data(Options(out=out, quick=True, data=vader), lm.QUICK)["held"]
    assert held == want and len(held) == metrics["data"]["held_out_texts"]


def test_the_tokenizer_round_trips_and_matches_transformers(trained):
    from transformers import PreTrainedTokenizerFast

    out, _ = trained
    model = mh.models.load(out)
    theirs = PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"))
    for text in ("The movie was not good at all.", "Ünïcödé and emoji 🙂 survive"):
        for special in (False, True):  # True: the end-of-text token opens the text
            ids = model.tokenizer.encode(text, add_special_tokens=special).ids
            assert ids == theirs.encode(text, add_special_tokens=special)
            assert (
                model.tokenizer.decode(ids) == text == theirs.decode(ids, skip_special_tokens=True)
            )


def _kneser_ney_by_hand(rows, v):
    """Interpolated Kneser-Ney with one discount, from counts in dicts (float64)."""
    bigrams = Counter((a, b) for r in rows for a, b in itertools.pairwise(r))
    n1 = sum(1 for c in bigrams.values() if c == 1)
    n2 = sum(1 for c in bigrams.values() if c == 2)
    d = n1 / (n1 + 2 * n2)
    types = len(bigrams)
    before = Counter(b for (_, b) in bigrams)
    after = Counter(a for (a, _) in bigrams)
    context = Counter()
    for (a, _), c in bigrams.items():
        context[a] += c

    def cont(w):
        return max(before[w] - d, 0) / types + d * len(before) / types / v

    def prob(a, b):
        if context[a] == 0:
            return cont(b)
        return max(bigrams[(a, b)] - d, 0) / context[a] + d * after[a] / context[a] * cont(b)

    return prob


def test_the_bigram_baseline_is_kneser_ney_and_a_distribution():
    rows = [[0, 5, 6, 7, 0], [0, 5, 6, 0], [0, 8, 6, 7, 7, 0], [0, 5, 9, 0]]
    v = 12
    model = lm.KneserNeyBigram(rows, v)
    prob = _kneser_ney_by_hand(rows, v)
    prev = np.repeat(np.arange(v), v)
    nxt = np.tile(np.arange(v), v)
    got = np.exp(model.log_prob(prev, nxt)).reshape(v, v)
    want = np.array([[prob(a, b) for b in range(v)] for a in range(v)])
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=0)  # float64 both ways
    np.testing.assert_allclose(got.sum(axis=1), 1.0, rtol=1e-12)  # every context sums to 1
    nll, n = model.nll([[0, 5, 6, 0]])
    assert n == 3 and nll == pytest.approx(-sum(math.log(prob(a, b)) for a, b in
                                                [(0, 5), (5, 6), (6, 0)]), rel=1e-12)  # fmt: skip


def _generate(*args):
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["generate", *args]) == 0
    return printed.getvalue()


class _Writes:
    """A stdout that keeps every write and counts the flushes."""

    def __init__(self):
        self.writes, self.flushes = [], 0

    def write(self, text):
        self.writes.append(text)

    def flush(self):
        self.flushes += 1


def test_generate_streams_the_greedy_continuation(trained):
    out, _ = trained
    stdout = _Writes()
    with contextlib.redirect_stdout(stdout):
        assert (
            main(["generate", "--model", str(out), "The movie was", "--max-new-tokens", "12"]) == 0
        )
    model = mh.models.load(out)
    whole = model.generate_text("The movie was", 12)
    assert "".join(stdout.writes) == whole[len("The movie was") :] + "\n"
    pieces = [w for w in stdout.writes if w and w != "\n"]
    assert len(pieces) >= 3 and stdout.flushes >= len(pieces)  # piece by piece, each flushed


def test_generate_samples_reproducibly_under_a_seed(trained):
    out, _ = trained
    args = ["--model", str(out), "It was", "--temperature", "0.9", "--top-k", "20"]
    a = _generate(*args, "--seed", "7")
    assert a == _generate(*args, "--seed", "7")
    assert any(_generate(*args, "--seed", str(s)) != a for s in range(8, 12))


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--top-p", "1.5"], r"--top-p must be in \(0, 1\]"),
        (["--temperature", "-1"], r"--temperature must be a finite number >= 0"),
    ],
)
def test_generate_refuses_bad_settings_before_loading(tmp_path, capsys, extra, message):
    import re

    assert main(["generate", "--model", str(tmp_path / "nothing"), "hi", *extra]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_generate_names_a_missing_folder(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path / "nothing"), "hi"]) == 2
    assert "is not a folder" in capsys.readouterr().err
