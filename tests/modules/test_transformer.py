"""Encoder blocks against torch.nn.TransformerEncoderLayer and hand-written formulas."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from multihead import (
    FeedForward,
    LearnedPositionalEncoding,
    MultiHeadAttention,
    SinusoidalPositionalEncoding,
    TransformerEncoder,
    TransformerEncoderLayer,
    masks,
)
from multihead.modules import StackOutput, sinusoidal_table

E, H, FF = 24, 4, 40


def _copy_from_torch(src: nn.TransformerEncoderLayer, norm_first: bool, act: str):
    layer = TransformerEncoderLayer(
        E, H, FF, activation=act, norm_first=norm_first, layer_norm_eps=src.norm1.eps
    ).double()
    layer.self_attn = MultiHeadAttention.from_torch(src.self_attn)
    layer.feed_forward.linear1.load_state_dict(src.linear1.state_dict())
    layer.feed_forward.linear2.load_state_dict(src.linear2.state_dict())
    layer.norm1.load_state_dict(src.norm1.state_dict())
    layer.norm2.load_state_dict(src.norm2.state_dict())
    return layer.eval()


@pytest.mark.parametrize("act", ["gelu", "relu"])
@pytest.mark.parametrize("norm_first", [False, True], ids=["post_norm", "pre_norm"])
def test_layer_matches_torch(norm_first, act):
    torch.manual_seed(0)
    src = nn.TransformerEncoderLayer(
        E, H, FF, dropout=0.0, activation=act, batch_first=True, norm_first=norm_first
    ).double()
    src.eval()
    ours = _copy_from_torch(src, norm_first, act)
    x = torch.randn(3, 11, E, dtype=torch.float64, requires_grad=True)  # grad: no nested fast path
    lens = torch.tensor([11, 6, 1])
    pad = torch.arange(11)[None] >= lens[:, None]  # torch polarity: True = padding
    expected = src(x, src_key_padding_mask=pad)
    got, weights = ours.run(x, mask=masks.lengths(lens))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    assert weights.shape == (3, H, 11, 11)
    assert torch.all(weights[1, :, :, 6:] == 0)
    torch.testing.assert_close(weights.sum(-1), torch.ones(3, H, 11, dtype=torch.float64))


def test_layer_weights_equal_module_weights():
    torch.manual_seed(1)
    layer = TransformerEncoderLayer(E, H, FF).double().eval()
    x = torch.randn(2, 7, E, dtype=torch.float64)
    _, w = layer.run(x, mask=masks.causal())
    _, direct = layer.self_attn.run(x, mask=masks.causal())
    torch.testing.assert_close(w, direct, rtol=0, atol=0)
    plain = layer(x, mask=masks.causal())
    torch.testing.assert_close(plain, layer.run(x, mask=masks.causal())[0])


def test_encoder_matches_torch_stack_and_returns_everything():
    torch.manual_seed(2)
    srcs = [
        nn.TransformerEncoderLayer(E, H, FF, dropout=0.0, batch_first=True, activation="gelu")
        .double()
        .eval()
        for _ in range(3)
    ]
    ours = TransformerEncoder([_copy_from_torch(s, False, "gelu") for s in srcs])
    x = torch.randn(2, 9, E, dtype=torch.float64)
    out = ours.run(x, return_hidden=True)
    assert isinstance(out, StackOutput)
    h = x
    assert out.hidden_states[0] is x
    for i, s in enumerate(srcs):
        h = s(h)
        torch.testing.assert_close(out.hidden_states[i + 1], h, rtol=0, atol=1e-12)
    torch.testing.assert_close(out.output, h, rtol=0, atol=1e-12)
    assert len(out.weights) == 3 and out.weights[0].shape == (2, H, 9, 9)
    plain = ours(x)
    assert isinstance(plain, torch.Tensor)
    torch.testing.assert_close(plain, h, rtol=0, atol=1e-12)


def test_encoder_final_norm_applies_to_output_and_last_hidden():
    torch.manual_seed(3)
    norm = nn.LayerNorm(E)
    enc = TransformerEncoder([TransformerEncoderLayer(E, H, FF, norm_first=True)], norm=norm)
    x = torch.randn(1, 5, E)
    out = enc.run(x, weights=False, return_hidden=True)
    expected = norm(enc.layers[0](x))
    torch.testing.assert_close(out.output, expected)
    torch.testing.assert_close(out.hidden_states[-1], expected)
    assert out.weights is None


def test_feed_forward_formula():
    torch.manual_seed(4)
    ff = FeedForward(6, 10, activation="gelu_tanh")
    x = torch.randn(2, 3, 6)
    h = x @ ff.linear1.weight.T + ff.linear1.bias
    h = 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h**3)))
    torch.testing.assert_close(ff(x), h @ ff.linear2.weight.T + ff.linear2.bias)


def test_dropout_only_in_training():
    torch.manual_seed(5)
    layer = TransformerEncoderLayer(E, H, FF, dropout=0.5)
    x = torch.randn(2, 6, E)
    layer.eval()
    torch.testing.assert_close(layer(x), layer(x), rtol=0, atol=0)
    layer.train()
    assert not torch.equal(layer(x), layer(x))


def test_sinusoidal_table_values():
    table = sinusoidal_table(50, 8)
    assert table.shape == (50, 8)
    torch.testing.assert_close(table[0], torch.tensor([0.0, 1.0] * 4))
    for p, i in [(1, 0), (7, 1), (49, 3)]:
        angle = p / 10000 ** (2 * i / 8)
        assert table[p, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-7)
        assert table[p, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-7)


def test_sinusoidal_encoding_adds_table_and_extends():
    enc = SinusoidalPositionalEncoding(8, max_len=4)
    x = torch.zeros(2, 6, 8)
    torch.testing.assert_close(enc(x)[1], sinusoidal_table(6, 8))
    packed = enc(x, positions=torch.tensor([0, 1, 2, 0, 1, 0]))
    torch.testing.assert_close(packed[0, 3], sinusoidal_table(1, 8)[0])


def test_learned_encoding_positions_and_limit():
    torch.manual_seed(6)
    enc = LearnedPositionalEncoding(5, 4)
    x = torch.randn(2, 3, 4)
    torch.testing.assert_close(enc(x), x + enc.embedding.weight[:3])
    pos = torch.tensor([[0, 1, 0], [4, 3, 2]])
    torch.testing.assert_close(enc(x, pos), x + enc.embedding.weight[pos])
    with pytest.raises(ValueError, match=r"below max_len=5.*Received: positions from 0 to 5"):
        enc(torch.zeros(1, 6, 4))


@pytest.mark.parametrize(
    ("build", "error", "match"),
    [
        (lambda: FeedForward(4, 8, activation="swish"), ValueError, "activation must be one of"),
        (lambda: SinusoidalPositionalEncoding(7), ValueError, "must be even"),
        (lambda: TransformerEncoder([]), ValueError, "non-empty list"),
        (
            lambda: TransformerEncoder([nn.Linear(2, 2)]),
            ValueError,
            r"Received: \['Linear'\]",
        ),
        (lambda: TransformerEncoderLayer(10, 3, 8), ValueError, "divisible by num_heads"),
    ],
    ids=["activation", "odd_dim", "empty", "not_layer", "heads"],
)
def test_bad_construction(build, error, match):
    with pytest.raises(error, match=match):
        build()


def test_same_layer_twice_rejected():
    layer = TransformerEncoderLayer(E, H, FF)
    with pytest.raises(ValueError, match="distinct modules"):
        TransformerEncoder([layer, layer])


def test_bad_positions():
    enc = LearnedPositionalEncoding(5, 4)
    with pytest.raises(TypeError, match="integer tensor"):
        enc(torch.zeros(1, 2, 4), torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match=r"shape \(L,\) or \(B, L\)"):
        enc(torch.zeros(1, 2, 4), torch.tensor([0, 1, 2]))
