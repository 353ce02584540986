"""`multihead explain --model DIR` on folders of architectures the library has no family for:
transformers loads them, multihead.hf.capture reads every head, and the weights equal
transformers' own eager output_attentions on the same folder."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from multihead import cli
from multihead.apps import explain

TEXT = "the animal did not cross the street because it was too tired"


def _byte_level_tokenizer() -> Tokenizer:
    """A byte-level BPE (as Qwen2's and RoBERTa's are), trained in milliseconds here."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([TEXT, "the cat sat on the mat", "it was a tired animal"] * 20, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos)]
    )
    return tok


def _config(name: str, vocab: int):
    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=64, pad_token_id=2)  # fmt: skip
    if name == "qwen2":
        return tf.Qwen2Config(**common, num_key_value_heads=2, initializer_range=0.2)
    if name == "modernbert":
        return tf.ModernBertConfig(**common, local_attention=4, global_attn_every_n_layers=2,
                                   initializer_range=0.2)  # fmt: skip
    return tf.BartConfig(vocab_size=vocab, d_model=32, encoder_layers=2, decoder_layers=2,
                         encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=48,
                         decoder_ffn_dim=48, max_position_embeddings=64, init_std=0.2,
                         pad_token_id=2, bos_token_id=0, eos_token_id=1)  # fmt: skip


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    tokenizer = _byte_level_tokenizer()
    made = {}
    for name in ("qwen2", "modernbert", "bart"):
        folder = tmp_path_factory.mktemp(name)
        torch.manual_seed(0)
        tf.AutoModel.from_config(_config(name, tokenizer.get_vocab_size())).save_pretrained(folder)
        tokenizer.save(str(folder / "tokenizer.json"))
        made[name] = folder
    return made


def _eager(folder, text: str) -> torch.Tensor:
    """Every head of every (encoder) layer, from transformers' eager attention."""
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = torch.tensor([tokenizer.encode(text).ids])
    model = tf.AutoModel.from_pretrained(folder, attn_implementation="eager").eval()
    run = model.get_encoder() if model.config.is_encoder_decoder else model
    with torch.no_grad():
        out = run(input_ids=ids, output_attentions=True)
    return torch.stack([w[0] for w in out.attentions])


@pytest.mark.parametrize(
    ("name", "causal"), [("qwen2", True), ("modernbert", False), ("bart", False)]
)
def test_explain_a_transformers_folder(folders, tmp_path, name, causal):
    lines = []
    options = explain.ExplainOptions(text=TEXT, focus="tired", out=tmp_path, model=folders[name])
    got = explain.run(options, say=lines.append)
    assert got.tokens[got.focus] == "tired"  # decoded from the byte-level "Ġtired"
    want = _eager(folders[name], TEXT)
    assert got.weights.shape == want.shape and got.weights.shape[:2] == (2, 4)
    assert (got.weights - want).abs().max() <= 1e-5
    printed = "\n".join(lines)
    assert ("causal: each token sees only earlier ones" in printed) == causal
    for key, path in got.files.items():  # the figures and the head view: more than a stub
        assert path.stat().st_size > (100 if key == "attribution" else 3_000)


def test_explain_cli_on_a_transformers_folder(folders, tmp_path, capsys):
    assert (
        cli.main(["explain", TEXT, "--model", str(folders["qwen2"]), "--out", str(tmp_path)]) == 0
    )
    assert "model: " in capsys.readouterr().out


def test_a_folder_without_tokenizer_is_refused(folders, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((folders["qwen2"] / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match=r"explain needs the model's tokenizer.json"):
        options = explain.ExplainOptions(text=TEXT, out=tmp_path / "out", model=bare)
        explain.run(options, say=lambda s: None)


@pytest.mark.parametrize("name", ["qwen2", "modernbert"])
def test_rollout_from_head_means_equals_rollout_of_eager_weights(folders, tmp_path, name):
    from multihead.inspect import rollout

    options = explain.ExplainOptions(
        text=TEXT, focus="tired", out=tmp_path, model=folders[name], rollout=True
    )
    got = explain.run(options, say=lambda line: None)
    assert got.files["rollout"].stat().st_size > 3_000
    means = explain._head_means(TEXT, explain._load(folders[name]))
    want = rollout(_eager(folders[name], TEXT))
    assert (rollout(means[:, None]) - want).abs().max() <= 1e-5
