"""Broken model folders get an error naming the file and what is wrong with it, before any
model is built, for every loader (the shared reader in multihead.folder_reading)."""

from __future__ import annotations

import datetime
import json
import pickle
import re
import shutil

import pytest
import torch
from decoders import build

from multihead.models import bert, gpt2, llama


@pytest.fixture
def bert_folder(pretrained, tmp_path):
    """A writable copy of all-MiniLM-L6-v2 (links to the big files, copies of the small)."""
    folder = tmp_path / "bert"
    folder.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "sentence_bert_config.json"):
        source = pretrained.path / name
        if name == "model.safetensors":
            (folder / name).symlink_to(source)
        else:
            shutil.copy(source, folder / name)
    return folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Pristine tiny GPT-2 and Llama folders (4 layers each), built once."""
    return {
        kind: build(kind, tmp_path_factory.mktemp(kind), layers=4) for kind in ("gpt2", "llama")
    }


def _writable(source, folder):
    shutil.copytree(source, folder)
    return folder


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b"", r"config.json in .* is empty; it must hold a JSON object"),
        (b"   \n", r"config.json in .* is empty"),
        (b'{"hidden_size": 384,', r"config.json in .* is not valid JSON: Expecting .* line 1"),
        (b"[1, 2]", r"config.json in .* must hold a JSON object .* Received: a JSON list"),
        (b"\xff\xfe{}", r"config.json in .* is not UTF-8 text"),
        (b"[" * 100_000 + b"]" * 100_000, r"config.json in .* nests lists or objects too deeply"),
    ],
    ids=["empty", "blank", "truncated", "list", "not_utf8", "deep"],
)
def test_bad_config_json(bert_folder, tiny, tmp_path, content, match):
    (bert_folder / "config.json").write_bytes(content)
    with pytest.raises(ValueError, match=match):
        bert.load(bert_folder)
    for kind, loader in (("gpt2", gpt2), ("llama", llama)):
        folder = _writable(tiny[kind], tmp_path / kind)
        (folder / "config.json").write_bytes(content)
        with pytest.raises(ValueError, match=match):
            loader.load(folder)


def test_empty_and_truncated_safetensors(bert_folder, pretrained, tiny, tmp_path):
    weights = bert_folder / "model.safetensors"
    weights.unlink()
    weights.write_bytes(b"")
    with pytest.raises(ValueError, match=r"model.safetensors in .* is empty \(0 bytes\)"):
        bert.load(bert_folder)
    whole = (pretrained.path / "model.safetensors").read_bytes()
    weights.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ValueError, match=r"model.safetensors in .* is truncated or corrupt"):
        bert.load(bert_folder)
    folder = _writable(tiny["llama"], tmp_path / "llama")
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[:100])
    with pytest.raises(ValueError, match=r"model.safetensors in .* is truncated or corrupt"):
        llama.load(folder)


@pytest.mark.parametrize(
    "content",
    ["garbage", "truncated", "python_object", "list"],
)
def test_unreadable_pytorch_bin_never_suggests_unsafe_loading(bert_folder, tmp_path, content):
    """torch's own message for these says to retry with weights_only=False, which would run
    code from the file; ours names the file and says to download or convert it instead."""
    (bert_folder / "model.safetensors").unlink()
    target = bert_folder / "pytorch_model.bin"
    if content == "garbage":
        target.write_bytes(b"this is not a checkpoint at all")
    elif content == "truncated":
        torch.save({"w": torch.zeros(1000)}, target)
        target.write_bytes(target.read_bytes()[:2000])
    elif content == "python_object":
        torch.save({"w": torch.zeros(2), "saved": datetime.date(2024, 1, 1)}, target)
    else:
        torch.save([torch.zeros(2)], target)
    match = (
        r"must hold a dict of tensors"
        if content == "list"
        else r"pytorch_model.bin in .* is not a readable PyTorch checkpoint"
    )
    with pytest.raises(ValueError, match=match) as caught:
        bert.load(bert_folder)
    assert "weights_only=False" not in str(caught.value)
    assert "weights_only" not in str(caught.value)


def test_corrupt_tokenizer_and_sentence_config(bert_folder, tiny, tmp_path):
    (bert_folder / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(ValueError, match=r"tokenizer.json in .* could not be read by the tokeni"):
        bert.load(bert_folder)
    folder = _writable(tiny["gpt2"], tmp_path / "gpt2")
    (folder / "tokenizer.json").write_text("")
    with pytest.raises(ValueError, match=r"tokenizer.json in .* could not be read"):
        gpt2.load(folder)


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ('{"max_seq_length": 256', r"sentence_bert_config.json in .* is not valid JSON"),
        ("", r"sentence_bert_config.json in .* is empty"),
        ('{"max_seq_length": "long"}', r"max_seq_length must be a positive int"),
    ],
    ids=["truncated", "empty", "bad_value"],
)
def test_corrupt_sentence_bert_config(bert_folder, content, match):
    (bert_folder / "sentence_bert_config.json").write_text(content)
    with pytest.raises(ValueError, match=match):
        bert.load(bert_folder)


def test_config_with_fewer_layers_than_the_weights_is_an_error(bert_folder, tiny, tmp_path):
    """config.json says 4 layers, the weights hold 6: the 2 extra layers' tensors are listed,
    nothing is loaded partly."""
    config = json.loads((bert_folder / "config.json").read_text())
    (bert_folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 4}))
    with pytest.raises(ValueError, match=r"hold 32 tensors the config does not use") as caught:
        bert.load(bert_folder)
    message = str(caught.value)
    assert "encoder.layer.4.attention.output.LayerNorm.bias" in message
    assert "and 12 more" in message and "encoder.layer.3." not in message
    for kind, loader, field, extra in (
        ("gpt2", gpt2, "n_layer", "h.2.attn.c_attn.bias"),
        ("llama", llama, "num_hidden_layers", "layers.2.input_layernorm.weight"),
    ):
        folder = _writable(tiny[kind], tmp_path / kind)
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, field: 2}))
        with pytest.raises(ValueError, match=rf"tensors the config does not use: .*{extra}"):
            loader.load(folder)


def test_more_layers_in_the_config_than_the_weights(tiny, tmp_path):
    folder = _writable(tiny["llama"], tmp_path / "llama")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 5}))
    with pytest.raises(ValueError, match=r"lack 9 tensors the config needs"):
        llama.load(folder)


def test_sharded_safetensors(tiny, tmp_path):
    """A model.safetensors.index.json and its shards load the same weights; a missing shard is
    named."""
    from safetensors.torch import load_file, save_file

    folder = _writable(tiny["llama"], tmp_path / "llama")
    state = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    names = sorted(state)
    shards = {
        "model-1.safetensors": names[: len(names) // 2],
        "model-2.safetensors": names[len(names) // 2 :],
    }
    for shard, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(folder / shard))
    index = {"weight_map": {k: shard for shard, keys in shards.items() for k in keys}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    ids = torch.tensor([[3, 4, 5, 6]])
    torch.testing.assert_close(
        llama.load(folder)(ids), llama.load(tiny["llama"])(ids), rtol=0, atol=0
    )
    (folder / "model-2.safetensors").unlink()
    with pytest.raises(
        FileNotFoundError, match=r"lists the shard model-2\.safetensors, which is missing"
    ):
        llama.load(folder)


def _edit(folder, **change):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))


@pytest.mark.parametrize("kind", ["bert", "gpt2", "llama"])
def test_sizes_are_checked_against_the_header_before_building(bert_folder, tiny, tmp_path, kind):
    """vocab_size=10**9 asked torch for 1.5 TB (a raw allocator error); the config now meets
    the safetensors header on a model built on the meta device, and the error names the
    tensor, its file and both shapes."""
    if kind == "bert":
        folder, loader, field, tensor = (
            bert_folder,
            bert,
            "vocab_size",
            r"embeddings\.word_embeddings\.weight has shape \(30522, 384\)",
        )
        implied = r"\(1000000000, 384\)"
    else:
        folder = _writable(tiny[kind], tmp_path / kind)
        loader = {"gpt2": gpt2, "llama": llama}[kind]
        field, tensor = "vocab_size", r"(wte|embed_tokens)\.weight has shape \(\d+, (\d+)\)"
        implied = r"\(1000000000, \2\)"
    _edit(folder, **{field: 10**9})
    with pytest.raises(
        ValueError, match=rf"weight {tensor} in model\.safetensors but the config implies {implied}"
    ):
        loader.load(folder)


def test_a_layer_count_far_beyond_the_weights_stops_the_build(tiny, tmp_path):
    folder = _writable(tiny["llama"], tmp_path / "llama")
    _edit(folder, num_hidden_layers=10**9)
    with pytest.raises(
        ValueError,
        match=r"config\.json in .* describes a model far larger than model\.safetensors holds.*"
        r"A layer count or size in config\.json is wrong for these weights",
    ):
        llama.load(folder)


@pytest.mark.parametrize(
    "shard", ["../other.safetensors", "/tmp/model-1.safetensors", "a/../../x.safetensors"]
)
def test_shard_paths_are_confined_to_the_folder(tiny, tmp_path, shard):
    """A model.safetensors.index.json naming a shard outside the folder is refused; the
    same file beside the folder would otherwise be read."""
    folder = _writable(tiny["llama"], tmp_path / "llama")
    (folder / "model.safetensors").rename(tmp_path / "other.safetensors")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "other.safetensors"), framework="pt") as f:
        names = list(f.keys())
    index = {"weight_map": dict.fromkeys(names, shard)}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(
        ValueError,
        match=r"model\.safetensors\.index\.json in .*: weight_map must name a file inside the "
        rf"model folder.*Received: weight_map='{re.escape(shard)}'",
    ):
        llama.load(folder)


@pytest.mark.parametrize("kind", ["bert", "llama"])
def test_a_pickle_where_safetensors_belong_is_named(bert_folder, tiny, tmp_path, kind):
    """Pickled bytes under the safetensors name: safetensors' own error (raw before) becomes
    one that names the file; the pickle is never unpickled."""
    folder = bert_folder if kind == "bert" else _writable(tiny[kind], tmp_path / kind)
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").write_bytes(pickle.dumps({"w": [1.0, 2.0]}))
    with pytest.raises(
        ValueError,
        match=r"model\.safetensors in .* is truncated or corrupt, or not a safetensors file",
    ):
        {"bert": bert, "llama": llama}[kind].load(folder)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_integer_weights_where_floats_belong_are_named(tiny, tmp_path, kind):
    """An int32 tensor was silently converted into the float parameter before."""
    from safetensors.torch import load_file, save_file

    folder = _writable(tiny[kind], tmp_path / kind)
    state = load_file(str(folder / "model.safetensors"))
    name = {"gpt2": "ln_f.weight", "llama": "model.norm.weight"}[kind]
    if name not in state:  # GPT-2 folders may keep the transformer. prefix
        name = f"transformer.{name}"
    state[name] = torch.ones_like(state[name], dtype=torch.int32)
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(
        ValueError,
        match=r"weight (ln_f|norm)\.weight is stored as torch\.int32 in model\.safetensors but "
        r"the model needs floating-point values there \(torch\.float32\).*"
        r"Received: (ln_f|norm)\.weight\.dtype=torch\.int32",
    ):
        {"gpt2": gpt2, "llama": llama}[kind].load(folder)
