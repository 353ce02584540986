"""ONNX export of the GPT-2 and Llama decoders (past and present keys/values as graph inputs
and outputs) against the torch models and transformers, run by onnxruntime
(CPUExecutionProvider)."""

from __future__ import annotations

import contextlib
import io

import numpy as np
import onnx
import pytest
import torch
from models.decoders import build, pad, transformers_model

import multihead as mh
from multihead import cli
from multihead.export import graph_spec, session, to_onnx
from multihead.models import gpt2, llama

# fp32 parity bound of the issue; the measured errors are 1e-6 to 3e-6 (logits of a few units,
# two layers), the size of fp32 rounding through a different order of operations
FP32 = 1e-5
LOADERS = {"gpt2": gpt2, "llama": llama}
# a left-padded batch of two prompts, 9 and 4 tokens: neither the export's example length (5)
# nor its past (7), and the second row starts 5 slots late
PROMPTS = [[5, 17, 101, 44, 200, 3, 90, 12, 250], [61, 7, 88, 140]]


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def exported(request, tmp_path_factory):
    """(kind, folder, torch model, graph path, whether it outputs weights). GPT-2 goes through
    the CLI, Llama (GQA, RoPE) through to_onnx with the attention weights: two exports of
    about 5-10 s each cover both paths."""
    kind = request.param
    root = tmp_path_factory.mktemp(f"onnx-{kind}")
    folder = build(kind, root / "model")
    lm = LOADERS[kind].load(folder).eval()
    out = root / "decoder.onnx"
    if kind == "gpt2":
        said = io.StringIO()
        with contextlib.redirect_stdout(said):
            assert cli.main(["export", "onnx", "--model", str(folder), "--out", str(out)]) == 0
        assert said.getvalue() == (
            f"wrote {out} (inputs input_ids, attention_mask, position_ids, "
            "past_key_values.{0..1}.key/value; outputs logits, present.{0..1}.key/value); "
            "onnx.checker: ok\n"
        )
    else:
        to_onnx(lm, out, weights=True)
    return kind, folder, lm, out, kind == "llama"


def _dims(value_info) -> list[str | int]:
    return [d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim]


def _empty_past(lm, batch: int) -> dict[str, np.ndarray]:
    """Past keys and values of length 0: the prefill's."""
    attn = lm.decoder.layers[0].self_attn
    shape = (batch, attn.num_kv_heads, 0, attn.head_dim)
    names = graph_spec(lm).inputs[3:]
    return {name: np.zeros(shape, dtype=np.float32) for name in names}


def _step(ort, lm, ids: np.ndarray, mask: np.ndarray, past: dict[str, np.ndarray]):
    """One run of the graph: new tokens ``ids`` (B, L) after ``past``, ``mask`` (B, P + L).
    Returns (logits, next past, every output by name)."""
    new = ids.shape[1]
    positions = (np.cumsum(mask, axis=1) - 1).clip(min=0)[:, -new:]
    feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": positions, **past}
    names = [o.name for o in ort.get_outputs()]
    outputs = dict(zip(names, ort.run(None, feeds)))
    present = {
        name.replace("present", "past_key_values"): value
        for name, value in outputs.items()
        if name.startswith("present.")
    }
    return outputs["logits"], present, outputs


def _left_batch(prompts: list[list[int]]) -> tuple[np.ndarray, np.ndarray, torch.Tensor]:
    ids, lengths = pad(prompts, "left", value=0)
    width = ids.shape[1]
    mask = (torch.arange(width)[None] >= width - lengths[:, None]).long()
    return ids.numpy(), mask.numpy(), lengths


def _hf_present(hf, ids: np.ndarray, mask: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """transformers' cache after the same left-padded tokens: (key, value) per layer, in the
    same (B, H_kv, P + L, D) layout (keys after RoPE for Llama)."""
    positions = (np.cumsum(mask, axis=1) - 1).clip(min=0)
    with torch.no_grad():
        cache = hf(
            torch.from_numpy(ids),
            attention_mask=torch.from_numpy(mask),
            position_ids=torch.from_numpy(positions),
            use_cache=True,
        ).past_key_values
    return [(layer.keys.numpy(), layer.values.numpy()) for layer in cache.layers]


def _check_present(present, hf_present, mask: np.ndarray) -> None:
    """Every real slot of every layer's present equals transformers' cache; padded slots
    hold keys of padding tokens, which no query reads, so they are left out."""
    for i, (key, value) in enumerate(hf_present):
        for b in range(mask.shape[0]):
            real = mask[b].astype(bool)
            got_k = present[f"past_key_values.{i}.key"][b][:, real]
            got_v = present[f"past_key_values.{i}.value"][b][:, real]
            assert np.abs(got_k - key[b][:, real]).max() <= FP32
            assert np.abs(got_v - value[b][:, real]).max() <= FP32


def test_graph_is_valid_with_the_genai_interface(exported):
    kind, _, lm, path, weights = exported
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)
    layers = len(lm.decoder.layers)
    attn = lm.decoder.layers[0].self_attn
    inputs = {i.name: _dims(i) for i in model.graph.input}
    outputs = {o.name: _dims(o) for o in model.graph.output}
    past = [f"past_key_values.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
    present = [f"present.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
    assert list(inputs) == ["input_ids", "attention_mask", "position_ids", *past]
    extra = ["attention_weights"] if weights else []
    assert list(outputs) == ["logits", *present, *extra]
    for name in ("input_ids", "attention_mask", "position_ids"):
        assert model.graph.input[list(inputs).index(name)].type.tensor_type.elem_type == (
            onnx.TensorProto.INT64
        )
    assert inputs["input_ids"] == inputs["position_ids"] == ["batch", "sequence"]
    assert inputs["attention_mask"] == ["batch", "past_sequence + sequence"]
    kv = attn.num_kv_heads  # GQA: Llama caches 2 heads for its 4 query heads
    assert kv == (2 if kind == "llama" else 4)
    for name in past:
        assert inputs[name] == ["batch", kv, "past_sequence", attn.head_dim]
    for name in present:
        assert outputs[name] == ["batch", kv, "past_sequence + sequence", attn.head_dim]
    assert outputs["logits"] == ["batch", "sequence", lm.vocab_size]


def test_prefill_and_decode_steps_equal_torch(exported):
    """(a) The prefill of a left-padded batch (past length 0), then (b) three steps of 1, 1
    and 2 new tokens per row, each step's present fed back as the next past: every real
    logit equals the torch model's on the whole sequence so far, every present equals
    transformers' cache after the same tokens."""
    _, folder, lm, path, weights = exported
    hf = transformers_model(folder)
    ort = session(path)
    ids, mask, lengths = _left_batch(PROMPTS)
    logits, past, outputs = _step(ort, lm, ids, mask, _empty_past(lm, 2))
    with torch.inference_mode():
        ref = lm.run(torch.from_numpy(ids), lengths=lengths, padding_side="left")
    real = mask.astype(bool)
    assert np.abs(logits[real] - ref.logits.numpy()[real]).max() <= FP32
    _check_present(past, _hf_present(hf, ids, mask), mask)
    if weights:  # [layers, B, H, L, P + L] with P = 0: the torch model's (B, H, L, L) each
        got, want = outputs["attention_weights"], torch.stack(ref.weights).numpy()
        for b in range(2):
            rows = real[b]
            assert np.abs(got[:, b][:, :, rows] - want[:, b][:, :, rows]).max() <= FP32
            assert (got[:, b][..., ~rows] == 0).all()  # padding gets exactly nothing
    everything, seen = ids, mask
    rng = np.random.default_rng(0)
    for new in (1, 1, 2):
        step_ids = rng.integers(2, lm.vocab_size, size=(2, new))
        everything = np.concatenate([everything, step_ids], axis=1)
        seen = np.concatenate([seen, np.ones((2, new), dtype=np.int64)], axis=1)
        logits, past, _ = _step(ort, lm, step_ids, seen, past)
        assert logits.shape == (2, new, lm.vocab_size)
        with torch.inference_mode():
            full = lm(
                torch.from_numpy(everything),
                lengths=lengths + seen.shape[1] - ids.shape[1],
                padding_side="left",
            )
        assert np.abs(logits - full[:, -new:].numpy()).max() <= FP32
    _check_present(past, _hf_present(hf, everything, seen), seen)
    assert past["past_key_values.0.key"].shape[2] == everything.shape[1]


def test_greedy_loop_on_onnxruntime_equals_generate(exported):
    """(c) A greedy loop on onnxruntime over a left-padded batch of 3 (a batch size not seen
    at export) gives the tokens of ``lm.generate``."""
    _, _, lm, path, _ = exported
    prompts = [[9, 200, 31, 4, 77, 150], [1, 2], [300 - 1, 45, 8]]
    ids, mask, lengths = _left_batch(prompts)
    ort = session(path)
    logits, past, _ = _step(ort, lm, ids, mask, _empty_past(lm, 3))
    tokens = []
    for t in range(8):
        token = logits[:, -1].argmax(axis=-1)[:, None]  # [B, 1]
        tokens.append(token)
        if t == 7:
            break
        mask = np.concatenate([mask, np.ones((3, 1), dtype=np.int64)], axis=1)
        logits, past, _ = _step(ort, lm, token, mask, past)
    expected = lm.generate(torch.from_numpy(ids), 8, lengths=lengths, padding_side="left")
    assert np.array_equal(np.concatenate(tokens, axis=1), expected[:, ids.shape[1] :].numpy())


class _Wrapped(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x, **kwargs):
        return self.inner(x, **kwargs)


def test_unsupported_decoders_are_refused(exported, tmp_path):
    _, folder, lm, _, _ = exported
    with pytest.raises(TypeError, match=r"exports as part of its language model.*Received: "):
        to_onnx(lm.decoder, tmp_path / "x.onnx")
    with pytest.raises(TypeError, match=r"Received: TransformerDecoderLayer"):
        to_onnx(lm.decoder.layers[0], tmp_path / "x.onnx")
    rotary = mh.MultiHeadAttention(8, 2, rotary=mh.modules.RotaryEmbedding(4))
    with pytest.raises(ValueError, match=r"export the language model.*Received: a MultiHead"):
        to_onnx(rotary, tmp_path / "x.onnx")
    custom = LOADERS[exported[0]].load(folder)
    custom.decoder.layers[1].self_attn = _Wrapped(custom.decoder.layers[1].self_attn)
    with pytest.raises(TypeError, match=r"self_attn is a multihead.*Received: layer 1 .*_Wrapped"):
        to_onnx(custom, tmp_path / "x.onnx")
    assert not (tmp_path / "x.onnx").exists()
