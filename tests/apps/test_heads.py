"""``multihead heads``: every head ranked by ablating it, on a causal LM folder and on the real
all-MiniLM-L6-v2; the top score recomputed by hand with an eager hook that zeroes the head's
slice of the output projection's input (the independent reference)."""

from __future__ import annotations

import json

import pytest
import torch
from models.decoders import build, transformers_model

from multihead import cli
from multihead.apps import heads

TEXT = "the film was a quiet delight and the cast was superb"


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build("llama", tmp_path_factory.mktemp("llama"), layers=2)


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """A GPT2LMHeadModel folder, the kind ``multihead train lm`` writes (an architecture whose
    name does not end in ForCausalLM)."""
    return build("gpt2", tmp_path_factory.mktemp("gpt2"), layers=2)


def _output_projection(model, layer: int):
    if hasattr(model, "transformer"):  # GPT-2: c_proj takes the heads side by side
        return model.transformer.h[layer].attn.c_proj
    return model.model.layers[layer].self_attn.o_proj


def _loss_without(folder, layer: int, head: int) -> float:
    """The eager model's loss on TEXT with ``head`` of ``layer`` zeroed before the output
    projection."""
    from tokenizers import Tokenizer

    model = transformers_model(folder)
    ids = torch.tensor([Tokenizer.from_file(str(folder / "tokenizer.json")).encode(TEXT).ids])
    width = model.config.hidden_size // model.config.num_attention_heads

    def zero(module, args):
        x = args[0].clone()
        x[..., head * width : (head + 1) * width] = 0
        return (x,)

    with torch.no_grad():
        plain = float(model(input_ids=ids, labels=ids).loss)
        hook = _output_projection(model, layer).register_forward_pre_hook(zero)
        ablated = float(model(input_ids=ids, labels=ids).loss)
        hook.remove()
    return ablated - plain


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_a_causal_lm_ranked_by_the_loss_change(kind, request, tmp_path, capsys):
    llama = request.getfixturevalue(kind)  # the folder of either kind
    cli.main(
        ["heads", "--model", str(llama), "--out", str(tmp_path / "out"), "--method", "both", TEXT]
    )
    record = json.loads((tmp_path / "out" / "heads.json").read_text())
    assert record["metric"] == "increase of mean next-token cross-entropy"
    assert record["method"] == "ablate"
    scores = torch.tensor(record["scores"])
    assert scores.shape == (2, 4)
    layer, head = divmod(int(scores.argmax()), 4)
    want = _loss_without(llama, layer, head)
    assert abs(float(scores[layer, head]) - want) <= 1e-4 * max(1.0, abs(want))
    assert -1 <= record["spearman"] <= 1
    printed = capsys.readouterr().out
    assert f"layer  {layer} head  {head}" in printed and "Spearman" in printed
    assert (tmp_path / "out" / "heads.png").stat().st_size > 0
    # the scale of the scores: the eager model's own loss with every head on
    model = transformers_model(llama)
    from tokenizers import Tokenizer

    ids = torch.tensor([Tokenizer.from_file(str(llama / "tokenizer.json")).encode(TEXT).ids])
    with torch.no_grad():
        plain = float(model(input_ids=ids, labels=ids).loss)
    assert record["baseline_loss"] == pytest.approx(plain, rel=1e-5)
    assert f"baseline loss (mean next-token cross-entropy, every head on): {plain:.4f}" in printed
    # the model named as given, and both methods' top tens printed
    assert record["model"] == str(llama) and f"model: {llama} (2 layers x 4 heads)" in printed
    assert "(ablate); top ten heads" in printed and "(gradient); top ten heads" in printed


def test_both_methods_are_drawn(llama, tmp_path, monkeypatch):
    from multihead.apps import common

    panels = []
    original = common.save_figure

    def spy(fig, path):
        panels.append([a.get_title() for a in fig.axes if a.images])
        return original(fig, path)

    monkeypatch.setattr(common, "save_figure", spy)
    for method in ("both", "gradient"):
        heads.run(heads.HeadsOptions(text=TEXT, model=str(llama), out=tmp_path / method,
                                     method=method), say=lambda _: None)  # fmt: skip
    assert [[t.split(":")[0] for t in titles] for titles in panels] == [
        ["ablate", "gradient"],
        ["gradient"],
    ]


def test_a_multihead_save_folder_ranks_as_the_same_model_in_transformers(gpt2, tmp_path):
    """The library's own model (a multihead.save folder, as one saved from ``models.load``)
    is scaled at its attention modules' output projections: the same scores, both methods,
    as the transformers folder it came from."""
    import multihead as mh

    saved = tmp_path / "saved"
    mh.save(mh.models.load(gpt2), saved)
    found = {}
    for name, folder in (("transformers", gpt2), ("saved", saved)):
        out = tmp_path / name
        cli.main(["heads", "--model", str(folder), "--out", str(out), "--method", "both", TEXT])
        found[name] = json.loads((out / "heads.json").read_text())
    assert found["saved"]["metric"] == "increase of mean next-token cross-entropy"
    for key in ("scores", "gradient_scores"):
        got, want = torch.tensor(found["saved"][key]), torch.tensor(found["transformers"][key])
        assert (got - want).abs().max() <= 1e-5 * max(1.0, float(want.abs().max())), key


def test_the_gradient_estimate_is_minus_the_scale_gradient(llama):
    """Against a finite difference of the loss in one head's scale around 1."""
    import multihead.hf as mhf

    model, tok, causal = heads._load(llama)
    ids = torch.tensor([tok.encode(TEXT).ids])
    grad = heads.score_heads(model, ids, causal, "gradient")
    eps = 1e-3

    def loss(scale: float) -> float:
        with mhf.ablate(model, {1: [2]}, scale=scale), torch.no_grad():
            return float(model(input_ids=ids, labels=ids).loss)

    numeric = -(loss(1 + eps) - loss(1 - eps)) / (2 * eps)
    assert abs(grad[1][2] - numeric) <= 1e-3 * max(1.0, abs(numeric))


@pytest.mark.slow
def test_the_real_minilm_in_under_a_minute(tmp_path, capsys):
    import time

    start = time.perf_counter()
    cli.main(
        [
            "heads",
            "--out",
            str(tmp_path),
            "The animal didn't cross the street because it was too tired",
        ]
    )
    assert time.perf_counter() - start < 60
    record = json.loads((tmp_path / "heads.json").read_text())
    assert torch.tensor(record["scores"]).shape == (6, 12)  # 72 heads
    assert "1 - cosine" in record["metric"]


def test_bad_input(tmp_path, llama):
    with pytest.raises(ValueError, match="one of the two"):
        heads.run(heads.HeadsOptions(text=None, out=tmp_path / "o", model=llama))
    with pytest.raises(ValueError, match="the text is empty"):
        heads.run(heads.HeadsOptions(text="  ", out=tmp_path / "o", model=llama))
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        heads.run(heads.HeadsOptions(text="x y", out=tmp_path / "o", model=tmp_path))
    text = tmp_path / "t.txt"
    text.write_text(TEXT, encoding="utf-8")
    done = heads.run(heads.HeadsOptions(text=None, file=text, out=tmp_path / "o", model=llama))
    assert len(done.scores["ablate"]) == 2


def test_the_gradient_method_is_refused_for_an_encoder(tmp_path):
    with pytest.raises(ValueError, match="--method gradient needs a loss"):
        heads.run(heads.HeadsOptions(text="a b c", out=tmp_path, method="gradient"))


def test_the_command_takes_the_text_from_a_file_alone(tmp_path, llama):
    """TEXT may be left out when --file gives the text (an optional positional argument)."""
    text = tmp_path / "t.txt"
    text.write_text(TEXT, encoding="utf-8")
    out = tmp_path / "o"
    assert cli.main(["heads", "--model", str(llama), "--file", str(text), "--out", str(out)]) == 0
    assert len(json.loads((out / "heads.json").read_text())["scores"]) == 2


def test_a_gguf_file_ranks_as_the_folder_it_was_written_from(llama, tmp_path):
    """The same weights through ``multihead.hf.load`` (tests/hf/tiny_gguf.py writes them in
    llama.cpp's layout): the same scores, to float32 rounding of losses ~5."""
    from hf.tiny_gguf import write_gguf

    gguf_file = write_gguf(llama, tmp_path / "tiny.gguf")
    ranked = [
        heads.run(heads.HeadsOptions(text=TEXT, out=tmp_path / name, model=str(model)))
        for name, model in (("folder", llama), ("gguf", gguf_file))
    ]
    got, want = (torch.tensor(r.scores["ablate"]) for r in ranked)
    assert got.shape == (2, 4)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_a_model_that_is_neither_a_folder_nor_a_source_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"is not a folder, a \.gguf file or one of those names"):
        heads.run(heads.HeadsOptions(text=TEXT, out=tmp_path / "o", model="smolm2"))
