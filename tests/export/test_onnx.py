"""ONNX export against the torch models it came from, run by onnxruntime
(CPUExecutionProvider)."""

from __future__ import annotations

import copy
import re
import subprocess
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

import multihead as mh
from multihead import cli, masks
from multihead.bench.texts import sentences
from multihead.export import OnnxBert, graph_spec, session, to_onnx
from multihead.models import bert

# fp32 parity bound of the issue; the measured errors are a few 1e-7 (small modules) to a few
# 1e-6 (six BERT layers), the size of fp32 rounding through a different order of operations
FP32 = 1e-5

# lengths chosen away from the export's example (B=2, L=5): batches of 1 and 3, a text of
# one word piece, padding of very different amounts, and 100+ tokens
TEXTS = [
    [sentences(1, min_words=80, max_words=80, seed=1)[0], "Hi", "The animal was tired."],
    ["A single text, alone in its batch, with no padding at all."],
]


def _dims(value_info) -> list[str | int]:
    return [d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim]


def test_bert_graph_is_valid_and_dynamic(minilm_onnx):
    model = onnx.load(str(minilm_onnx))
    onnx.checker.check_model(model, full_check=True)
    assert [i.name for i in model.graph.input] == ["input_ids", "attention_mask"]
    assert [o.name for o in model.graph.output] == ["last_hidden_state", "attention_weights"]
    assert _dims(model.graph.input[0]) == ["batch", "sequence"]
    assert _dims(model.graph.input[1]) == ["batch", "sequence"]
    assert _dims(model.graph.output[0]) == ["batch", "sequence", 384]
    assert _dims(model.graph.output[1]) == [6, "batch", 12, "sequence", "sequence"]


@pytest.mark.parametrize("batch", [0, 1], ids=["padded_batch_of_3", "batch_of_1"])
def test_bert_graph_equals_torch(pretrained, minilm_onnx, batch):
    """Hidden states and every layer's per-head weights within 1e-5 of the torch model (its
    own fused path) on every real token. Outputs at padded query positions are left out: no
    result uses them, and there even torch's fp32 is 2e-5 from its own fp64 (the rows of a
    [PAD] token are ill-conditioned), so no fp32 runtime can be held to 1e-5 at them."""
    tokens = pretrained.tokenize(TEXTS[batch])
    ids, lengths = tokens.input_ids, tokens.lengths
    keep = torch.arange(ids.shape[1])[None] < lengths[:, None]
    with torch.inference_mode():
        ref = pretrained.model.run(ids, lengths=lengths, return_weights=True)
    ort = session(minilm_onnx)
    hidden, weights = ort.run(None, {"input_ids": ids.numpy(), "attention_mask": keep.numpy() * 1})
    ref_weights = torch.stack(ref.weights).numpy()  # [layers, B, H, L, L]
    for b, n in enumerate(lengths.tolist()):
        assert np.abs(hidden[b, :n] - ref.last_hidden_state[b, :n].numpy()).max() <= FP32
        assert np.abs(weights[:, b, :, :n] - ref_weights[:, b, :, :n]).max() <= FP32
        assert (weights[:, b, :, :, n:] == 0).all()  # padded keys get exactly nothing
        np.testing.assert_allclose(weights[:, b, :, :n].sum(-1), 1.0, atol=1e-5)


def test_onnx_embeddings_equal_torch_embed(pretrained, minilm_onnx):
    """The exported graph plus mean pooling against the torch model's packed ``embed`` (itself
    within 1e-5 of sentence-transformers, tests/models; bench embed compares onnxruntime
    with sentence-transformers directly), texts of 3 to 300 words, some truncated to 256."""
    texts = sentences(10, min_words=3, max_words=300, seed=7)
    with pytest.warns(UserWarning, match="were truncated"):
        expected = pretrained.embed(texts).numpy()
    runtime = OnnxBert(minilm_onnx, pretrained, threads=1)
    with pytest.warns(UserWarning, match="were truncated"):
        got = runtime.embed(texts, max_tokens=1024)  # several padded batches
    assert got.shape == (10, 384) and got.dtype == np.float32
    assert np.abs(got - expected).max() <= FP32
    short = [i for i, t in enumerate(texts) if len(t.split()) < 100]
    plain = runtime.embed([texts[i] for i in short], normalize=False)
    np.testing.assert_allclose(
        plain / np.linalg.norm(plain, axis=1, keepdims=True), expected[short], atol=FP32
    )
    ids = pretrained.tokenize(["The animal was tired."]).input_ids[0].tolist()
    attention = runtime.attention(ids)
    with torch.inference_mode():
        ref = pretrained.model.run(torch.tensor([ids]), return_weights=True).weights
    assert np.abs(attention - torch.stack(ref)[:, 0].numpy()).max() <= FP32


@pytest.fixture(scope="module")
def mha_graph(tmp_path_factory):
    """Grouped-query attention (6 query heads, 2 key/value heads) with key and value widths
    unlike E, exported from training mode with its weights."""
    torch.manual_seed(0)
    module = mh.MultiHeadAttention(48, 6, num_kv_heads=2, kdim=40, vdim=36).train()
    path = to_onnx(module, tmp_path_factory.mktemp("mha") / "mha.onnx", weights=True)
    return module, path


def test_attention_module_with_gqa_cross_widths_and_weights(mha_graph):
    """Run at batch sizes, lengths and key lengths never seen in the export, down to a single
    query and a single key, with a batch entry whose keys are all padding."""
    module, path = mha_graph
    assert module.training  # restored after the export, which ran in eval mode
    module = copy.deepcopy(module).eval()
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)
    assert [i.name for i in model.graph.input] == ["query", "key", "value", "attention_mask"]
    assert _dims(model.graph.output[1]) == ["batch", 6, "sequence", "keys"]
    ort = session(path, threads=1)
    for b, length, keys in ((3, 11, 13), (1, 1, 1), (4, 1, 9), (2, 17, 3)):
        query = torch.randn(b, length, 48)
        key, value = torch.randn(b, keys, 40), torch.randn(b, keys, 36)
        keep = torch.rand(b, keys) < 0.7
        keep[0] = True
        if b > 1:
            keep[-1] = False  # the last entry of the batch sees no key at all: output = bias
        out, weights = ort.run(
            None,
            {
                "query": query.numpy(),
                "key": key.numpy(),
                "value": value.numpy(),
                "attention_mask": keep.long().numpy(),
            },
        )
        with torch.no_grad():
            ref, ref_weights = module.run(query, key, value, mask=masks.key_padding(keep))
        assert out.shape == (b, length, 48) and weights.shape == (b, 6, length, keys)
        assert np.abs(out - ref.numpy()).max() <= FP32
        assert np.abs(weights - ref_weights.numpy()).max() <= FP32
        hidden = ~keep.numpy()[:, None, None, :]  # [B, 1, 1, S]
        assert (np.where(hidden, weights, 0.0) == 0).all()


def test_encoder_stack_with_weights(tmp_path):
    torch.manual_seed(1)
    layers = [mh.TransformerEncoderLayer(32, 4, 64, norm_first=True) for _ in range(2)]
    encoder = mh.TransformerEncoder(layers, norm=torch.nn.LayerNorm(32)).eval()
    path = to_onnx(encoder, tmp_path / "encoder.onnx", weights=True)
    model = onnx.load(str(path))
    assert [i.name for i in model.graph.input] == ["hidden_states", "attention_mask"]
    assert [o.name for o in model.graph.output] == ["output", "attention_weights"]
    ort = session(path, threads=1)
    for lengths in ([9, 3, 1], [23]):
        x = torch.randn(len(lengths), max(lengths), 32)
        keep = torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]
        out, weights = ort.run(
            None, {"hidden_states": x.numpy(), "attention_mask": keep.numpy() * 1}
        )
        with torch.no_grad():
            ref = encoder.run(x, mask=masks.lengths(torch.tensor(lengths)))
        assert np.abs(out - ref.output.numpy()).max() <= FP32
        assert np.abs(weights - torch.stack(ref.weights).numpy()).max() <= FP32


def test_graph_spec_for_every_kind(pretrained):
    layer = mh.TransformerEncoderLayer(8, 2, 16)
    assert graph_spec(layer).inputs == ("hidden_states", "attention_mask")
    assert graph_spec(pretrained, weights=True).outputs == (
        "last_hidden_state",
        "attention_weights",
    )
    assert graph_spec(pretrained.model).kind == "bert"
    assert graph_spec(mh.MultiHeadAttention(8, 2)).outputs == ("output",)


def test_bad_arguments(tmp_path, minilm_onnx, pretrained, mha_graph):
    with pytest.raises(TypeError, match=r"to_onnx exports a MultiHeadAttention.*Received: Linear"):
        to_onnx(torch.nn.Linear(2, 2), tmp_path / "x.onnx")
    with pytest.raises(ValueError, match=r"threads must be a positive int. Received: threads=0"):
        session(minilm_onnx, threads=0)
    with pytest.raises(ValueError, match=r"expected a BERT graph from to_onnx.*Received: inputs"):
        OnnxBert(mha_graph[1], pretrained)
    with pytest.raises(FileNotFoundError, match="no such ONNX file"):
        OnnxBert(tmp_path / "missing.onnx", pretrained)
    too_long = [[101] * 513]
    with pytest.raises(ValueError, match=r"ids\[0\] must hold 1 to 512 token ids"):
        OnnxBert(minilm_onnx, pretrained).embed_ids(too_long)


def test_cli_exports_a_model_folder(tiny_bert, tmp_path, capsys):
    out = tmp_path / "sub" / "tiny.onnx"
    out.parent.mkdir()  # made by the user: export creates no folders
    args = ["export", "onnx", "--model", str(tiny_bert), "--out", str(out), "--weights"]
    assert cli.main(args) == 0
    assert "onnx.checker: ok" in capsys.readouterr().out
    onnx.checker.check_model(str(out), full_check=True)
    tiny = bert.load(tiny_bert)
    runtime = OnnxBert(out, tiny)
    texts = sentences(9, min_words=2, max_words=70, seed=3)  # some past 48 tokens: truncated
    with pytest.warns(UserWarning, match="truncated"):
        expected = tiny.embed(texts).numpy()
    with pytest.warns(UserWarning, match="truncated"):
        got = runtime.embed(texts)
    assert np.abs(got - expected).max() <= FP32


def test_cli_reports_a_missing_model(tmp_path, capsys):
    missing = tmp_path / "nothing"
    assert cli.main(["export", "onnx", "--model", str(missing), "--out", "x.onnx"]) == 2
    assert "model directory not found" in capsys.readouterr().err


def _no_export(*args, **kwargs):
    raise AssertionError("the export ran although its arguments were wrong")


def _unwritable(tmp_path):
    """A folder in which no file can be created: read-only permissions, or /proc where they
    do not stop this user (root)."""
    folder = tmp_path / "locked"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        (folder / "probe").write_text("")
    except PermissionError:
        return folder / "model.onnx"
    (folder / "probe").unlink()
    if not Path("/proc/self").is_dir():
        pytest.skip("no folder refuses files to this user")
    return Path("/proc/model.onnx")


@pytest.mark.parametrize("case", ["parent_is_a_file", "out_is_a_folder", "unwritable"])
def test_out_that_cannot_be_written_fails_before_the_export(tmp_path, monkeypatch, capsys, case):
    """Each of these was found only by the file write after the 20 s export (a folder ended
    in a traceback); now the command stops first, with the path that blocks it."""
    (tmp_path / "file").write_text("x")
    (tmp_path / "folder").mkdir()
    out, match = {
        "parent_is_a_file": (tmp_path / "file" / "m.onnx", r"file is an existing file, not a"),
        "out_is_a_folder": (tmp_path / "folder", r"is an existing folder; give a file path"),
        "unwritable": (_unwritable(tmp_path), r"creating a file in the folder .* failed"),
    }[case]
    monkeypatch.setattr(torch.onnx, "export", _no_export)
    with pytest.raises(ValueError, match=match + r".*Received: path="):
        to_onnx(mh.MultiHeadAttention(8, 2), out)
    monkeypatch.setattr(cli_export(), "load_for_export", _no_export)
    assert cli.main(["export", "onnx", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("multihead export: error: ") and re.search(match, err)


def cli_export():
    import multihead.export.onnx

    return multihead.export.onnx


@pytest.mark.parametrize("opset", [5, 17, 29, 10**6])
def test_opset_out_of_range_is_refused(monkeypatch, tmp_path, capsys, opset):
    """Below 18 torch's exporter wrote opset 18 and said nothing; above what onnx knows the
    checker failed after the export."""
    monkeypatch.setattr(torch.onnx, "export", _no_export)
    newest = onnx.defs.onnx_opset_version()
    if opset == 29 and newest >= 29:
        pytest.skip("the installed onnx knows opset 29")
    match = rf"opset must be an int from 18 .* to {newest} .*Received: opset={opset}"
    with pytest.raises(ValueError, match=match):
        to_onnx(mh.MultiHeadAttention(8, 2), tmp_path / "x.onnx", opset=opset)
    monkeypatch.setattr(cli_export(), "load_for_export", _no_export)
    assert cli.main(["export", "onnx", "--out", str(tmp_path / "x.onnx"), "--opset", str(opset)])
    assert re.search(match, capsys.readouterr().err)
    assert not (tmp_path / "x.onnx").exists()


def test_a_newer_opset_is_the_one_written(tmp_path):
    path = to_onnx(mh.MultiHeadAttention(8, 2), tmp_path / "x.onnx", opset=21)
    assert {o.domain: o.version for o in onnx.load(str(path)).opset_import}[""] == 21


def _outputs(path, module):
    """The graph's output on a fixed input next to the module's own (max abs difference)."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 8, generator=generator)
    keep = np.ones((2, 3), dtype=np.int64)
    got = session(path).run(None, {"query": q.numpy(), "key": q.numpy(), "value": q.numpy(),
                                   "attention_mask": keep})[0]  # fmt: skip
    with torch.no_grad():
        expected = module(q, q, q).numpy()
    return float(np.abs(got - expected).max())


def test_export_replaces_the_previous_file_whole(tmp_path, monkeypatch):
    """A write that dies half-way (simulated: the file writer writes 64 bytes, then fails)
    leaves the previous export intact; it left a truncated graph. Weights kept in a file
    beside the graph (external_data=True) get a fresh name each time, so the previous graph
    keeps its own until the new graph is in place; the previous one is removed after, and
    the temporaries of a killed export are removed by the next one."""
    import onnx_ir

    torch.manual_seed(0)
    first, second = mh.MultiHeadAttention(8, 2).eval(), mh.MultiHeadAttention(8, 2).eval()
    out = tmp_path / "attn.onnx"
    to_onnx(first, out, external_data=True)
    (old_data,) = tmp_path.glob("attn.onnx.*.data")
    assert _outputs(out, first) <= FP32

    real_save = onnx_ir.save

    def dies_half_way(model, path, *args, **kwargs):
        Path(path).write_bytes(out.read_bytes()[:64])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(onnx_ir, "save", dies_half_way)
    with pytest.raises(OSError, match="No space left"):
        to_onnx(second, out, external_data=True)
    monkeypatch.setattr(onnx_ir, "save", real_save)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["attn.onnx", old_data.name]
    assert _outputs(out, first) <= FP32

    # what a killed export leaves: its temporary graph (named with its dead pid) and a new
    # weights file
    dead = _dead_pid()
    (tmp_path / f".attn.onnx.tmp-{dead}-abc").write_bytes(b"partial")
    (tmp_path / "attn.onnx.0123abcd.data").write_bytes(b"partial")
    to_onnx(second, out, external_data=True)
    (new_data,) = tmp_path.glob("attn.onnx.*.data")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["attn.onnx", new_data.name]
    assert new_data != old_data and _outputs(out, second) <= FP32


def _dead_pid() -> int:
    """The pid of a process that has exited (a child, waited for)."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_multihead_save_folder_of_an_attention_module_exports(tmp_path, capsys):
    torch.manual_seed(1)
    module = mh.MultiHeadAttention(8, 2).eval()
    mh.save(module, tmp_path / "saved")
    out = tmp_path / "saved.onnx"
    assert cli.main(["export", "onnx", "--model", str(tmp_path / "saved"), "--out", str(out)]) == 0
    assert "inputs query, key, value, attention_mask" in capsys.readouterr().out
    assert _outputs(out, module) <= FP32
