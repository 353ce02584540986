"""The decoding step in one C++ call (multihead/modules/decoding_native.py): for the GPT-2 and
Llama kinds of stack and every weight kind (float32, bf16, int8), each one-token step's output
equals the modules' path within float32 rounding, and the step keys and values land in the
cache where the modules put them; whatever it does not cover (hooks, subclasses, padded rows,
a rolling cache, the switch off) takes the Python path."""

from __future__ import annotations

import pytest
import torch
from helpers import llama_decoder
from torch import nn

import multihead as mh
from multihead.modules import decoding_native as native_step
from multihead.modules import decoding_python as python_step
from multihead.modules import few_rows, quant

E, H, H_KV, D = 32, 4, 2, 8

pytestmark = pytest.mark.skipif(
    few_rows.kernel_error() is not None, reason=f"no few-row kernel: {few_rows.kernel_error()}"
)


def _stack(kind: str, weights: str | None, activation: str = "gelu_tanh") -> nn.Module:
    torch.manual_seed(0)
    if kind == "gpt2":
        blocks = [
            mh.TransformerDecoderLayer(
                mh.MultiHeadAttention(E, H),
                mh.FeedForward(E, 4 * E, activation=activation),
                norm1=nn.LayerNorm(E),
                norm2=nn.LayerNorm(E),
            )
            for _ in range(2)
        ]
        stack = mh.TransformerDecoder(blocks, norm=nn.LayerNorm(E))
    else:
        stack = llama_decoder(2, E, H, H_KV, D)
    return quant.prepare_linears(stack.eval(), weights)


def _decode(stack, kind, prompts, *, native: bool, monkeypatch, window=None):
    """Prompts of the given lengths, then five one-token steps: each step's output, the cache
    after them, and how many steps took the C++ call."""
    monkeypatch.setattr(native_step, "enabled", native)
    kernel = few_rows._LOADER.module or few_rows._LOADER.load()
    calls = []
    real = kernel.native_step
    monkeypatch.setattr(kernel, "native_step", lambda *a: calls.append(1) or real(*a))
    g = torch.Generator().manual_seed(1)
    b, width = len(prompts), max(prompts)
    cache = mh.KVCache(2, b, H if kind == "gpt2" else H_KV, D, window=window)
    outs = []
    with torch.inference_mode():
        cache.begin(torch.tensor(prompts), width)
        outs.append(stack(torch.randn(b, width, E, generator=g), cache=cache))
        for _ in range(5):
            cache.begin(1)
            outs.append(stack(torch.randn(b, 1, E, generator=g), cache=cache))
    monkeypatch.setattr(kernel, "native_step", real)
    return outs, cache, len(calls)


@pytest.mark.parametrize("weights", [None, "bf16", "int8", "w8a16"])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_native_step_equals_the_modules_within_float32_rounding(kind, weights, monkeypatch):
    stack = _stack(kind, weights)
    got, cache, steps = _decode(stack, kind, [3, 3], native=True, monkeypatch=monkeypatch)
    want, want_cache, none = _decode(stack, kind, [3, 3], native=False, monkeypatch=monkeypatch)
    assert steps == 5 and none == 0
    # float32: the C++ norms, softmax and activations sum in other orders than torch's; over
    # widths of 32-128 that moves a result by a few units in the last place of values of
    # order 1-10, far below 1e-5 (the fp32 rule of docs/design.md)
    for a, b in zip(got, want):
        assert (a - b).abs().max() <= 1e-5 * max(1.0, b.abs().max().item())
    for stored, reference in ((cache._keys, want_cache._keys), (cache._values, want_cache._values)):
        assert (stored - reference).abs().max() <= 1e-5 * max(1.0, reference.abs().max().item())
    assert cache.lengths.tolist() == want_cache.lengths.tolist() == [8, 8]


@pytest.mark.parametrize("activation", ["gelu", "relu"])
def test_other_activations_and_a_fixed_cache(activation, monkeypatch):
    stack = _stack("gpt2", None, activation)
    got, _, steps = _decode(stack, "gpt2", [4], native=True, monkeypatch=monkeypatch)
    want, _, _ = _decode(stack, "gpt2", [4], native=False, monkeypatch=monkeypatch)
    assert steps == 5
    for a, b in zip(got, want):
        assert (a - b).abs().max() <= 1e-5 * max(1.0, b.abs().max().item())


def test_what_it_does_not_cover_takes_the_python_path(monkeypatch):
    stack = _stack("llama", None)
    # padded rows: the new keys go to different slots
    _, _, steps = _decode(stack, "llama", [3, 5], native=True, monkeypatch=monkeypatch)
    assert steps == 0
    # a rolling cache
    _, _, steps = _decode(stack, "llama", [3], native=True, monkeypatch=monkeypatch, window=4)
    assert steps == 0
    # a hook on one projection: that layer would skip it
    layer = stack.layers[1]
    handle = layer.self_attn.k_proj.register_forward_hook(lambda *a: None)
    _, _, steps = _decode(stack, "llama", [3], native=True, monkeypatch=monkeypatch)
    handle.remove()
    assert steps == 0
    # the switch
    _, _, steps = _decode(stack, "llama", [3], native=False, monkeypatch=monkeypatch)
    assert steps == 0

    class Norm(nn.LayerNorm):  # a subclass may compute something else
        pass

    gpt2 = _stack("gpt2", None)
    gpt2.layers[0].norm2 = Norm(E)
    gpt2.layers[0].norm2.load_state_dict(_stack("gpt2", None).layers[0].norm2.state_dict())
    _, _, steps = _decode(gpt2, "gpt2", [3], native=True, monkeypatch=monkeypatch)
    assert steps == 0
    assert python_step.enabled  # the Python short path still runs those


@pytest.mark.parametrize("weights", [None, "int8", "w8a16"])
def test_generate_gives_the_same_tokens(weights, monkeypatch, tmp_path):
    """A saved Llama-family model's greedy tokens, with and without the C++ step."""
    from models.decoders import build

    from multihead.models import llama

    model = llama.load(build("llama", tmp_path, layers=2), weights=weights)
    ids = torch.tensor([[5, 9, 14, 3, 22], [7, 7, 8, 1, 30]])
    tokens = {}
    for native in (True, False):
        monkeypatch.setattr(native_step, "enabled", native)
        tokens[native] = model.generate(ids, 12)
    assert torch.equal(tokens[True], tokens[False])


def test_a_module_changed_between_steps_is_read_anew(monkeypatch):
    """The step's tensors are gathered on a cache's first step and kept for its later steps
    only while each module and tensor read is still in its place and unhooked: a projection
    replaced mid-generation is used at once, a hook added sends the step to Python."""
    stack = _stack("llama", None)
    kernel = few_rows._LOADER.module or few_rows._LOADER.load()
    calls = []
    real = kernel.native_step
    monkeypatch.setattr(kernel, "native_step", lambda *a: calls.append(1) or real(*a))
    g = torch.Generator().manual_seed(3)
    steps = [torch.randn(1, 1, E, generator=g) for _ in range(3)]
    prompt = torch.randn(1, 3, E, generator=g)

    def run(change):
        cache = mh.KVCache(2, 1, H_KV, D)
        with torch.inference_mode():
            cache.begin(3)
            stack(prompt, cache=cache)
            outs = []
            for i, x in enumerate(steps):
                if i == 2:
                    change()
                cache.begin(1)
                outs.append(stack(x, cache=cache))
        return outs

    original = stack.layers[1].self_attn.q_proj
    replacement = nn.Linear(E, H * D, bias=False)
    torch.manual_seed(9)
    nn.init.normal_(replacement.weight)

    def swap():
        stack.layers[1].self_attn.q_proj = replacement

    got = run(swap)
    assert len(calls) == 3  # every step native, the third with the new projection
    stack.layers[1].self_attn.q_proj = original
    monkeypatch.setattr(native_step, "enabled", False)
    want = run(swap)
    for a, b in zip(got, want):
        assert (a - b).abs().max() <= 1e-5 * max(1.0, b.abs().max().item())
    monkeypatch.setattr(native_step, "enabled", True)
    stack.layers[1].self_attn.q_proj = original
    calls.clear()
    handles = []
    run(lambda: handles.append(stack.layers[0].norm2.register_forward_hook(lambda *a: None)))
    handles[0].remove()
    assert len(calls) == 2  # the hooked step went to Python
