"""explain's token attribution (issue 57): what it prints and writes, long texts, figures
whose size is capped at L=4,000, refusals in one line; bench explain's pieces by hand."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from multihead import cli, inspect
from multihead.apps import attributing, explain
from multihead.apps.explain import ExplainOptions as Options
from multihead.bench import explain as bench

DEMO = "The animal didn't cross the street because it was too tired"


def _png_size(path) -> tuple[int, int]:
    with open(path, "rb") as f:
        head = f.read(24)
    return struct.unpack(">II", head[16:24])


def test_explain_prints_and_writes_the_attribution(tmp_path):
    from multihead.models import bert

    lines: list[str] = []
    got = explain.run(Options(text=DEMO, focus="it", out=tmp_path), say=lines.append)
    written = json.loads((tmp_path / "attribution.json").read_text())
    assert set(written) >= {"method", "target", "contrast", "tokens", "scores", "sink_share"}
    model = bert.load()
    encoding = model.tokenizer.encode(DEMO)
    assert written["tokens"] == list(encoding.tokens)  # as the tokenizer splits it, in order
    assert len(written["scores"]) == len(encoding.tokens)
    want = inspect.attribute(model, encoding.ids, target=encoding.tokens.index("it"))
    assert written["method"] == want.method == "alti"
    assert written["scores"] == pytest.approx(want.scores.tolist(), abs=1e-6)
    assert written["sink_share"] <= 0.05  # the goal: no sink rule needed
    printed = "\n".join(lines)
    assert "by alti (ALTI, Ferrando et al. 2022)" in printed
    top = max(range(len(encoding.tokens)), key=lambda i: written["scores"][i])
    assert encoding.tokens[top] == "animal"  # what "it" refers to ranks first
    assert got.attribution is not None and got.files["attribution"].is_file()


def test_explain_method_option(tmp_path):
    assert cli.main(["explain", "cats chase mice", "--method", "occlusion", "--out",
                     str(tmp_path)]) == 0  # fmt: skip
    assert json.loads((tmp_path / "attribution.json").read_text())["method"] == "occlusion"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--contrast", " is"], "--contrast explains a causal LM's prediction"),
    ],
)
def test_explain_refusals_in_one_line(tmp_path, capsys, argv, message):
    assert cli.main(["explain", DEMO, "--out", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_an_unknown_method_is_refused_by_the_parser(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["explain", DEMO, "--out", str(tmp_path), "--method", "lrp"])
    assert exit_.value.code == 2 and "invalid choice: 'lrp'" in capsys.readouterr().err


def test_a_long_text_makes_no_full_weight_figure_and_fits_100_columns(tmp_path):
    text = " ".join(["river", "music", "garden", "people"] * 75)  # 300 words, 302 tokens
    lines: list[str] = []
    got = explain.run(Options(text=text, focus="garden", out=tmp_path), say=lines.append)
    assert got.weights is None and got.attribution is not None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["attribution.json", "attribution.png"]
    table = [x for x in lines if x.startswith("head ") or x[:4].strip().isdigit()]
    assert len(table) == 1 + 12  # MiniLM: one block of its 6 layers, a header and 12 heads
    assert all(len(line) <= attributing.WIDTH for line in table)
    assert "drawn up to 255 tokens" in " ".join(" ".join(lines).split())
    width, height = _png_size(tmp_path / "attribution.png")
    assert width <= 16 * 100 + 10 and height <= 400  # capped at 16 x 3.4 inches, 100 dpi


def test_grid_of_a_deep_model_is_split_within_100_columns():
    cells = [[f"tok{layer} {h}%" for h in range(9)] for layer in range(30)]
    lines: list[str] = []
    attributing.fitted_grid(cells, lines.append, "heading")
    assert max(len(x) for x in lines) <= 100
    shown = [x for x in lines if x.startswith("head ")]
    assert sum(x.count("layer ") for x in shown) == 30  # every layer, once


def test_figures_at_4000_tokens_are_capped(tmp_path):
    from multihead.viz import MAX_INCHES, head_heatmap, heatmap_grid

    n = 4000
    weights = torch.softmax(torch.randn(n, n), -1)
    labels = [f"t{i}" for i in range(n)]
    fig = head_heatmap(weights, labels)
    assert max(fig.get_size_inches()) <= MAX_INCHES
    grid = heatmap_grid(torch.softmax(torch.randn(30, 9, 8, 8), -1), labels[:8])
    assert max(grid.get_size_inches()) <= MAX_INCHES
    scores = torch.rand(n)
    found = inspect.Attribution("norm", "t", list(range(n)), labels, scores / scores.sum(),
                                0.0, position=5)  # fmt: skip
    path = attributing.attribution_figure(found, labels, tmp_path)
    width, height = _png_size(path)
    assert width <= 1700 and height <= 400


def test_agreement_prompts_are_seeded_and_opposite_in_number():
    first, again = bench.agreement_prompts(50, 3), bench.agreement_prompts(50, 3)
    assert first == again and first != bench.agreement_prompts(50, 4)
    for prompt in first:
        words = prompt.text.split()
        assert prompt.subject in words[2:] and words[0] != prompt.subject
        assert prompt.subject.endswith("s") != prompt.attractor.endswith("s") or (
            prompt.attractor.endswith("ies")
        )
        assert {prompt.right, prompt.wrong} in [set(v) for v in bench._VERBS]


def test_aopc_by_hand():
    """Comprehensiveness and sufficiency of a score that counts the kept tokens of id 7."""
    ids = [1, 7, 7, 3, 3, 3, 3, 3, 3, 3, 2]
    words = list(range(1, 10))

    def score(batch):
        return torch.tensor([float(sum(t == 7 for t in row)) for row in batch])

    order = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    comp, suff = bench.aopc(score, ids, order, 0, words)
    # k per fraction of 9 words: 1%: 1, 5%: 1, 10%: 1, 20%: 2, 50%: 4 (at least one)
    ks = [1, 1, 1, 2, 4]
    want_comp = sum(min(k, 2) for k in ks) / 5  # removing the top k removes min(k, 2) sevens
    want_suff = sum(2 - min(k, 2) for k in ks) / 5  # keeping only them keeps min(k, 2)
    assert comp == pytest.approx(want_comp) and suff == pytest.approx(want_suff)
