"""Issue 20, point 1, from outside the package: one return type per function.

``attention`` returns a tensor, ``attention_with_weights`` an ``AttentionOutput``, every
module's ``forward`` a tensor and its ``run`` one record type, whatever flags are passed;
``heads=`` returns (and computes) the weights of the chosen heads only. The weights are checked
against the naive formula written out here in float64.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import Tensor

import multihead as mh
from multihead import backends, masks
from multihead import bias as mb


def _qkv(b=2, h=4, h_kv=2, length_q=5, length_k=7, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(b, h, length_q, d, generator=g, dtype=torch.float64),
        torch.randn(b, h_kv, length_k, d, generator=g, dtype=torch.float64),
        torch.randn(b, h_kv, length_k, d, generator=g, dtype=torch.float64),
    )


def _naive_weights(q: Tensor, k: Tensor, keep: Tensor | None, bias: Tensor | None = None):
    """softmax(q k^T / sqrt(D) + bias) over visible keys, rows with none at 0 (float64)."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if bias is not None:
        scores = scores + bias
    if keep is not None:
        scores = scores.masked_fill(~keep, -math.inf)
    w = scores.softmax(-1)
    return torch.nan_to_num(w, nan=0.0)


# ------------------------------------------------------------------------------ the function


ATTENTION_OPTIONS = {
    "mask": [None, masks.causal(), torch.ones(5, 7, dtype=torch.bool)],
    "bias": [None, mb.alibi(4)],
    "backend": ["auto", "reference", "tiled"],
}


@pytest.mark.parametrize("mask,bias,backend", list(itertools.product(*ATTENTION_OPTIONS.values())))
def test_attention_returns_a_tensor_and_with_weights_a_record(mask, bias, backend):
    q, k, v = _qkv()
    out = mh.attention(q, k, v, mask, bias=bias, backend=backend)
    assert type(out) is Tensor and out.shape == (2, 4, 5, 8)
    for heads in (None, [3, 1]):
        record = mh.attention_with_weights(q, k, v, mask, bias=bias, heads=heads, backend=backend)
        assert type(record) is mh.AttentionOutput
        assert record.output.shape == (2, 4, 5, 8)
        assert record.weights.shape == (2, 4 if heads is None else 2, 5, 7)
        # the output covers every head either way, equal to attention()'s
        torch.testing.assert_close(record.output, out, rtol=0, atol=1e-12)


def test_weights_are_asked_for_by_the_function_not_a_flag():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"attention\(\) got an unexpected keyword argument"):
        mh.attention(q, k, v, return_weights=True)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'return_weights'"):
        mh.explain_backend(q, k, v, return_weights=True)
    # explain_backend tells which backend attention_with_weights runs
    assert mh.explain_backend(q, k, v, weights=True).backend in ("tiled", "reference")
    assert "does not return attention weights" in str(mh.explain_backend(q, k, v, weights=True))


@pytest.mark.parametrize(
    "case", ["plain", "causal", "per_head_mask", "alibi", "gqa_per_head_bias", "cross_lengths"]
)
@pytest.mark.parametrize("heads", [[0], [3, 1], [2, 0, 3], [0, 1, 2, 3], [3, 2, 1, 0]])
def test_heads_are_the_full_weights_rows_in_the_given_order(case, heads):
    q, k, v = _qkv(seed=3)
    b, h, length_q, length_k = 2, 4, 5, 7
    mask = keep = bias = dense_bias = None
    if case == "causal":
        mask = masks.causal()
        keep = torch.ones(length_q, length_k, dtype=torch.bool).tril(length_k - length_q)
    elif case == "per_head_mask":  # a different mask in every head
        keep = torch.rand(b, h, length_q, length_k, generator=torch.Generator().manual_seed(1))
        keep = keep > 0.4
        mask = keep
    elif case == "alibi":
        bias = mb.alibi(h)
        dense_bias = bias.to_dense(length_q, length_k, dtype=torch.float64)
    elif case == "gqa_per_head_bias":
        dense_bias = torch.randn(1, h, length_q, length_k, dtype=torch.float64)
        bias = dense_bias
    else:  # cross_lengths: key padding from lengths
        mask = masks.lengths(torch.tensor([3, 7]))
        keep = (torch.arange(length_k)[None] < torch.tensor([3, 7])[:, None])[:, None, None]
    want = _naive_weights(q, k, keep, dense_bias)
    full = mh.attention_with_weights(q, k, v, mask, bias=bias)
    part = mh.attention_with_weights(q, k, v, mask, bias=bias, heads=heads)
    # float64 against float64: only summation order differs
    torch.testing.assert_close(full.weights, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(part.weights, full.weights[:, heads], rtol=0, atol=1e-12)
    torch.testing.assert_close(part.output, full.output, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "heads,match",
    [
        ([], r"non-empty list of query-head indices"),
        ([1, 1], r"must not repeat an index.*\[1, 1\]"),
        ([4], r"query-head indices in \[0, 4\).*out of range: \[4\]"),
        ([-1], r"out of range: \[-1\]"),
        ([1.0], r"non-empty list of query-head indices \(ints\)"),
        ([True], r"non-empty list of query-head indices \(ints\)"),
        (2, r"non-empty list.*Received: heads=2"),
        (torch.tensor([1]), r"non-empty list"),
    ],
)
def test_bad_heads_say_what_is_allowed(heads, match):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=match):
        mh.attention_with_weights(q, k, v, heads=heads)
    with pytest.raises(ValueError, match=match):
        mh.MultiHeadAttention(8, 4).run(torch.randn(1, 3, 8), heads=heads)


@pytest.fixture
def spy():
    """A backend that records the shape of every call it runs, delegating to reference."""
    seen = []
    reference = backends.BACKENDS["reference"]

    def run(call):
        seen.append((tuple(call.query.shape), tuple(call.key.shape), call.return_weights))
        return reference.run(call)

    backends.register(
        "spy",
        backends.Backend(
            run=run,
            rank=lambda call: backends.Rank(1e9, "test spy"),
            capabilities=backends.Capabilities(label="spy", weights=True, dropout=True),
        ),
    )
    yield seen
    backends.unregister("spy")


def test_heads_compute_weights_for_those_heads_only(spy):
    """The weights are computed on a call holding only the chosen query heads (and the
    key/value head each reads); the full output is computed without weights."""
    q, k, v = _qkv(b=1, h=8, h_kv=2, length_q=6, length_k=9)
    out = mh.attention_with_weights(q, k, v, masks.causal(), heads=[6, 1], backend="spy")
    assert out.weights.shape == (1, 2, 6, 9)
    weight_calls = [s for s in spy if s[2]]
    assert weight_calls == [((1, 2, 6, 8), (1, 2, 9, 8), True)]  # 2 of 8 heads, B*2*L*S
    assert [s for s in spy if not s[2]] == [((1, 8, 6, 8), (1, 2, 9, 8), False)]
    want = _naive_weights(q, k, torch.ones(6, 9, dtype=torch.bool).tril(3))[:, [6, 1]]
    torch.testing.assert_close(out.weights, want, rtol=0, atol=1e-12)
    spy.clear()
    mh.attention_with_weights(q, k, v, backend="spy")  # no heads: one call, every head
    assert spy == [((1, 8, 6, 8), (1, 2, 9, 8), True)]


# ------------------------------------------------------------------------------- the modules


def _flag_sets(**options):
    names = list(options)
    for values in itertools.product(*options.values()):
        yield dict(zip(names, values))


def test_multihead_attention_forward_is_a_tensor_run_a_record():
    torch.manual_seed(0)
    mha = mh.MultiHeadAttention(16, 4, num_kv_heads=2)
    x = torch.randn(2, 5, 16)
    for kw in _flag_sets(mask=[None, masks.causal()], bias=[None, mb.alibi(4)]):
        out = mha(x, **kw)
        assert type(out) is Tensor and out.shape == (2, 5, 16)
        for heads in (None, [2], [0, 3]):
            record = mha.run(x, heads=heads, **kw)
            assert type(record) is mh.AttentionOutput
            torch.testing.assert_close(record.output, out)
            assert record.weights.shape == (2, 4 if heads is None else len(heads), 5, 5)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'return_weights'"):
        mha(x, return_weights=True)


def test_a_cached_run_gives_weights_over_the_cache_slots():
    torch.manual_seed(0)
    mha = mh.MultiHeadAttention(8, 2)
    cache = mh.KVCache(1, 1, 2, 4, max_length=6)
    x = torch.randn(1, 3, 8)
    cache.begin(3, 3)
    record = mha.run(x, cache=cache[0], heads=[1])
    assert type(record) is mh.AttentionOutput and record.weights.shape[:3] == (1, 1, 3)
    full = mha.run(x, mask=masks.causal(), heads=[1])
    torch.testing.assert_close(record.weights[..., :3], full.weights)


def _encoder_layer():
    return mh.TransformerEncoderLayer(16, 4, 32)


def _decoder_layer():
    return mh.TransformerDecoderLayer(
        mh.MultiHeadAttention(16, 4), mh.FeedForward(16, 32), norm1=torch.nn.LayerNorm(16)
    )


@pytest.mark.parametrize("make", [_encoder_layer, _decoder_layer], ids=["encoder", "decoder"])
def test_layers_forward_is_a_tensor_run_an_attention_output(make):
    torch.manual_seed(0)
    layer = make().eval()
    x = torch.randn(2, 5, 16)
    for mask in (None, masks.causal()):
        out = layer(x, mask=mask)
        assert type(out) is Tensor and out.shape == (2, 5, 16)
        for heads in (None, [1, 3]):
            record = layer.run(x, mask=mask, heads=heads)
            assert type(record) is mh.AttentionOutput
            torch.testing.assert_close(record.output, out)
            direct = layer.self_attn.run(
                layer.norm1(x) if isinstance(layer, mh.TransformerDecoderLayer) else x,
                mask=masks.causal() if mask is None and make is _decoder_layer else mask,
                heads=heads,
            )
            torch.testing.assert_close(record.weights, direct.weights)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'return_weights'"):
        layer(x, return_weights=True)


def _encoder():
    return mh.TransformerEncoder([_encoder_layer() for _ in range(3)], norm=torch.nn.LayerNorm(16))


def _decoder():
    return mh.TransformerDecoder([_decoder_layer() for _ in range(3)], norm=torch.nn.LayerNorm(16))


@pytest.mark.parametrize("make", [_encoder, _decoder], ids=["encoder", "decoder"])
def test_stacks_forward_is_a_tensor_run_one_stack_output(make):
    torch.manual_seed(0)
    stack = make().eval()
    x = torch.randn(2, 5, 16)
    out = stack(x)
    assert type(out) is Tensor and out.shape == (2, 5, 16)
    everything = stack.run(x, return_hidden=True)
    for kw in _flag_sets(weights=[True, False], heads=[None, [2, 0]], return_hidden=[True, False]):
        if kw["heads"] is not None and not kw["weights"]:
            with pytest.raises(ValueError, match=r"heads= chooses which heads.*weights=False"):
                stack.run(x, **kw)
            continue
        record = stack.run(x, **kw)
        assert type(record) is mh.StackOutput, kw
        torch.testing.assert_close(record.output, out)
        if kw["return_hidden"]:
            assert len(record.hidden_states) == 4
            torch.testing.assert_close(record.hidden_states[-1], out)
        else:
            assert record.hidden_states is None
        if kw["weights"]:
            pick = slice(None) if kw["heads"] is None else kw["heads"]
            assert len(record.weights) == 3
            for w, w_all in zip(record.weights, everything.weights):
                torch.testing.assert_close(w, w_all[:, pick])
        else:
            assert record.weights is None
    for old in ("return_weights", "return_hidden"):
        with pytest.raises(TypeError, match=rf"unexpected keyword argument '{old}'"):
            stack(x, **{old: True})


def test_old_record_names_are_gone():
    import multihead.modules as modules

    assert not hasattr(modules, "EncoderOutput") and not hasattr(modules, "DecoderOutput")
    assert mh.StackOutput is modules.StackOutput
    assert mh.AttentionOutput is modules.AttentionOutput
