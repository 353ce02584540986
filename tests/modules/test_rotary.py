"""RotaryEmbedding against transformers' Llama rotary and against the complex-number formula of
RoFormer (Su et al. 2021) written out in float64."""

from __future__ import annotations

import pytest
import torch

from multihead import RotaryEmbedding


def _complex_reference(x: torch.Tensor, positions: torch.Tensor, base: float, interleaved: bool):
    """RoPE as a complex product: pair i of a head, read as a + ib, is multiplied by
    exp(i * p * base^(-2i/D)). Pairs are (x[2i], x[2i+1]) (GPT-J) or (x[i], x[i + D/2])
    (GPT-NeoX / Llama). x: (B, H, L, D) float64; positions (B, L)."""
    d = x.shape[-1]
    i = torch.arange(d // 2, dtype=torch.float64)
    theta = base ** (-2 * i / d)
    angle = positions[:, None, :, None].double() * theta  # [B, 1, L, D/2]
    rotation = torch.polar(torch.ones_like(angle), angle)
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
    else:
        a, b = x[..., : d // 2], x[..., d // 2 :]
    z = torch.complex(a, b) * rotation
    out = torch.empty_like(x)
    if interleaved:
        out[..., 0::2], out[..., 1::2] = z.real, z.imag
    else:
        out[..., : d // 2], out[..., d // 2 :] = z.real, z.imag
    return out


@pytest.mark.parametrize("interleaved", [False, True], ids=["half_split", "interleaved"])
def test_float64_equals_the_complex_formula(interleaved):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 7, 14, dtype=torch.float64, generator=g)
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [40, 41, 42, 0, 1, 2, 977]])
    rope = RotaryEmbedding(14, base=500.0, interleaved=interleaved)
    expected = _complex_reference(x, positions, 500.0, interleaved)
    assert (rope(x, positions) - expected).abs().max() <= 1e-12


def test_half_split_equals_transformers_llama_rotary():
    """Same cos/sin and rotation as transformers (float32 angles): equal to rounding, at
    per-row offsets such as a cache gives (up to position 4000)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, rope_theta=10000.0)
    theirs = LlamaRotaryEmbedding(config)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(3, 4, 5, 16, generator=g)
    k = torch.randn(3, 2, 5, 16, generator=g)  # fewer key heads (GQA): same rotation
    positions = torch.tensor([[0, 1, 2, 3, 4], [17, 18, 19, 20, 21], [3996, 3997, 3998, 3999, 0]])
    cos, sin = theirs(q, positions)
    q_ref, k_ref = apply_rotary_pos_emb(q, k, cos, sin)
    ours = RotaryEmbedding(16)
    # float32 rounding of a few products; the angles themselves are computed identically
    assert (ours(q, positions) - q_ref).abs().max() <= 1e-6
    assert (ours(k, positions) - k_ref).abs().max() <= 1e-6
    torch.testing.assert_close(ours.inv_freq(), theirs.inv_freq, rtol=0, atol=0)


@pytest.mark.parametrize("interleaved", [False, True], ids=["half_split", "interleaved"])
def test_scores_depend_on_relative_position_only(interleaved):
    """q_m . k_n after rotation is a function of m - n: shifting both positions by 1000 keeps
    every score (float64, so the check is tight)."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 2, 6, 8, dtype=torch.float64, generator=g)
    k = torch.randn(1, 2, 6, 8, dtype=torch.float64, generator=g)
    rope = RotaryEmbedding(8, interleaved=interleaved)
    p = torch.tensor([[0, 3, 4, 9, 10, 11]])
    near = rope(q, p) @ rope(k, p).transpose(-2, -1)
    far = rope(q, p + 1000) @ rope(k, p + 1000).transpose(-2, -1)
    assert (near - far).abs().max() <= 1e-9
    unrotated = q @ k.transpose(-2, -1)
    assert (
        near.diagonal(dim1=-2, dim2=-1) - unrotated.diagonal(dim1=-2, dim2=-1)
    ).abs().max() < 1e-9


def test_packed_documents_restart_at_zero():
    """One packed row with positions restarting per document equals each document alone."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 2, 7, 8, generator=g)
    rope = RotaryEmbedding(8)
    packed = rope(x, torch.tensor([[0, 1, 2, 0, 1, 2, 3]]))
    torch.testing.assert_close(packed[:, :, :3], rope(x[:, :, :3]), rtol=0, atol=0)
    torch.testing.assert_close(packed[:, :, 3:], rope(x[:, :, 3:]), rtol=0, atol=0)


def test_half_precision_keeps_its_dtype():
    x = torch.randn(1, 1, 4, 8, dtype=torch.float64)
    ref = RotaryEmbedding(8)(x, torch.arange(4))
    for dtype in (torch.bfloat16, torch.float16):
        out = RotaryEmbedding(8)(x.to(dtype), torch.arange(4))
        assert out.dtype == dtype
        # cos/sin rounded to the dtype, then 2 products and a sum: a few ulps of the inputs
        assert (out.double() - ref).abs().max() <= 4 * torch.finfo(dtype).eps * x.abs().max()


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: RotaryEmbedding(7), ValueError, "head_dim must be even. Received: head_dim=7"),
        (lambda: RotaryEmbedding(8, base=0), ValueError, "base must be a positive number"),
        (lambda: RotaryEmbedding(8, interleaved=1), TypeError, "interleaved must be a bool"),
        (
            lambda: RotaryEmbedding(8)(torch.randn(1, 1, 3, 6)),
            ValueError,
            r"head dim D=8 .* Received: x.shape=\(1, 1, 3, 6\)",
        ),
        (
            lambda: RotaryEmbedding(8)(torch.randn(1, 1, 3, 8), torch.tensor([0.0, 1.0, 2.0])),
            TypeError,
            "positions must be an integer tensor",
        ),
        (
            lambda: RotaryEmbedding(8)(torch.randn(2, 1, 3, 8), torch.arange(4)),
            ValueError,
            r"positions must have shape \(L,\) or \(B, L\) = \(2, 3\)",
        ),
        (
            lambda: RotaryEmbedding(8)(torch.randn(1, 3, 8)),
            ValueError,
            r"x must be a 4-D tensor \(B, H, L, D\)",
        ),
    ],
    ids=["odd_dim", "base", "interleaved", "width", "float_positions", "positions_shape", "rank"],
)
def test_bad_arguments(make, error, match):
    with pytest.raises(error, match=match):
        make()
