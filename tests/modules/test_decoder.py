"""RMSNorm, the gated feed-forward and the layers that take their parts as arguments, against
transformers' Llama modules and torch's own layers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import multihead as mh
from multihead import masks
from multihead.modules import StackOutput


def test_rmsnorm_equals_transformers_and_torch():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 24, generator=g) * 4
    ours, theirs = mh.RMSNorm(24, eps=1e-5), LlamaRMSNorm(24, eps=1e-5)
    with torch.no_grad():
        ours.weight.copy_(torch.rand(24, generator=g) + 0.5)
        theirs.weight.copy_(ours.weight)
    torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=0)
    # bf16: statistics in float32 and the cast before the weight, as transformers does
    torch.testing.assert_close(ours.bfloat16()(x.bfloat16()), theirs.bfloat16()(x.bfloat16()))
    reference = nn.RMSNorm(24, eps=1e-5)
    with torch.no_grad():
        reference.weight.copy_(ours.weight.float())
    assert (ours.float()(x) - reference(x)).abs().max() <= 1e-6


def test_gated_feed_forward_equals_transformers_llama_mlp():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    theirs = LlamaMLP(LlamaConfig(hidden_size=16, intermediate_size=40, num_attention_heads=4))
    ours = mh.GatedFeedForward(16, 40)
    ours.load_state_dict(theirs.state_dict())  # same names: gate_proj, up_proj, down_proj
    x = torch.randn(2, 7, 16)
    torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=0)
    x64 = x.double()
    formula = ours.double()
    expected = formula.down_proj(
        torch.nn.functional.silu(formula.gate_proj(x64)) * formula.up_proj(x64)
    )
    assert (formula(x64) - expected).abs().max() == 0


def _llama_layer(e=32, h=4, h_kv=2):
    attn = mh.MultiHeadAttention(
        e, h, num_kv_heads=h_kv, bias=False, rotary=mh.RotaryEmbedding(e // h)
    )
    return mh.TransformerDecoderLayer(
        attn, mh.GatedFeedForward(e, 48), norm1=mh.RMSNorm(e), norm2=mh.RMSNorm(e)
    )


def test_decoder_layer_is_the_pre_norm_formula():
    """x + attn(norm1(x)) then + ff(norm2(x)), causal by default, checked in float64 against
    the parts called by hand with an explicit causal mask."""
    torch.manual_seed(0)
    layer = _llama_layer().double().eval()
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    h = x + layer.self_attn(layer.norm1(x), mask=masks.causal())
    expected = h + layer.feed_forward(layer.norm2(h))
    assert (layer(x) - expected).abs().max() <= 1e-12
    out, weights = layer.run(x)
    assert weights.shape == (2, 4, 9, 9) and (weights.triu(1) == 0).all()
    assert (out - expected).abs().max() <= 1e-12


def test_decoder_stack_hidden_states_and_weights():
    torch.manual_seed(1)
    stack = mh.TransformerDecoder([_llama_layer() for _ in range(3)], norm=mh.RMSNorm(32)).eval()
    x = torch.randn(2, 6, 32)
    out = stack.run(x, return_hidden=True)
    assert len(out.hidden_states) == 4 and len(out.weights) == 3
    # with weights on, the output comes from another kernel (weights @ V): fp32 rounding only
    assert (out.output - stack(x)).abs().max() <= 1e-5
    torch.testing.assert_close(out.hidden_states[-1], out.output, rtol=0, atol=0)
    y = x
    for layer in stack.layers:
        y = layer(y)
    torch.testing.assert_close(stack(x), stack.norm(y), rtol=0, atol=0)


def test_encoder_layer_takes_parts_and_keeps_its_constructor():
    """The parts form with the same modules equals the classic constructor's layer; a Llama-
    style pre-RMSNorm SwiGLU encoder layer needs no sizes; TransformerEncoder stacks it."""
    torch.manual_seed(2)
    built = mh.TransformerEncoderLayer(16, 4, 40, norm_first=True).eval()
    parts = mh.TransformerEncoderLayer(
        self_attn=built.self_attn,
        feed_forward=built.feed_forward,
        norm1=built.norm1,
        norm2=built.norm2,
        norm_first=True,
    ).eval()
    x = torch.randn(2, 5, 16)
    m = masks.lengths(torch.tensor([5, 3]))
    torch.testing.assert_close(parts(x, mask=m), built(x, mask=m), rtol=0, atol=0)
    llama_style = mh.TransformerEncoderLayer(
        self_attn=mh.MultiHeadAttention(16, 4, num_kv_heads=2, bias=False),
        feed_forward=mh.GatedFeedForward(16, 40),
        norm1=mh.RMSNorm(16),
        norm2=mh.RMSNorm(16),
        norm_first=True,
    )
    encoded = mh.TransformerEncoder([llama_style, parts]).run(x, mask=m)
    assert isinstance(encoded, StackOutput) and encoded.weights[0].shape == (2, 4, 5, 5)
    mixed = mh.TransformerEncoderLayer(16, feed_forward=mh.GatedFeedForward(16, 40), num_heads=4)
    assert isinstance(mixed.self_attn, mh.MultiHeadAttention)
    assert isinstance(mixed.norm1, nn.LayerNorm)


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (
            lambda: mh.TransformerEncoderLayer(feed_forward=nn.Identity()),
            ValueError,
            "pass embed_dim and num_heads to build self_attn, or pass self_attn= itself",
        ),
        (
            lambda: mh.TransformerEncoderLayer(16, 4),
            ValueError,
            "pass ff_dim to build feed_forward.* Received: ff_dim=None",
        ),
        (
            lambda: mh.TransformerEncoderLayer(16, 4, 32, norm1="layer"),
            TypeError,
            "norm1 must be a torch.nn.Module",
        ),
        (
            lambda: mh.TransformerDecoderLayer(nn.Identity(), lambda x: x),
            TypeError,
            "feed_forward must be a torch.nn.Module",
        ),
        (
            lambda: mh.TransformerDecoder([mh.TransformerEncoderLayer(16, 4, 32)]),
            ValueError,
            r"non-empty list of TransformerDecoderLayer. Received: \['TransformerEncoderLayer'\]",
        ),
        (
            lambda: mh.MultiHeadAttention(16, 4, rotary=mh.RotaryEmbedding(8)),
            ValueError,
            "rotary must be a RotaryEmbedding over the head dim D=4",
        ),
        (
            lambda: mh.MultiHeadAttention(16, 4)(torch.randn(1, 3, 16), positions=torch.arange(3)),
            ValueError,
            "positions= places rotary embeddings, and this module has none",
        ),
        (
            lambda: mh.MultiHeadAttention(16, 4, rotary=mh.RotaryEmbedding(4))(
                torch.randn(1, 3, 16), torch.randn(1, 2, 16)
            ),
            ValueError,
            "apply to self-attention only",
        ),
    ],
    ids=[
        "no_attention_sizes",
        "no_ff_dim",
        "norm_type",
        "decoder_part_type",
        "decoder_stack_layers",
        "rotary_dim",
        "positions_without_rotary",
        "rotary_cross_attention",
    ],
)
def test_bad_parts(make, error, match):
    with pytest.raises(error, match=match):
        make()
