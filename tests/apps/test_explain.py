"""`multihead explain` and `multihead embed` end to end on the default model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from multihead import cli
from multihead.apps import explain
from multihead.apps.explain import ExplainOptions as Options

TEXT = "The animal didn't cross the street because it was too tired"
DATA = Path(__file__).parent / "data"


def _set_aside(weights: torch.Tensor, positions) -> torch.Tensor:
    """The weights with the sink columns at 0 and each row renormalized, in float64."""
    w = weights.double().clone()
    w[..., list(positions)] = 0
    total = w.sum(-1, keepdim=True)
    return torch.where(total > 0, w / total.clamp_min(1e-300), torch.zeros_like(w))


def test_explain_end_to_end(tmp_path, capsys):
    assert cli.main(["explain", TEXT, "--focus", "it", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "focus: 'it' (position 10)" in printed
    assert "Rollout (Abnar & Zuidema 2020) for 'it', sinks set aside:" in printed
    assert "Rollout (Abnar & Zuidema 2020) for 'it' with the sinks (raw): [CLS] " in printed
    assert printed.count("\n   ") >= 12  # a row per head
    files = ("heads_grid.png", "head.png", "head_without_sinks.png", "head_surface.png")
    for name in (*files, "attention.html"):
        path = tmp_path / name
        assert path.stat().st_size > 5_000, name
        assert str(path) in printed


def test_explain_values(tmp_path):
    lines = []
    got = explain.run(Options(text=TEXT, focus="animal", out=tmp_path), say=lines.append)
    assert got.tokens[got.focus] == "animal"
    assert got.weights.shape == (6, 12, 15, 15)
    torch.testing.assert_close(got.weights.sum(-1), torch.ones(6, 12, 15))
    assert got.sinks.positions == (0, 14)  # [CLS] and [SEP]
    # the printed grid cell of layer 3 head 1 is that head's top token and weight once the
    # sinks are set aside
    w = _set_aside(got.weights, got.sinks.positions)[3, 1, got.focus]
    token = got.tokens[int(w.argmax())]
    row = next(line for line in lines if line.startswith("   1 "))
    assert f"{token} {100 * float(w.max()):.0f}%" in row
    layer, head = got.head
    assert 0 <= layer < 6 and 0 <= head < 12


def test_default_focus_is_last_word(tmp_path):
    got = explain.run(Options(text="cats chase mice", out=tmp_path), say=lambda s: None)
    assert got.tokens[got.focus] == "mice"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["explain", "   "], "the text to explain is empty"),
        (["explain", "word " * 600], "602 tokens but the model has 512 positions"),
        (["explain", TEXT, "--focus", "zebra"], "focus word is not among the text's tokens"),
        (["explain", TEXT, "--model", "no/such/dir"], "model directory not found"),
        (["embed", "no/such/file.txt", "--out", "x.npy"], "no such input file"),
    ],
    ids=["empty", "too_long", "focus", "model", "file"],
)
def test_cli_errors(tmp_path, capsys, argv, message):
    argv = [a if a != "x.npy" else str(tmp_path / "x.npy") for a in argv]
    assert cli.main([*argv, "--out", str(tmp_path)] if argv[0] == "explain" else argv) == 2
    assert message in capsys.readouterr().err


def test_embed_file(tmp_path, pretrained, capsys):
    lines = ["The cat sat on the mat.", "", "A second, longer sentence about a dog in the rain."]
    source = tmp_path / "in.txt"
    source.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "out" / "emb.npy"
    (tmp_path / "out").mkdir()  # made by the user: embed creates no folders
    assert cli.main(["embed", str(source), "--out", str(out)]) == 0
    saved = np.load(out)
    assert saved.shape == (3, 384) and saved.dtype == np.float32
    np.testing.assert_allclose(saved, pretrained.embed(lines).numpy(), rtol=0, atol=1e-6)
    assert "wrote 3 embeddings of size 384" in capsys.readouterr().out


def test_embed_progress_bar_on_long_inputs(tmp_path, capsys):
    source = tmp_path / "in.txt"
    source.write_text("\n".join(f"sentence number {i}" for i in range(300)), encoding="utf-8")
    assert cli.main(["embed", str(source), "--out", str(tmp_path / "e.npy")]) == 0
    assert "300/300" in capsys.readouterr().err
    empty = tmp_path / "empty.txt"
    empty.write_text("", encoding="utf-8")
    assert cli.main(["embed", str(empty), "--out", str(tmp_path / "f.npy")]) == 2
    assert "no lines to embed" in capsys.readouterr().err


def test_focus_on_a_word_split_into_pieces(tmp_path):
    options = Options(text="Tokenization matters", focus="Tokenization", out=tmp_path)
    got = explain.run(options, say=print)
    assert got.tokens[got.focus : got.focus + 2] == ["token", "##ization"]
    assert explain.find_focus(["[CLS]", "an", "animal", "[SEP]"], [1, 0, 0, 1], "x", ["an"]) == 1


def test_the_focus_line_names_the_piece_followed_when_the_word_is_split(tmp_path):
    """--focus Tokenization followed the piece 'token' and said only "focus: 'token'"."""
    lines = []
    explain.run(
        Options(text="Tokenization matters", focus="Tokenization", out=tmp_path), say=lines.append
    )
    assert (
        "focus: 'token' (position 1), the first of the 2 pieces 'token' '##ization' that "
        "--focus Tokenization is split into"
    ) in [line.strip() for line in lines]
    lines.clear()
    explain.run(
        Options(text="Tokenization matters", focus="matters", out=tmp_path), say=lines.append
    )
    assert "focus: 'matters' (position 3)" in [line.strip() for line in lines]  # a whole word


def test_an_existing_out_folder_is_reported_before_the_run(tmp_path):
    """explain wrote over an earlier run's files in --out without a word."""
    (tmp_path / "notes.txt").write_text("mine")
    lines = []
    explain.run(Options(text="cats chase mice", out=tmp_path), say=lines.append)
    assert lines[0] == (
        f"--out {tmp_path} exists, holding notes.txt: this run writes its figures and "
        "attention.html over those of the same name"
    )
    lines.clear()
    explain.run(Options(text="cats chase mice", out=tmp_path), say=lines.append)
    assert lines[0].startswith(
        f"--out {tmp_path} exists, holding attention.html, attribution.json, attribution.png, "
        "head.png, "
    )
    assert (tmp_path / "notes.txt").read_text() == "mine"
    lines.clear()
    explain.run(Options(text="cats chase mice", out=tmp_path / "new"), say=lines.append)
    assert not any(line.startswith("--out") for line in lines)


def _strongest_head(weights, focus, keys, layers, heads):
    """The (layer, head) with the largest weight from ``focus`` onto one of ``keys``, by plain
    loops over every allowed layer, head and key (independent of ``explain.pick_head``)."""
    best, where = -1.0, None
    for layer in layers:
        for head in heads:
            for k in keys:
                value = float(weights[layer, head, focus, k])
                if value > best:
                    best, where = value, (layer, head)
    return where


def test_explain_layer_and_head_choose_the_figure_and_are_named(tmp_path, capsys, monkeypatch):
    import multihead.viz as viz

    titles = []
    for name in ("head_heatmap", "surface"):
        real = getattr(viz, name)

        def spy(weights, tokens, *, title="", _real=real, **kwargs):
            titles.append(title)
            return _real(weights, tokens, title=title, **kwargs)

        monkeypatch.setattr(viz, name, spy)
    argv = ["explain", TEXT, "--focus", "it", "--out", str(tmp_path), "--layer", "2"]
    assert cli.main([*argv, "--head", "5"]) == 0
    printed = capsys.readouterr().out
    assert titles == [
        "layer 2 head 5: raw attention weights, sinks included",
        "layer 2 head 5 without the sinks '[CLS]', '[SEP]', each row renormalized",
        "layer 2 head 5 without the sinks",
    ]
    assert (
        f"{tmp_path / 'head.png'}  (layer 2 head 5 (chosen by --layer/--head): the raw weights)"
    ) in printed
    assert f"{tmp_path / 'head_without_sinks.png'}  (layer 2 head 5 without the sinks" in printed
    assert f"{tmp_path / 'heads_grid.png'}  (every head: 6 layers (rows) x 12 heads" in printed

    # --layer alone: the strongest head of that layer, found independently
    got = explain.run(Options(text=TEXT, focus="it", out=tmp_path, layer=4), say=lambda s: None)
    real = [i for i, t in enumerate(got.tokens) if t not in ("[CLS]", "[SEP]") and i != got.focus]
    far = [i for i in real if abs(i - got.focus) > 1]
    clean = _set_aside(got.weights, [0, 14])
    assert got.head == _strongest_head(clean, got.focus, far, [4], range(12))
    assert got.head[0] == 4


def test_explain_default_head_is_the_one_most_fixed_on_a_far_word(tmp_path, capsys):
    got = explain.run(Options(text=TEXT, focus="it", out=tmp_path))
    printed = capsys.readouterr().out
    real = [i for i, t in enumerate(got.tokens) if t not in ("[CLS]", "[SEP]") and i != got.focus]
    far = [i for i in real if abs(i - got.focus) > 1]
    clean = _set_aside(got.weights, [0, 14])
    layer, head = _strongest_head(clean, got.focus, far, range(6), range(12))
    assert got.head == (layer, head)
    # with --keep-sinks: the same search on the raw weights
    got = explain.run(Options(text=TEXT, focus="it", out=tmp_path, keep_sinks=True))
    assert got.head == _strongest_head(got.weights, got.focus, far, range(6), range(12))
    assert (
        f"(layer {layer} head {head} (the head most fixed on one other word from 'it'): the raw "
        "weights)"
    ) in printed


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--layer", "6", "--layer must be between 0 and 5: the model has 6 layers, counted"),
        ("--head", "12", "--head must be between 0 and 11: the model has 12 heads in every layer"),
        ("--layer", "-1", "--layer must be a whole number >= 0. Received: --layer -1"),
    ],
)
def test_explain_layer_and_head_out_of_range(tmp_path, capsys, flag, value, message):
    out = tmp_path / "figs"
    assert cli.main(["explain", TEXT, "--out", str(out), flag, value]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()  # refused before anything was written
