"""The decoding step's short path (modules/python_step.py): a TransformerDecoder's one-token steps
give the modules' own result to the bit, for every kind of stack, linear layer and cache, and
step aside for whatever the modules do that it does not (hooks, dropout, autograd)."""

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


@pytest.fixture(autouse=True)
def python_path(monkeypatch):
    """These tests are about the Python short path's bits: the C++ step (native_step, equal
    within float32 rounding, tested in test_native_step.py) stays off."""
    monkeypatch.setattr(native_step, "enabled", False)


def _gpt2_stack(layers: int = 2) -> mh.TransformerDecoder:
    blocks = [
        mh.TransformerDecoderLayer(
            mh.MultiHeadAttention(E, H),
            mh.FeedForward(E, 4 * E, activation="gelu_tanh"),
            norm1=nn.LayerNorm(E),
            norm2=nn.LayerNorm(E),
        )
        for _ in range(layers)
    ]
    return mh.TransformerDecoder(blocks, norm=nn.LayerNorm(E))


def _stack(kind: str, weights: str | None) -> mh.TransformerDecoder:
    torch.manual_seed(0)
    stack = (_gpt2_stack() if kind == "gpt2" else llama_decoder(2, E, H, H_KV, D)).eval()
    return quant.prepare_linears(stack, weights)


def _cache(kind: str, b: int, cache_kind: str) -> mh.KVCache:
    h_kv = H if kind == "gpt2" else H_KV
    window = 4 if cache_kind == "rolling" else None
    max_length = 16 if cache_kind == "fixed" else None
    return mh.KVCache(2, b, h_kv, D, max_length=max_length, window=window)


def _decode(stack, kind, prompts, cache_kind, *, short: bool, monkeypatch) -> list[torch.Tensor]:
    """Prompts of the given lengths (rows right-padded), then five one-token steps: every
    step's output, with the short path on or off."""
    applies = python_step.applies
    monkeypatch.setattr(python_step, "applies", applies if short else lambda *a: False)
    g = torch.Generator().manual_seed(1)
    b, width = len(prompts), max(prompts)
    cache = _cache(kind, b, cache_kind)
    outs = []
    with torch.inference_mode():
        x = torch.randn(b, width, E, generator=g)
        cache.begin(torch.tensor(prompts), width)
        outs.append(stack(x, cache=cache))
        for _ in range(5):
            cache.begin(1)
            outs.append(stack(torch.randn(b, 1, E, generator=g), cache=cache))
    monkeypatch.setattr(python_step, "applies", applies)
    return outs


@pytest.mark.parametrize("cache_kind", ["growing", "fixed", "rolling"])
@pytest.mark.parametrize("prompts", [[6], [3, 7, 5]], ids=["B1", "padded"])
@pytest.mark.parametrize("weights", [None, "bf16", "int8"], ids=["fp32", "bf16", "int8"])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_step_equals_the_modules_to_the_bit(kind, weights, prompts, cache_kind, monkeypatch):
    """Every step's output equals the modules' path exactly (the same operations in the same
    order), on the kernel and on F.linear alike; and the short path did run every step."""
    stack = _stack(kind, weights)
    ran = []
    step = python_step.step
    monkeypatch.setattr(python_step, "step", lambda *a: ran.append(1) or step(*a))
    for kernel in (True, False):  # the float32 products' choice of the kernel or the BLAS
        monkeypatch.setattr(few_rows, "_kernel_faster", lambda x, w, b, k=kernel: k)
        ran.clear()
        short = _decode(stack, kind, prompts, cache_kind, short=True, monkeypatch=monkeypatch)
        assert len(ran) == 5
        modules = _decode(stack, kind, prompts, cache_kind, short=False, monkeypatch=monkeypatch)
        assert len(ran) == 5
        for got, want in zip(short, modules):
            assert torch.equal(got, want)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_layers_products_of_one_input_are_one_kernel_call(kind, monkeypatch):
    """At each step, a layer's q, k and v products (and a gated feed-forward's gate and up)
    run as one stacked kernel call; the prompt takes the modules' own calls."""
    stack = _stack(kind, "int8")
    calls = []
    kernel = few_rows._LOADER.load()
    real = kernel.rows_linear_parts
    monkeypatch.setattr(kernel, "rows_linear_parts", lambda *a: calls.append(len(a[1])) or real(*a))
    _decode(stack, kind, [6], "growing", short=True, monkeypatch=monkeypatch)
    per_layer = [3] if kind == "gpt2" else [3, 2]
    assert calls == per_layer * 2 * 5  # two layers, five steps


def test_a_steps_rotary_turns_are_made_once_for_all_layers(monkeypatch):
    """The step makes the rotary cosines and sines once for every layer with the same head dim
    and base (a rotary of another base gets its own), with the modules' bits; a rotary with
    hooks is called as the module, its hooks firing for q and k."""
    stack = _stack("llama", "int8")
    stack.layers[1].self_attn.rotary = mh.RotaryEmbedding(D, base=500.0)
    made = []
    real = mh.RotaryEmbedding.cos_sin
    monkeypatch.setattr(
        mh.RotaryEmbedding, "cos_sin", lambda self, *a: made.append(self.base) or real(self, *a)
    )
    short = _decode(stack, "llama", [3, 7, 5], "growing", short=True, monkeypatch=monkeypatch)
    # the modules' path makes them in every call: two layers, q and k, per pass
    assert made[-5 * 2 :] == [10000.0, 500.0] * 5
    made.clear()
    modules = _decode(stack, "llama", [3, 7, 5], "growing", short=False, monkeypatch=monkeypatch)
    assert len(made) == 6 * 4
    for got, want in zip(short, modules):
        assert torch.equal(got, want)
    fired = []
    stack.layers[0].self_attn.rotary.register_forward_hook(lambda *a: fired.append(1))
    _decode(stack, "llama", [3], "growing", short=True, monkeypatch=monkeypatch)
    assert len(fired) == 6 * 2  # the prompt and five steps, q and k


def test_a_step_equals_a_float64_recompute():
    """The independent reference: each step's output of a GPT-2-style stack on int8 weights
    equals the same stack in float64 (weights dequantized) run on the whole sequence, within
    float32 rounding (1e-5 on outputs of norm ~6)."""
    stack = _stack("gpt2", "int8")
    dense = _gpt2_stack()
    dense.load_state_dict(
        {k: v for k, v in stack.state_dict().items() if not k.endswith(("packed", "scale"))},
        strict=False,
    )
    with torch.no_grad():
        for m, d in zip(stack.modules(), dense.modules()):
            if isinstance(m, quant.PackedLinear):
                d.weight.copy_(m.weight)
    dense = dense.double().eval()
    g = torch.Generator().manual_seed(2)
    seq = torch.randn(2, 9, E, generator=g)
    cache = _cache("gpt2", 2, "growing")
    with torch.inference_mode():
        cache.begin(4)
        stack(seq[:, :4], cache=cache)
        for t in range(4, 9):
            cache.begin(1)
            got = stack(seq[:, t : t + 1], cache=cache)
            want = dense(seq[:, : t + 1].double(), mask=mh.masks.causal())[:, -1:]
            assert (got.double() - want).abs().max() <= 1e-5


def _steps_taken(stack, monkeypatch, *, grad: bool = False) -> int:
    ran = []
    step = python_step.step
    monkeypatch.setattr(python_step, "step", lambda *a: ran.append(1) or step(*a))
    cache = _cache("llama", 1, "growing")
    with torch.set_grad_enabled(grad):
        for n in (3, 1, 1):
            cache.begin(n)
            stack(torch.randn(1, n, E), cache=cache)
    monkeypatch.setattr(python_step, "step", step)
    return len(ran)


def test_hooks_run_where_they_are(monkeypatch):
    """A hook on a layer or an attention keeps the whole step on the modules; one on a linear
    layer keeps that product a module call. Each fires once per layer and step either way."""
    stack = _stack("llama", None)
    fired = []
    handle = stack.layers[1].self_attn.register_forward_hook(lambda *a: fired.append("attn"))
    assert _steps_taken(stack, monkeypatch) == 0
    assert fired == ["attn"] * 3
    handle.remove()
    fired.clear()
    proj = stack.layers[0].self_attn.k_proj
    handle = proj.register_forward_pre_hook(lambda *a: fired.append("k_proj"))
    assert _steps_taken(stack, monkeypatch) == 2
    assert fired == ["k_proj"] * 3
    handle.remove()
    handle = nn.modules.module.register_module_forward_hook(lambda *a: None)
    try:
        assert _steps_taken(stack, monkeypatch) == 0
    finally:
        handle.remove()
    assert _steps_taken(stack, monkeypatch) == 2


def test_a_hooked_norm_or_activation_is_called_as_a_module(monkeypatch):
    """The step computes a LayerNorm and an activation itself, without their module calls;
    one with a hook is called, so the hook fires once per layer and step, and the step
    still takes the short path."""
    torch.manual_seed(0)
    stack = _gpt2_stack().eval()
    fired = []
    norm = stack.layers[1].norm2
    activation = stack.layers[0].feed_forward.activation
    hooks = [
        norm.register_forward_hook(lambda *a: fired.append("norm2")),
        activation.register_forward_pre_hook(lambda *a: fired.append("activation")),
    ]
    cache = _cache("gpt2", 1, "growing")
    ran = []
    step = python_step.step
    monkeypatch.setattr(python_step, "step", lambda *a: ran.append(1) or step(*a))
    with torch.inference_mode():
        for n in (3, 1, 1):
            cache.begin(n)
            stack(torch.randn(1, n, E), cache=cache)
    assert len(ran) == 2
    assert sorted(fired) == ["activation"] * 3 + ["norm2"] * 3
    for hook in hooks:
        hook.remove()


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu", "silu"])
@pytest.mark.parametrize("norm_bias", [True, False])
def test_each_activation_and_norm_steps_to_the_bit(activation, norm_bias, monkeypatch):
    """The activations a feed-forward here is built with, and LayerNorms with and without a
    bias, computed by the step give the modules' bits; an in-place ReLU too."""
    torch.manual_seed(2)
    blocks = [
        mh.TransformerDecoderLayer(
            mh.MultiHeadAttention(E, H),
            mh.FeedForward(E, 4 * E, activation=activation),
            norm1=nn.LayerNorm(E, bias=norm_bias, eps=1e-3),
            norm2=nn.LayerNorm(E, bias=norm_bias),
        )
        for _ in range(2)
    ]
    stack = mh.TransformerDecoder(blocks, norm=nn.LayerNorm(E)).eval()
    if activation == "relu":
        stack.layers[1].feed_forward.activation.inplace = True
    for weights in (None, "int8"):
        packed = quant.prepare_linears(stack, weights)
        short = _decode(packed, "gpt2", [5], "growing", short=True, monkeypatch=monkeypatch)
        modules = _decode(packed, "gpt2", [5], "growing", short=False, monkeypatch=monkeypatch)
        for got, want in zip(short, modules):
            assert torch.equal(got, want)


def test_the_attentions_dtype_rule_for_every_kind_of_projection():
    """The dtype an attention takes (which the step checks for every layer, read from the
    module dicts): float32 for packed projections, the weight's dtype otherwise, a
    projection's own compute_dtype where it states one."""

    class Linear(nn.Linear):  # a subclass of its own
        pass

    for weights in (None, "bf16", "int8"):
        attn = quant.prepare_linears(mh.MultiHeadAttention(E, H), weights)
        assert attn._compute_dtype() == torch.float32
    half = mh.MultiHeadAttention(E, H).to(torch.bfloat16)  # plain nn.Linear in bf16
    assert half._compute_dtype() == torch.bfloat16
    custom = mh.MultiHeadAttention(E, H)
    custom.q_proj = Linear(E, E, dtype=torch.float64)
    assert custom._compute_dtype() == torch.float64
    stated = mh.MultiHeadAttention(E, H)
    stated.q_proj.compute_dtype = torch.float64  # an instance's own, over its weight's
    assert stated._compute_dtype() == torch.float64


def test_dropout_autograd_and_subclasses_take_the_modules(monkeypatch):
    """Dropout while training, a step under autograd and a layer of a subclass (whose forward
    may differ) take the modules' path; eval mode or a rate of 0 takes the short one."""
    stack = _stack("llama", None)
    stack.train()
    assert _steps_taken(stack, monkeypatch) == 2  # every dropout's rate is 0
    stack.layers[0].dropout.p = 0.1
    assert _steps_taken(stack, monkeypatch) == 0
    stack.eval()
    assert _steps_taken(stack, monkeypatch) == 2
    assert _steps_taken(stack, monkeypatch, grad=True) == 0

    class Layer(mh.TransformerDecoderLayer):
        pass

    layer = stack.layers[1]
    stack.layers[1] = Layer(layer.self_attn, layer.feed_forward, norm1=layer.norm1)
    assert _steps_taken(stack, monkeypatch) == 0


def test_the_switch_turns_the_short_path_off(monkeypatch):
    """``python_step.enabled`` (``MULTIHEAD_STEP_PATH=0`` at import) keeps every step on the
    modules' path."""
    stack = _stack("llama", None)
    monkeypatch.setattr(python_step, "enabled", False)
    assert _steps_taken(stack, monkeypatch) == 0
    monkeypatch.setattr(python_step, "enabled", True)
    assert _steps_taken(stack, monkeypatch) == 2


def test_a_wrong_dtype_raises_as_the_modules_do():
    """The short path steps aside for input its modules would refuse, so their error comes
    (here the attention's: the stack has no norms before it)."""
    torch.manual_seed(0)
    layers = [mh.TransformerDecoderLayer(mh.MultiHeadAttention(E, H), mh.FeedForward(E, E))]
    stack = mh.TransformerDecoder(layers).eval()
    cache = mh.KVCache(1, 1, H, D)
    with torch.inference_mode():
        cache.begin(1)
        with pytest.raises(TypeError, match="dtype of the module's parameters"):
            stack(torch.randn(1, 1, E, dtype=torch.float64), cache=cache)


def test_the_environment_switch_is_read_at_import(monkeypatch):
    import importlib

    monkeypatch.setenv("MULTIHEAD_STEP_PATH", "0")
    try:
        assert importlib.reload(python_step).enabled is False
    finally:
        monkeypatch.delenv("MULTIHEAD_STEP_PATH")
        importlib.reload(python_step)
    assert python_step.enabled is True


@pytest.mark.parametrize(
    "cache, error, match",
    [
        (lambda: mh.KVCache(2, 1, 1, D), ValueError, "must have shape"),  # H_kv 1, not 2
        (lambda: mh.KVCache(2, 1, H_KV, D, value_dim=4), ValueError, "must have shape"),
        (lambda: mh.KVCache(2, 1, H_KV, D, dtype=torch.float64), TypeError, "cache's dtype"),
        (lambda: mh.KVCache(2, 2, H_KV, D), ValueError, "must have shape"),  # B=2 for one row
    ],
    ids=["kv-heads", "value-dim", "dtype", "batch"],
)
def test_a_cache_that_does_not_fit_raises_as_the_modules_do(cache, error, match):
    """The short path stores into the cache without its checks, so it steps aside for a cache
    the modules would refuse (a broadcast would otherwise fill two heads from one)."""
    stack = _stack("llama", None)
    c = cache()
    with torch.inference_mode():
        c.begin(1)
        with pytest.raises(error, match=match):
            stack(torch.randn(1, 1, E), cache=c)


def test_a_second_pass_without_begin_raises_as_the_modules_do():
    stack = _stack("gpt2", None)
    cache = _cache("gpt2", 1, "growing")
    with torch.inference_mode():
        cache.begin(1)
        stack(torch.randn(1, 1, E), cache=cache)
        with pytest.raises(ValueError, match="already stored its keys this step"):
            stack(torch.randn(1, 1, E), cache=cache)
        cache.begin(torch.tensor([1]), 2)  # a step two tokens wide, fed one
        with pytest.raises(ValueError, match="must have shape"):
            stack(torch.randn(1, 1, E), cache=cache)
