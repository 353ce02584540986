"""A command given a model folder of a kind it does not take says what the folder holds (from
its config.json) and what the command supports, before loading anything; before, each fell
through to the BERT loader and reported a missing tokenizer.json."""

from __future__ import annotations

import json
import re

import pytest

import multihead as mh
from multihead import cli
from multihead.apps.sentiment import AttentionClassifier
from multihead.models import kinds


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("kinds")
    made = {}
    for kind in ("gpt2", "t5", "mistral"):
        made[kind] = root / kind
        made[kind].mkdir()
        (made[kind] / "config.json").write_text(json.dumps({"model_type": kind}))
    made["saved"] = mh.save(AttentionClassifier(10, embed_dim=8, num_heads=2), root / "saved")
    return made


GPT2 = r"holds a GPT-2 decoder \(config.json model_type 'gpt2'\)"
T5 = r"holds a 't5' model \(config.json model_type 't5'\)"
MISTRAL = r"holds a 'mistral' model \(config.json model_type 'mistral'\)"
SAVED = (
    r"holds a multihead.save folder of multihead.apps.sentiment.AttentionClassifier "
    r"\(config.json model.class\)"
)
BERT_ONLY = r"supports BERT-family encoders \(config.json model_type 'bert'"
EXPORTS = r"supports BERT-family encoders .* GPT-2 and Llama decoders .* multihead.save folders"
EXPLAINS = r"supports language models: BERT-family encoders .* GPT-2 and Llama decoders"


@pytest.mark.parametrize(
    ("command", "kind", "found", "supported", "received"),
    [
        ("serve", "gpt2", GPT2, BERT_ONLY, "model_type='gpt2'"),
        ("embed", "gpt2", GPT2, BERT_ONLY, "model_type='gpt2'"),
        ("export", "t5", T5, EXPORTS, "model_type='t5'"),
        ("export", "mistral", MISTRAL, EXPORTS, "model_type='mistral'"),
        ("export", "saved", SAVED, EXPORTS, "model.class='multihead.apps.sentiment"),
        ("explain", "saved", SAVED, EXPLAINS, "model.class='multihead.apps.sentiment"),
    ],
)
def test_wrong_kind_is_named_with_what_the_command_supports(
    folders, tmp_path, capsys, command, kind, found, supported, received
):
    model = str(folders[kind])
    args = {
        "serve": ["serve", "--model", model, "--port", "0"],
        "embed": [
            "embed",
            str(tmp_path / "lines.txt"),
            "--out",
            str(tmp_path / "e.npy"),
            "--model",
            model,
        ],
        "export": ["export", "onnx", "--model", model, "--out", str(tmp_path / "m.onnx")],
        "explain": ["explain", "a text", "--model", model, "--out", str(tmp_path / "x")],
    }[command]
    (tmp_path / "lines.txt").write_text("one line\n")
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"multihead {command}: error: {model} ")
    for part in (found, supported, rf"Received: {received}"):
        assert re.search(part, err), (part, err)
    assert "tokenizer.json" not in err
    assert not list(tmp_path.glob("m.onnx*")) and not (tmp_path / "e.npy").exists()


def test_folder_kind(folders, tiny_bert, tmp_path):
    assert kinds.folder_kind(None) is None
    assert kinds.folder_kind(tmp_path) is None  # no config.json: the loader names it
    assert kinds.folder_kind(tiny_bert).kind == "bert"
    saved = kinds.folder_kind(folders["saved"])
    assert (saved.kind, saved.saved_class) == (
        kinds.SAVED,
        "multihead.apps.sentiment.AttentionClassifier",
    )
    (tmp_path / "config.json").write_text("{}")
    assert kinds.folder_kind(tmp_path).kind is None
    (tmp_path / "config.json").write_text("[1]")
    with pytest.raises(ValueError, match=r"must hold a JSON object"):
        kinds.folder_kind(tmp_path)
