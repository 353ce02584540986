"""A model family is one ``Family`` record registered once: a toy decoder family defined here,
outside the library, is opened by ``models.load``, explained, exported, generates text, is
written in transformers' format, and is refused by ``serve`` by name, with no other change."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from decoders import VOCAB, write_tokenizer
from torch import Tensor, nn

from multihead import cli, models
from multihead.export import graph_spec, load_for_export
from multihead.models import families, kinds
from multihead.models.causal_lm import CausalLM
from multihead.models.folder_writing import save_pretrained
from multihead.models.loading import load_decoder
from multihead.modules import (
    FeedForward,
    MultiHeadAttention,
    TransformerDecoder,
    TransformerDecoderLayer,
)


@dataclass(frozen=True)
class ToyConfig:
    vocab_size: int
    width: int = 16
    layers: int = 2
    heads: int = 2
    tie_word_embeddings: bool = False

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ToyConfig:
        return cls(**{k: raw[k] for k in ("vocab_size", "width", "layers", "heads") if k in raw})


class ToyLM(CausalLM):
    """Token embeddings without positions, pre-norm decoder layers, an output layer."""

    def __init__(self, config: ToyConfig) -> None:
        super().__init__()
        self.config = config
        e = config.width
        self.tokens = nn.Embedding(config.vocab_size, e)
        layers = [
            TransformerDecoderLayer(
                MultiHeadAttention(e, config.heads),
                FeedForward(e, 2 * e),
                norm1=nn.LayerNorm(e),
                norm2=nn.LayerNorm(e),
            )
            for _ in range(config.layers)
        ]
        self.decoder = TransformerDecoder(layers, norm=nn.LayerNorm(e))
        self.lm_head = nn.Linear(e, config.vocab_size, bias=False)
        self.vocab_size, self.max_positions = config.vocab_size, None
        self.eos_token_ids, self.pad_token_id = [], 0

    def embed(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        return self.tokens(input_ids)


def _names(config: ToyConfig, tied: bool) -> dict[str, str]:
    """The checkpoint stores our own names under the prefix ``toy.``."""
    return {key: key for key in ToyLM(config).state_dict()}


def _load(path: str | Path, **kwargs: Any) -> ToyLM:
    return load_decoder(TOY, path, **kwargs)


TOY = models.Family(
    model_type="toylm",
    description="a toy decoder",
    model=ToyLM,
    load=_load,
    config=ToyConfig,
    causal=True,
    transformers="ToyForCausalLM",
    names=_names,
    prefix="toy.",
)


@pytest.fixture
def toy(tmp_path):
    """The family registered (and unregistered after), and a folder of it with weights and a
    tokenizer, as another library would write it."""
    models.all_families()  # the built-in ones registered first: the restore keeps them
    before = dict(families._FAMILIES)
    models.register(TOY)
    torch.manual_seed(0)
    config = ToyConfig(vocab_size=VOCAB)
    model = ToyLM(config)
    folder = tmp_path / "toy"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "toylm", **asdict(config)}))
    from safetensors.torch import save_file

    save_file(
        {f"toy.{k}": v for k, v in model.state_dict().items()}, str(folder / "model.safetensors")
    )
    write_tokenizer(folder, bos=False)
    yield folder, model
    families._FAMILIES.clear()
    families._FAMILIES.update(before)


def test_models_load_opens_it(toy):
    folder, model = toy
    back = models.load(folder)
    assert type(back) is ToyLM and not back.training and back.tokenizer is not None
    for name, value in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], value), name
    assert "toylm" in models.supported()
    assert kinds.folder_kind(folder).describe() == "a toy decoder (config.json model_type 'toylm')"
    # the decoder families' weight formats apply to it
    packed = models.load(folder, weights="int8")
    assert type(packed) is ToyLM


def test_explain_shows_its_causal_heads(toy, tmp_path, capsys):
    folder, _ = toy
    out = tmp_path / "explained"
    text = "the animal crossed the street"
    assert cli.main(["explain", text, "--model", str(folder), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "2 layers x 2 heads, causal: each token sees only earlier ones" in printed
    assert (out / "attention.html").stat().st_size > 1000


def test_export_takes_it_as_a_decoder(toy):
    folder, _ = toy
    model = load_for_export(folder)
    assert type(model) is ToyLM and graph_spec(model).kind == "decoder"


def test_generate_continues_a_prompt(toy, capsys):
    folder, _ = toy
    argv = ["generate", "--model", str(folder), "the animal", "--max-new-tokens", "4"]
    assert cli.main(argv) == 0
    model = models.load(folder)
    assert (
        capsys.readouterr().out == model.generate_text("the animal", 4)[len("the animal") :] + "\n"
    )


def test_serve_refuses_it_by_name(toy, capsys):
    folder, _ = toy
    assert cli.main(["serve", "--model", str(folder), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "holds a toy decoder (config.json model_type 'toylm'), but multihead serve " in err
    assert "supports sentence encoders: a BERT-family encoder" in err


def test_it_is_written_in_transformers_format(toy, tmp_path):
    folder, _ = toy
    model = models.load(folder)
    written = save_pretrained(model, tmp_path / "written")
    config = json.loads((written / "config.json").read_text())
    assert config["model_type"] == "toylm" and config["architectures"] == ["ToyForCausalLM"]
    back = models.load(written)
    for name, value in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], value), name
