"""MultiHeadAttention's head_dim, value_head_dim and out_dim (Keras' key_dim, value_dim and
output_shape), against the attention formula written out in float64."""

from __future__ import annotations

import pytest
import torch
from helpers import naive_attention

from multihead import MultiHeadAttention, masks


def _written_out(mha: MultiHeadAttention, x, y, z, keep=None):
    """Projections with explicit per-head reshapes, naive attention, concatenation, output."""
    h, h_kv = mha.num_heads, mha.num_kv_heads

    def heads(t, proj, n):  # (B, L, n * d) -> (B, n, L, d)
        out = t @ proj.weight.T + (0 if proj.bias is None else proj.bias)
        return out.reshape(t.shape[0], t.shape[1], n, -1).permute(0, 2, 1, 3)

    q, k, v = heads(x, mha.q_proj, h), heads(y, mha.k_proj, h_kv), heads(z, mha.v_proj, h_kv)
    o, w = naive_attention(q, k, v, keep)
    o = o.permute(0, 2, 1, 3).reshape(x.shape[0], x.shape[1], -1)  # heads side by side
    return o @ mha.out_proj.weight.T + (0 if mha.out_proj.bias is None else mha.out_proj.bias), w


# (embed_dim, num_heads, num_kv_heads, head_dim, value_head_dim, out_dim, kdim, vdim)
LAYOUTS = [
    (10, 3, None, 4, None, None, None, None),  # E = 10 not divisible by H = 3
    (12, 3, None, None, 7, None, None, None),  # D_v = 7, D = 4
    (12, 3, None, None, None, 5, None, None),  # output narrower than E
    (9, 4, 2, 5, 3, 11, 6, 8),  # everything at once, with GQA and kdim/vdim
]


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize(
    "e,h,h_kv,d,d_v,out,kdim,vdim",
    LAYOUTS,
    ids=["head_dim", "value_head_dim", "out_dim", "all-gqa"],
)
def test_new_dims_against_the_formula(e, h, h_kv, d, d_v, out, kdim, vdim, bias):
    torch.manual_seed(0)
    mha = MultiHeadAttention(
        e,
        h,
        num_kv_heads=h_kv,
        kdim=kdim,
        vdim=vdim,
        bias=bias,
        head_dim=d,
        value_head_dim=d_v,
        out_dim=out,
    ).double()
    d = d or e // h
    d_v, out = d_v or d, out or e
    assert (mha.head_dim, mha.value_head_dim, mha.out_dim) == (d, d_v, out)
    assert mha.q_proj.weight.shape == (h * d, e)
    assert mha.v_proj.weight.shape == ((h_kv or h) * d_v, vdim or e)
    assert mha.out_proj.weight.shape == (out, h * d_v)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, e, generator=g, dtype=torch.float64)
    y = torch.randn(2, 7, kdim or e, generator=g, dtype=torch.float64)
    z = torch.randn(2, 7, vdim or e, generator=g, dtype=torch.float64)
    lens = torch.tensor([7, 3])
    keep = (torch.arange(7) < lens[:, None])[:, None, None, :]
    got, got_w = mha.run(x, y, z, mask=masks.lengths(lens))
    want, want_w = _written_out(mha, x, y, z, keep)
    assert got.shape == (2, 5, out) and got_w.shape == (2, h, 5, 7)
    # float64 on both sides: only summation order differs
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(got_w, want_w, rtol=0, atol=1e-12)


def test_default_options_keep_the_old_layout():
    mha = MultiHeadAttention(12, 3)
    assert (mha.head_dim, mha.value_head_dim, mha.out_dim) == (4, 4, 12)
    explicit = MultiHeadAttention(12, 3, head_dim=4, value_head_dim=4, out_dim=12)
    shapes = {k: v.shape for k, v in mha.state_dict().items()}
    assert shapes == {k: v.shape for k, v in explicit.state_dict().items()}
    assert "head_dim" not in repr(mha) and "head_dim=4" not in repr(explicit)
    assert "value_head_dim=7, out_dim=5" in repr(
        MultiHeadAttention(12, 3, value_head_dim=7, out_dim=5)
    )


def test_explicit_layout_that_torch_can_express_converts():
    torch.manual_seed(2)
    ours = MultiHeadAttention(12, 3, head_dim=4, value_head_dim=4, out_dim=12).eval()
    x = torch.randn(2, 3, 12)
    torch.testing.assert_close(ours.to_torch()(x, x, x)[0], ours(x), rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "options",
    [{"head_dim": 5}, {"value_head_dim": 3}, {"out_dim": 7}],
    ids=["head_dim", "value_head_dim", "out_dim"],
)
def test_to_torch_refuses_what_torch_cannot_express(options):
    mha = MultiHeadAttention(12, 3, **options)
    with pytest.raises(ValueError, match=r"needs head_dim == embed_dim / num_heads.*Received:"):
        mha.to_torch()


def test_option_errors():
    with pytest.raises(ValueError, match=r"head counts that divide 10.*num_heads=3"):
        MultiHeadAttention(10, 3)  # without head_dim the old rule holds
    with pytest.raises(ValueError, match=r"head_dim must be a positive int. Received: head_dim=0"):
        MultiHeadAttention(10, 3, head_dim=0)
    with pytest.raises(TypeError, match=r"value_head_dim must be an int.*2.5"):
        MultiHeadAttention(12, 3, value_head_dim=2.5)
    with pytest.raises(ValueError, match=r"out_dim must be a positive int. Received: out_dim=-1"):
        MultiHeadAttention(12, 3, out_dim=-1)
    with pytest.raises(ValueError, match=r"multiple of num_kv_heads.*num_kv_heads=2"):
        MultiHeadAttention(10, 3, num_kv_heads=2, head_dim=4)
    with pytest.raises(ValueError, match=r"embed_dim must be a positive int"):
        MultiHeadAttention(0, 3, head_dim=4)
    with pytest.raises(ValueError, match=r"query must have last dimension 10"):
        MultiHeadAttention(10, 3, head_dim=4)(torch.randn(1, 2, 12))
