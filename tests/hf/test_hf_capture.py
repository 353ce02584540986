"""``multihead.hf.capture``: the weights of chosen heads of chosen layers, against transformers'
eager ``output_attentions`` on the same weights, computed for those heads only."""

from __future__ import annotations

import pytest
import torch
from hf_archs import BY_NAME
from test_hf_attention import build, inputs

import multihead.hf as mhf
from multihead.acting import apply


def _eager_attentions(model, arch):
    model.set_attn_implementation("eager")
    with torch.no_grad():
        out = model(**inputs(arch)[0], output_attentions=True)
    return out.encoder_attentions if arch.kind == "seq2seq" else out.attentions


@pytest.mark.parametrize("name", ["llama", "gemma2", "gpt_oss", "bert", "t5", "vit"])
def test_chosen_heads_equal_eager_in_the_order_given(name):
    arch = BY_NAME[name]
    model = build(arch)
    want = _eager_attentions(model, arch)
    with mhf.capture(model, layers=[1], heads=[2, 0]) as cap, torch.no_grad():
        model(**inputs(arch)[0])
    assert list(cap.weights) == [1] and cap.num_layers == len(want)
    got = cap.weights[1]
    assert got.shape == (*want[1].shape[:1], 2, *want[1].shape[2:])
    valid = inputs(arch)[1]
    rows = (
        valid[:, None, :, None] if valid.shape[1] == got.shape[2] else torch.ones(1, 1, 1, 1).bool()
    )
    diff = (got - want[1][:, [2, 0]]).abs().masked_fill(~rows, 0)
    assert diff.max() <= 1e-5
    assert model.config._attn_implementation == "eager"  # given back on leaving


def test_every_layer_and_head_by_default():
    arch = BY_NAME["mistral"]
    model = build(arch, "multihead")
    want = _eager_attentions(model, arch)
    model.set_attn_implementation("sdpa")
    with mhf.capture(model) as cap, torch.no_grad():
        model(**inputs(arch)[0])
    assert sorted(cap.weights) == [0, 1] and model.config._attn_implementation == "sdpa"
    valid = inputs(arch)[1][:, None, :, None]
    for layer, w in cap.weights.items():
        assert ((w - want[layer]).abs().masked_fill(~valid, 0)).max() <= 1e-5


def test_only_the_chosen_heads_are_ever_computed_with_weights(monkeypatch):
    calls = []
    original = apply._ran  # the plan's one registry call

    def spy(call):
        if call.return_weights:
            calls.append(None if call.heads is None else list(call.heads))
        return original(call)

    monkeypatch.setattr(apply, "_ran", spy)
    arch = BY_NAME["llama"]
    model = build(arch)
    with mhf.capture(model, layers=[0], heads=[3]), torch.no_grad():
        model(**inputs(arch)[0])
    assert calls == [[3]]  # layer 0 asks for head 3; layer 1 runs without weights


def test_output_attentions_inside_a_capture_serves_both():
    arch = BY_NAME["llama"]
    model = build(arch)
    with mhf.capture(model, layers=[0], heads=[1]) as cap, torch.no_grad():
        out = model(**inputs(arch)[0], output_attentions=True)
    assert len(out.attentions) == 2 and out.attentions[0].shape[1] == 4
    assert torch.equal(cap.weights[0], out.attentions[0][:, [1]])


def test_decoder_of_an_encoder_decoder_by_passing_it():
    arch = BY_NAME["bart"]
    model = build(arch)
    batch = inputs(arch)[0]
    model.set_attn_implementation("eager")
    with torch.no_grad():
        want = model(**batch, output_attentions=True).decoder_attentions
    with mhf.capture(model.get_decoder(), layers=[0]) as cap, torch.no_grad():
        model(**batch)
    assert (cap.weights[0] - want[0]).abs().max() <= 1e-5


def test_capture_errors():
    arch = BY_NAME["llama"]
    model = build(arch)
    with (
        pytest.raises(TypeError, match=r"capture takes a transformers model"),
        mhf.capture(torch.nn.Linear(2, 2)),
    ):
        pass
    with (
        pytest.raises(
            ValueError, match=r"layers must be layer indices in \[0, 2\) \(the model has"
        ),
        mhf.capture(model, layers=[2]),
    ):
        pass
    with (
        pytest.raises(ValueError, match=r"layers must not repeat"),
        mhf.capture(model, layers=[1, 1]),
    ):
        pass
    with (
        pytest.raises(ValueError, match=r"layers must be a non-empty list"),
        mhf.capture(model, layers=1),
    ):
        pass
    with (
        pytest.raises(ValueError, match=r"heads must be query-head indices in \[0, 4\)"),
        mhf.capture(model, heads=[4]),
    ):
        pass
    assert model.config._attn_implementation == "eager"
