"""multihead.save / multihead.load: exact round trips, the Hugging Face layout for BERT (opened
by transformers itself), and every error naming the tensor or field at fault."""

from __future__ import annotations

import inspect
import json
import os
import re
import signal

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import multihead as mh
from multihead import io


def _same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert sa[key].dtype == sb[key].dtype, key
        assert torch.equal(sa[key], sb[key]), key


def test_attention_round_trip_keeps_every_argument(tmp_path):
    torch.manual_seed(0)
    mha = mh.MultiHeadAttention(
        24, 6, kdim=5, vdim=7, num_kv_heads=2, bias=False, dropout=0.25, head_dim=3, out_dim=10
    )
    mh.save(mha, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["format_version"] == io.FORMAT_VERSION
    assert config["model"] == {
        "class": "multihead.MultiHeadAttention",
        "args": {
            "embed_dim": 24,
            "num_heads": 6,
            "kdim": 5,
            "vdim": 7,
            "num_kv_heads": 2,
            "bias": False,
            "dropout": 0.25,
            "head_dim": 3,
            "value_head_dim": 3,  # resolved from head_dim: the same module
            "out_dim": 10,
            "rotary": None,
        },
    }
    back = mh.load(tmp_path)
    assert type(back) is mh.MultiHeadAttention and not back.training
    _same_state(mha, back)
    q, k, v = torch.randn(2, 9, 24), torch.randn(2, 11, 5), torch.randn(2, 11, 7)
    mha.eval()
    assert torch.equal(mha(q, k, v), back(q, k, v))


@pytest.mark.parametrize("norm_first", [False, True], ids=["post_norm", "pre_norm"])
def test_encoder_stack_round_trip(tmp_path, norm_first):
    torch.manual_seed(1)
    layers = [
        mh.TransformerEncoderLayer(
            16, 4, 40, activation="relu", norm_first=norm_first, layer_norm_eps=1e-6
        )
        for _ in range(3)
    ]
    encoder = mh.TransformerEncoder(layers, norm=nn.LayerNorm(16) if norm_first else None)
    mh.save(encoder, tmp_path)
    back = mh.load(tmp_path)
    _same_state(encoder, back)
    assert back.layers[0].norm_first is norm_first
    assert back.layers[2].norm1.eps == 1e-6
    x = torch.randn(3, 13, 16)
    mask = mh.masks.lengths(torch.tensor([13, 5, 9]))
    assert torch.equal(encoder.eval()(x, mask=mask), back(x, mask=mask))


def test_positional_encodings_round_trip(tmp_path):
    learned = mh.LearnedPositionalEncoding(33, 8)
    mh.save(learned, tmp_path / "learned")
    back = mh.load(tmp_path / "learned")
    _same_state(learned, back)
    fixed = mh.SinusoidalPositionalEncoding(10, max_len=40, base=500.0)
    mh.save(fixed, tmp_path / "fixed")
    assert load_file(str(tmp_path / "fixed" / "model.safetensors")) == {}  # a table, no weights
    again = mh.load(tmp_path / "fixed")
    x = torch.randn(2, 50, 10)  # longer than max_len: the table is extended the same way
    assert torch.equal(fixed(x), again(x))
    assert again.base == 500.0


def test_a_new_class_with_injected_parts_is_one_register_call(tmp_path):
    """What a decoder layer will need: constructor arguments that are modules (an attention,
    a norm, a list of feed-forwards), described recursively."""

    class Block(nn.Module):
        def __init__(self, attention: nn.Module, norm: nn.Module, ffs: list, *, scale=0.5):
            super().__init__()
            self.attention, self.norm, self.ffs, self.scale = (
                attention,
                norm,
                nn.ModuleList(ffs),
                scale,
            )

        def forward(self, x):
            x = x + self.scale * self.attention(self.norm(x), mask=mh.masks.causal())
            for ff in self.ffs:
                x = x + ff(x)
            return x

    io.register(Block)
    torch.manual_seed(2)
    block = Block(
        mh.MultiHeadAttention(12, 3, num_kv_heads=1),
        nn.RMSNorm(12, eps=1e-6),
        [
            mh.FeedForward(12, 20, activation="gelu_tanh"),
            nn.Sequential(nn.Linear(12, 12), nn.SiLU()),
        ],
        scale=0.25,
    )
    mh.save(block, tmp_path)
    spec = json.loads((tmp_path / "config.json").read_text())["model"]
    assert spec["args"]["attention"]["args"]["num_kv_heads"] == 1
    assert spec["args"]["norm"] == {
        "class": "torch.nn.RMSNorm",
        "args": {"normalized_shape": [12], "eps": 1e-6, "elementwise_affine": True},
    }
    back = mh.load(tmp_path)
    _same_state(block, back)
    x = torch.randn(2, 7, 12)
    assert torch.equal(block.eval()(x), back(x))


def test_values_changed_after_construction_are_saved(tmp_path):
    mha = mh.MultiHeadAttention(8, 2, dropout=0.1)
    mha.dropout = 0.3  # as the BERT loader does for attention dropout
    mh.save(mha, tmp_path)
    assert mh.load(tmp_path).dropout == 0.3


def test_dtype_and_wrappers(tmp_path):
    mha = mh.MultiHeadAttention(8, 2).to(torch.bfloat16)
    mh.save(torch.compile(mha), tmp_path)  # the compile wrapper is removed before saving
    back = mh.load(tmp_path)
    assert back.q_proj.weight.dtype == torch.bfloat16
    _same_state(mha, back)


def test_a_file_mixing_dtypes_is_refused_at_load_with_the_tensor_named(tmp_path):
    """One float16 tensor among float32 ones loaded, then failed in forward with torch's raw
    "self and mat2 must have the same dtype"."""
    mh.save(mh.MultiHeadAttention(8, 2), tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    state["k_proj.weight"] = state["k_proj.weight"].half()
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        ValueError,
        match=r"the weights in model\.safetensors in .* mix floating-point dtypes: 7 tensors "
        r"are torch\.float32 but k_proj\.weight is torch\.float16, .*convert those tensors of "
        r"the file to torch\.float32\. Received: k_proj\.weight\.dtype=torch\.float16$",
    ):
        mh.load(tmp_path)


class _HalfTable(nn.Module):
    """A bfloat16 table built beside a float32 projection, as packed weights are."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(n, 4).bfloat16())
        self.proj = nn.Linear(4, 2)


def test_tensors_built_in_different_dtypes_are_not_a_mix(tmp_path):
    """Only a tensor saved in another dtype than the others built with it is refused: a bf16
    tensor built beside float32 ones loads as saved, and so does a model cast whole."""
    io.register(_HalfTable)
    mh.save(_HalfTable(3), tmp_path / "built")
    back = mh.load(tmp_path / "built")
    assert (back.table.dtype, back.proj.weight.dtype) == (torch.bfloat16, torch.float32)
    mh.save(_HalfTable(3).half(), tmp_path / "cast")
    back = mh.load(tmp_path / "cast")
    assert {p.dtype for p in back.parameters()} == {torch.float16}


def test_bert_folder_opens_in_transformers_and_round_trips(tmp_path, pretrained):
    """Hugging Face's BertModel, loading our folder by itself, computes the same hidden states
    as our model (1e-5: the fp32 agreement the BERT parity tests measure, at most 7.8e-6)."""
    from transformers import AutoTokenizer, BertModel

    mh.save(pretrained, tmp_path)
    names = {p.name for p in tmp_path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "vocab.txt"} <= names
    stored = load_file(str(tmp_path / "model.safetensors"))
    assert "encoder.layer.5.attention.self.query.weight" in stored

    back = mh.load(tmp_path)
    assert type(back).__name__ == "Pretrained" and back.embed_length == pretrained.embed_length
    _same_state(pretrained.model, back.model)

    hf = BertModel.from_pretrained(tmp_path, attn_implementation="eager").eval()
    texts = ["The movie was not good at all.", "A quiet, lovely afternoon by the river!"]
    hf_tokens = AutoTokenizer.from_pretrained(tmp_path)(texts, padding=True, return_tensors="pt")
    batch, ours = back(texts)
    assert torch.equal(hf_tokens["input_ids"], batch.input_ids)
    with torch.no_grad():
        theirs = hf(**hf_tokens).last_hidden_state
    for i, n in enumerate(batch.lengths.tolist()):
        assert (theirs[i, :n] - ours.last_hidden_state[i, :n]).abs().max() <= 1e-5

    mh.save(pretrained.model, tmp_path / "bare")  # the Bert module alone loads as a Bert
    bare = mh.load(tmp_path / "bare")
    assert type(bare).__name__ == "Bert"
    _same_state(pretrained.model, bare)


def test_plain_hugging_face_bert_folder_loads(pretrained):
    back = mh.load(pretrained.path)  # no multihead fields: read as models.bert.load would
    _same_state(pretrained.model, back.model)


# ---------------------------------------------------------------------------------------------
# errors


@pytest.fixture
def saved(tmp_path):
    return mh.save(mh.MultiHeadAttention(8, 2), tmp_path / "saved")


def _edit_weights(folder, change):
    state = load_file(str(folder / "model.safetensors"))
    change(state)
    save_file(state, str(folder / "model.safetensors"))


def test_missing_tensor_is_named(saved):
    _edit_weights(saved, lambda s: s.pop("k_proj.bias"))
    with pytest.raises(ValueError, match=r"lack 1 tensors the config needs: k_proj\.bias\."):
        mh.load(saved)


def test_unexpected_tensor_is_named(saved):
    _edit_weights(saved, lambda s: s.update(extra=torch.zeros(2)))
    with pytest.raises(ValueError, match=r"hold 1 tensors the config does not use: extra\."):
        mh.load(saved)


def test_shape_mismatch_is_named(saved):
    config = json.loads((saved / "config.json").read_text())
    config["model"]["args"]["kdim"] = 5
    (saved / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError,
        match=r"k_proj\.weight has shape \(8, 8\) in model\.safetensors but the config implies "
        r"\(8, 5\)",
    ):
        mh.load(saved)


def test_unknown_format_version(saved):
    config = json.loads((saved / "config.json").read_text())
    config["format_version"] = 99
    (saved / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError,
        match=r"format_version 99 is not one this multihead reads.*Received: format_version=99",
    ):
        mh.load(saved)


def test_unknown_class_and_bad_arguments(saved):
    config = json.loads((saved / "config.json").read_text())
    config["model"]["class"] = "somewhere.Nope"
    (saved / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError,
        match=r"model.class names a class that is not registered.*"
        r"Received: model.class='somewhere.Nope'",
    ):
        mh.load(saved)
    config["model"] = {
        "class": "multihead.MultiHeadAttention",
        "args": {"embed_dim": 8, "heads": 2},
    }
    (saved / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError,
        match=r"model: multihead.MultiHeadAttention cannot be built from the saved arguments",
    ):
        mh.load(saved)


def test_missing_files_and_foreign_folders(tmp_path, saved):
    with pytest.raises(FileNotFoundError, match="model folder not found"):
        mh.load(tmp_path / "nowhere")
    (saved / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"the weights file model\.safetensors is missing"):
        mh.load(saved)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text('{"hidden_size": 4}')
    with pytest.raises(ValueError, match="the field format_version is missing"):
        mh.load(tmp_path / "other")
    with pytest.raises(FileNotFoundError, match=r"config\.json is missing"):
        mh.load(tmp_path)


def test_unregistered_modules_and_non_data_arguments_refuse_to_save(tmp_path):
    with pytest.raises(
        TypeError,
        match=r"model: Conv1d is not a registered class.*Received: torch.nn.modules.conv.Conv1d",
    ):
        mh.save(nn.Conv1d(2, 2, 1), tmp_path)

    class Holder(nn.Module):
        def __init__(self, table):
            super().__init__()
            self.table = table

    io.register(Holder)
    with pytest.raises(TypeError, match=r"model.args.table: a Tensor cannot be written as data"):
        mh.save(Holder(torch.zeros(2)), tmp_path)
    with pytest.raises(TypeError, match=r"register needs a constructor without \*args"):
        io.register(type("Star", (nn.Module,), {"__init__": lambda self, *a: None}))


def test_decoder_stack_with_injected_parts_round_trips(tmp_path):
    torch.manual_seed(3)
    dim, heads, kv_heads = 32, 8, 2
    layers = [
        mh.TransformerDecoderLayer(
            mh.MultiHeadAttention(
                dim,
                heads,
                num_kv_heads=kv_heads,
                bias=False,
                rotary=mh.RotaryEmbedding(dim // heads, base=500.0, interleaved=True),
            ),
            mh.GatedFeedForward(dim, 40),
            norm1=mh.RMSNorm(dim, eps=1e-5),
            norm2=mh.RMSNorm(dim, eps=1e-5),
        )
        for _ in range(2)
    ]
    decoder = mh.TransformerDecoder(layers, norm=mh.RMSNorm(dim)).eval()
    mh.save(decoder, tmp_path)
    back = mh.load(tmp_path)
    _same_state(decoder, back)
    rotary = back.layers[1].self_attn.rotary
    assert (rotary.base, rotary.interleaved) == (500.0, True)
    x = torch.randn(2, 7, dim)
    with torch.no_grad():
        assert torch.equal(decoder(x), back(x))


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_loaded_decoders_round_trip_with_their_tokenizer(tmp_path, kind):
    from models.decoders import build

    from multihead.models import gpt2, llama

    loader = {"gpt2": gpt2, "llama": llama}[kind]
    lm = loader.load(build(kind, tmp_path / "hf"))
    mh.save(lm, tmp_path / "saved")
    back = mh.load(tmp_path / "saved")
    assert type(back) is type(lm) and back.config == lm.config and not back.training
    _same_state(lm, back)
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0]])
    lengths = torch.tensor([4, 2])
    with torch.no_grad():
        assert torch.equal(lm(ids, lengths=lengths), back(ids, lengths=lengths))
    assert back.generate_text("the weather", 8) == lm.generate_text("the weather", 8)


# ---------------------------------------------------------------------------------------------
# atomic save

_KILLED_SAVE = """
import os, signal, sys
import torch
import multihead as mh
import multihead._atomic
import safetensors.torch

module, attr, when = sys.argv[2].split(":")
owner = {"safetensors": safetensors.torch, "atomic": multihead._atomic,
         "shutil": multihead._atomic.shutil}[module]
real = getattr(owner, attr)

def killing(*args, **kwargs):
    if when == "before":
        os.kill(os.getpid(), signal.SIGKILL)
    real(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGKILL)

setattr(owner, attr, killing)
torch.manual_seed(1)
mh.save(mh.MultiHeadAttention(12, 3, num_kv_heads=1), sys.argv[1])
raise SystemExit("the save was not killed")
"""


def _model_a():
    torch.manual_seed(0)
    return mh.MultiHeadAttention(8, 2)


def _model_b():
    torch.manual_seed(1)
    return mh.MultiHeadAttention(12, 3, num_kv_heads=1)


@pytest.mark.parametrize(
    ("point", "survivor"),
    [
        ("safetensors:save_file:before", "old"),  # nothing of the new checkpoint written
        ("safetensors:save_file:after", "old"),  # new weights written, config.json not yet
        ("atomic:_fsync_tree:before", "old"),  # every new file written, not yet swapped in
        ("shutil:rmtree:before", "new"),  # swapped in, the old folder not yet removed
    ],
    ids=["before_weights", "between_files", "before_swap", "after_swap"],
)
def test_save_killed_at_any_point_leaves_a_loadable_checkpoint(tmp_path, point, survivor):
    """A SIGKILL during a save over an existing checkpoint leaves the old checkpoint or the
    new one, whole and loadable (A's config never beside B's weights); the killed save's
    temporary folder is removed by the next save, and a user's file survives all of it."""
    import subprocess
    import sys

    from multihead._atomic import stale_temporaries

    dest = tmp_path / "model"
    mh.save(_model_a(), dest)
    (dest / "notes.txt").write_text("trained on the March data")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(
        [sys.executable, "-c", _KILLED_SAVE, str(dest), point], env=env, timeout=120
    )
    assert proc.returncode == -signal.SIGKILL
    expected = _model_a() if survivor == "old" else _model_b()
    back = mh.load(dest)
    assert (back.embed_dim, back.num_heads) == (expected.embed_dim, expected.num_heads)
    _same_state(expected, back)
    assert (dest / "notes.txt").read_text() == "trained on the March data"
    assert len(stale_temporaries(dest)) == 1
    mh.save(_model_b(), dest)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    _same_state(_model_b(), mh.load(dest))
    assert (dest / "notes.txt").read_text() == "trained on the March data"


def test_save_carries_other_files_over_and_replaces_its_own_as_a_set(tmp_path, pretrained):
    """A user's files and folders in the destination survive a save; files of an earlier
    save that the new model does not write (a BERT's tokenizer beside an attention module)
    do not linger, where load would pick them up as the new model's."""
    dest = tmp_path / "model"
    mh.save(pretrained, dest)
    assert (dest / "tokenizer.json").is_file() and (dest / "vocab.txt").is_file()
    (dest / "logs").mkdir()
    (dest / "logs" / "train.log").write_text("step 1: loss 2.5\n")
    (dest / "README.md").write_text("my model\n")
    dest.chmod(0o700)
    mh.save(_model_a(), dest)
    assert dest.stat().st_mode & 0o777 == 0o700
    assert sorted(p.name for p in dest.iterdir()) == [
        "README.md",
        "config.json",
        "logs",
        "model.safetensors",
    ]
    assert (dest / "logs" / "train.log").read_text() == "step 1: loss 2.5\n"
    assert (dest / "README.md").read_text() == "my model\n"
    _same_state(_model_a(), mh.load(dest))


def test_save_follows_a_symlinked_folder_and_refuses_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    mh.save(_model_a(), tmp_path / "link")
    assert (tmp_path / "link").is_symlink()
    _same_state(_model_a(), mh.load(tmp_path / "real"))
    work = tmp_path / "project" / "run"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    for folder in (".", work, work.parent):
        with pytest.raises(
            ValueError, match=r"cannot write into the working directory.*Received: folder="
        ):
            mh.save(_model_a(), folder)
    mh.save(_model_a(), "model")  # a folder below the working directory is fine
    _same_state(_model_a(), mh.load(work / "model"))


# ---------------------------------------------------------------------------------------------
# config.json against the weights, before anything is built for real


def _edit_config(folder, change):
    config = json.loads((folder / "config.json").read_text())
    change(config)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("embed_dim", "implied"),
    [(65536, r"\(8, 65536\)"), (10**9, r"\(8, 1000000000\)")],
    ids=["17GB", "1e9"],
)
def test_sizes_in_the_config_are_checked_against_the_header_first(saved, embed_dim, implied):
    """A 2 KB folder whose config claims embed_dim=65536 (17 GB of weights) or 10**9 gets an
    error naming both shapes, from a model built on the meta device: nothing is allocated."""
    _edit_config(saved, lambda c: c["model"]["args"].update(embed_dim=embed_dim))
    with pytest.raises(
        ValueError,
        match=rf"weight q_proj\.weight has shape \(8, 8\) in model\.safetensors but the config "
        rf"implies {implied}.*Received: q_proj\.weight\.shape=\(8, 8\)",
    ):
        mh.load(saved)


def test_a_layer_count_far_beyond_the_weights_stops_the_build(tmp_path):
    """A config asking for a billion layers: the meta build stops after a budget set by the
    number of stored tensors, within a second instead of running for hours."""
    from multihead.models import gpt2

    config = gpt2.GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=2, n_head=2)
    mh.save(gpt2.GPT2(config), tmp_path / "saved")
    _edit_config(
        tmp_path / "saved", lambda c: c["model"]["args"]["config"]["dict"].update(n_layer=10**9)
    )
    with pytest.raises(
        ValueError,
        match=r"^config\.json in \S+ describes a model far larger than model\.safetensors holds: "
        r"building it stopped after (\d+) tensor operations while the file has (\d+) tensors.*"
        r"Received: \2 stored tensors",
    ):
        mh.load(tmp_path / "saved")


@pytest.mark.parametrize(
    "weights",
    [
        "/etc/model.safetensors",
        "../other/model.safetensors",
        "sub/../../other/model.safetensors",
        ".",
        "",
    ],
    ids=["absolute", "parent", "climbing", "the_folder", "empty"],
)
def test_the_weights_path_is_confined_to_the_folder(tmp_path, weights):
    """config.json's "weights" may not point outside the folder: here ../other holds a
    checkpoint of the same shape that would otherwise be loaded in its place."""
    mh.save(_model_a(), tmp_path / "model")
    mh.save(mh.MultiHeadAttention(8, 2), tmp_path / "other")
    _edit_config(tmp_path / "model", lambda c: c.update(weights=weights))
    with pytest.raises(
        ValueError,
        match=r"config\.json in .*: weights must name a file inside the model folder.*"
        rf"Received: weights='{re.escape(weights)}'",
    ):
        mh.load(tmp_path / "model")
    _edit_config(tmp_path / "model", lambda c: c.update(weights=5))
    with pytest.raises(ValueError, match=r"weights must name a file .* Received: weights=5"):
        mh.load(tmp_path / "model")


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("kdim", {"dict": 5}, r"model\.args\.kdim\.dict must be an object\. Received: .*=5"),
        ("kdim", {"tuple": 5}, r"model\.args\.kdim\.tuple must be a list\. Received: .*=5"),
        ("dropout", {"float": "abc"}, r"model\.args\.dropout\.float must be one of 'nan'"),
        ("dropout", {"dtype": "nn"}, r"model\.args\.dropout\.dtype is not a torch dtype"),
        ("kdim", "8", r"model\.args\.kdim must be an int or null .*Received: .*kdim='8'"),
        ("bias", "no", r"model\.args\.bias must be true or false .*Received: .*bias='no'"),
        ("embed_dim", 8.0, r"model\.args\.embed_dim must be an int .*embed_dim=8\.0"),
        ("num_heads", True, r"model\.args\.num_heads must be an int .*num_heads=True"),
        ("kdim", "nested", r"nests values more than 64 levels deep"),
    ],
    ids=[
        "dict_tag",
        "tuple_tag",
        "float_tag",
        "dtype_tag",
        "str_for_int",
        "str_for_bool",
        "float_for_int",
        "bool_for_int",
        "deep",
    ],
)
def test_bad_config_values_name_the_file_and_the_field(saved, field, value, match):
    if value == "nested":
        value = 8
        for _ in range(100):
            value = [value]
    _edit_config(saved, lambda c: c["model"]["args"].update({field: value}))
    with pytest.raises(ValueError, match=rf"config\.json in .*saved: .*{match}"):
        mh.load(saved)


def test_norm_first_must_be_a_bool(tmp_path):
    """The constructor's annotation (norm_first: bool) is the check: "no" was accepted (and
    taken as True) before."""
    mh.save(mh.TransformerEncoder([mh.TransformerEncoderLayer(8, 2, 16)]), tmp_path)
    _edit_config(
        tmp_path, lambda c: c["model"]["args"]["layers"][0]["args"].update(norm_first="no")
    )
    with pytest.raises(
        ValueError,
        match=r"config\.json in .*: model\.args\.layers\[0\]\.args\.norm_first must be true or "
        r"false .*Received: model\.args\.layers\[0\]\.args\.norm_first='no'",
    ):
        mh.load(tmp_path)


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b"\xff\xfe{}", r"config\.json in .* is not UTF-8 text"),
        (b"[" * 100_000 + b"]" * 100_000, r"config\.json in .* nests lists or objects too deeply"),
        (b"", r"config\.json in .* is empty"),
    ],
    ids=["not_utf8", "deep_json", "empty"],
)
def test_unreadable_config_json_is_named(saved, content, match):
    (saved / "config.json").write_bytes(content)
    with pytest.raises(ValueError, match=match):
        mh.load(saved)


@pytest.mark.parametrize("content", ["pickle", "empty", "truncated", "text"])
def test_unreadable_weights_are_named(saved, content):
    import pickle

    file = saved / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(
        {
            "pickle": pickle.dumps({"q_proj.weight": [[0.0] * 8] * 8}),
            "empty": b"",
            "truncated": data[: len(data) - 20],
            "text": b"version https://git-lfs.github.com/spec/v1\n",
        }[content]
    )
    match = "is empty" if content == "empty" else "is truncated or corrupt, or not a safetensors"
    with pytest.raises(ValueError, match=rf"model\.safetensors in .*saved {match}"):
        mh.load(saved)


def test_integer_tensor_where_floats_belong_is_named(saved):
    _edit_weights(saved, lambda s: s.update({"q_proj.weight": torch.ones(8, 8, dtype=torch.int32)}))
    with pytest.raises(
        ValueError,
        match=r"weight q_proj\.weight is stored as torch\.int32 in model\.safetensors but the "
        r"model needs floating-point values there \(torch\.float32\)",
    ):
        mh.load(saved)


def test_every_library_class_has_annotations_load_can_check():
    """The type checks on saved arguments come from the constructors' annotations: each of
    the library's registered classes must have them resolvable, or its arguments would go
    unchecked."""
    import multihead.apps.crossmodal
    import multihead.apps.forecast
    import multihead.apps.sentiment  # noqa: F401 - registers its models

    io.registered()  # takes in the classes declared with @saveable in their own files
    checked = [
        c for c in io._BY_CLASS.values() if c.init is not None and c.name.startswith("multihead.")
    ]
    assert len(checked) >= 17
    for codec in checked:
        hints = io._hints(codec.init)
        params = [p for p in inspect.signature(codec.init).parameters if p not in ("self",)]
        assert set(params) - {"unexpected"} <= set(hints), codec.name


class _ReadsValues(nn.Module):
    """A constructor that reads a tensor's value, which the meta device cannot give."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.scale = float(torch.ones(1).sum())


def test_a_class_that_cannot_be_built_on_meta_still_loads(tmp_path):
    """The meta pass is a guard, not a requirement: such a class loads, and its weights are
    still checked against the config after the real build."""
    io.register(_ReadsValues)
    torch.manual_seed(4)
    model = _ReadsValues(6)
    mh.save(model, tmp_path)
    _same_state(model, mh.load(tmp_path))
    _edit_config(tmp_path, lambda c: c["model"]["args"].update(width=5))
    with pytest.raises(
        ValueError, match=r"linear\.weight has shape \(6, 6\) in model\.safetensors"
    ):
        mh.load(tmp_path)


def test_a_negative_size_is_named(tmp_path):
    mh.save(nn.Sequential(nn.Linear(4, 3)), tmp_path)
    _edit_config(
        tmp_path, lambda c: c["model"]["args"]["modules"][0]["args"].update(in_features=-5)
    )
    with pytest.raises(
        ValueError,
        match=r"config\.json in .*: the model it describes cannot be built \(Trying to create "
        r"tensor with negative dimension -5.*a size in it is out of range",
    ):
        mh.load(tmp_path)


def test_a_table_the_weights_do_not_store_is_sized_against_them(tmp_path):
    """A sinusoidal encoding stores nothing; max_len=10**9 in its config asked for a 256 GB
    table (a raw allocator error). The meta build's memory is compared with the file's."""
    mh.save(mh.SinusoidalPositionalEncoding(64, max_len=40), tmp_path)
    _edit_config(tmp_path, lambda c: c["model"]["args"].update(max_len=10**9))
    with pytest.raises(
        ValueError,
        match=r"config\.json in .* describes a model of 238\.4 GiB but the weights hold 0\.0 MiB; "
        r"its largest tensor, table of shape \(1000000000, 64\), is sized by config\.json alone",
    ):
        mh.load(tmp_path)
    _edit_config(tmp_path, lambda c: c["model"]["args"].update(max_len=1000))
    assert mh.load(tmp_path).table.shape == (1000, 64)  # an ordinary size still loads
