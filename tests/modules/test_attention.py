"""MultiHeadAttention: the d2l example, parity with torch.nn.MultiheadAttention, conversion."""

from __future__ import annotations

import pytest
import torch
from helpers import naive_attention
from torch import nn

from multihead import MultiHeadAttention, masks, split_heads


def test_d2l_example_shape_and_values():
    # d2l: num_hiddens 100, 5 heads, dropout 0.5, no bias; batch 2, 4 queries, 6 key-value pairs
    torch.manual_seed(0)
    mha = MultiHeadAttention(100, 5, bias=False, dropout=0.5).eval()
    x, y = torch.randn(2, 4, 100), torch.randn(2, 6, 100)
    valid_lens = torch.tensor([3, 2])
    out = mha(x, y, y, mask=masks.lengths(valid_lens))
    assert out.shape == (2, 4, 100)
    q, k, v = (
        split_heads(p(t).double(), 5)
        for p, t in ((mha.q_proj, x), (mha.k_proj, y), (mha.v_proj, y))
    )
    keep = torch.arange(6)[None, None, None, :] < valid_lens[:, None, None, None]
    heads, _ = naive_attention(q, k, v, keep)
    want = mha.out_proj(heads.transpose(1, 2).reshape(2, 4, 100).float())
    torch.testing.assert_close(out, want, rtol=0, atol=1e-5)
    # keys past the valid length have no influence
    y2 = y.clone()
    y2[0, 3:] = 1e3
    y2[1, 2:] = -1e3
    torch.testing.assert_close(mha(x, y2, y2, mask=masks.lengths(valid_lens)), out, rtol=0, atol=0)


def test_dropout_only_in_training():
    torch.manual_seed(0)
    mha = MultiHeadAttention(8, 2, dropout=0.5)
    x = torch.randn(1, 5, 8)
    mha.eval()
    a, b = mha(x), mha(x)
    assert torch.equal(a, b)
    mha.train()
    assert not torch.equal(mha(x), a)


def _torch_pair(e, h, kdim, vdim, bias, batch_first=True):
    torch.manual_seed(1)
    ref = nn.MultiheadAttention(e, h, kdim=kdim, vdim=vdim, bias=bias, batch_first=batch_first)
    with torch.no_grad():  # torch zero-initializes biases; make them matter
        for p in ref.parameters():
            p.normal_(0, 0.3)
    return ref.eval(), MultiHeadAttention.from_torch(ref).eval()


def _inputs(b, length_q, length_k, e, kdim, vdim):
    g = torch.Generator().manual_seed(2)
    return (
        torch.randn(b, length_q, e, generator=g),
        torch.randn(b, length_k, kdim, generator=g),
        torch.randn(b, length_k, vdim, generator=g),
    )


LAYOUTS = [(12, 3, None, None), (12, 3, 7, 5), (16, 4, 16, 9)]


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("e,h,kdim,vdim", LAYOUTS, ids=["packed", "kdim7-vdim5", "vdim9"])
@pytest.mark.parametrize("form", ["none", "bool", "float"])
def test_parity_with_torch_multihead_attention(e, h, kdim, vdim, bias, form):
    b, length_q, length_k = 3, 5, 7
    ref, ours = _torch_pair(e, h, kdim, vdim, bias)
    x, y, z = _inputs(b, length_q, length_k, e, kdim or e, vdim or e)
    g = torch.Generator().manual_seed(3)
    blocked = torch.rand(length_q, length_k, generator=g) < 0.3
    blocked[:, 0] = False  # every row keeps a key: torch returns NaN for rows with none
    padding = torch.zeros(b, length_k, dtype=torch.bool)
    padding[1, 4:] = True
    padding[2, 1:3] = True
    if form == "none":
        am = kpm = None
    elif form == "bool":
        am, kpm = blocked, padding
    else:
        am = torch.randn(length_q, length_k, generator=g).masked_fill(blocked, -torch.inf)
        kpm = torch.zeros(b, length_k).masked_fill(padding, -torch.inf)
        kpm[0, 2] = 0.7  # a finite additive term on one key
    want, want_w = ref(x, y, z, attn_mask=am, key_padding_mask=kpm, average_attn_weights=False)
    mask, bias_t = masks.from_torch(attn_mask=am, key_padding_mask=kpm)
    got, got_w = ours.run(x, y, z, mask=mask, bias=bias_t)
    assert (got - want).abs().max() <= 1e-5
    assert (got_w - want_w).abs().max() <= 1e-5


def test_parity_with_3d_torch_mask_and_sequence_first_module():
    e, h, b, length = 8, 2, 2, 4
    ref, ours = _torch_pair(e, h, None, None, True, batch_first=False)
    x = torch.randn(length, b, e, generator=torch.Generator().manual_seed(4))
    am = torch.zeros(b * h, length, length, dtype=torch.bool)
    am[1, 2, 3] = am[3, 0, 1] = True
    want, want_w = ref(x, x, x, attn_mask=am, average_attn_weights=False)
    mask, _ = masks.from_torch(attn_mask=am, num_heads=h)
    got, got_w = ours.run(x.transpose(0, 1), mask=mask)
    assert (got.transpose(0, 1) - want).abs().max() <= 1e-5
    assert (got_w - want_w).abs().max() <= 1e-5


@pytest.mark.parametrize("e,h,kdim,vdim", LAYOUTS, ids=["packed", "kdim7-vdim5", "vdim9"])
def test_to_torch_round_trip(e, h, kdim, vdim):
    torch.manual_seed(5)
    ours = MultiHeadAttention(e, h, kdim=kdim, vdim=vdim).eval()
    theirs = ours.to_torch()
    assert theirs.batch_first and theirs._qkv_same_embed_dim == (
        kdim in (None, e) and vdim in (None, e)
    )
    x, y, z = _inputs(2, 3, 4, e, kdim or e, vdim or e)
    want, _ = theirs(x, y, z)
    torch.testing.assert_close(ours(x, y, z), want, rtol=0, atol=1e-5)
    back = MultiHeadAttention.from_torch(theirs)
    for a, b in zip(ours.state_dict().values(), back.state_dict().values()):
        assert torch.equal(a, b)


def test_grouped_query_attention_module():
    torch.manual_seed(6)
    mha = MultiHeadAttention(16, 4, num_kv_heads=2).double()
    assert mha.k_proj.out_features == 8 and mha.v_proj.out_features == 8
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    q = split_heads(mha.q_proj(x), 4)
    k, v = split_heads(mha.k_proj(x), 2), split_heads(mha.v_proj(x), 2)
    heads, _ = naive_attention(q, k, v)
    want = mha.out_proj(heads.transpose(1, 2).reshape(2, 5, 16))
    torch.testing.assert_close(mha(x), want)
    with pytest.raises(ValueError, match=r"no grouped-query attention.*num_kv_heads=2"):
        mha.to_torch()


def test_weights_per_head_and_self_attention_defaults():
    torch.manual_seed(7)
    mha = MultiHeadAttention(8, 2).eval()
    x = torch.randn(2, 3, 8)
    out, w = mha.run(x, mask=masks.causal())
    assert w.shape == (2, 2, 3, 3)
    assert torch.equal(w.triu(1), torch.zeros_like(w))
    torch.testing.assert_close(out, mha(x, x, x, mask=masks.causal()))


def test_from_torch_rejects_what_has_no_counterpart():
    with pytest.raises(ValueError, match=r"add_bias_kv and add_zero_attn have no counterpart"):
        MultiHeadAttention.from_torch(nn.MultiheadAttention(4, 2, add_bias_kv=True))
    with pytest.raises(TypeError, match=r"expects a torch.nn.MultiheadAttention"):
        MultiHeadAttention.from_torch(nn.Linear(2, 2))


def test_module_input_errors():
    mha = MultiHeadAttention(8, 2, kdim=5)
    with pytest.raises(ValueError, match=r"query must be a 3-D tensor \(B, L, E\)"):
        mha(torch.randn(3, 8))
    with pytest.raises(ValueError, match=r"key must have last dimension 5 \(B, S, kdim\)"):
        mha(torch.randn(1, 3, 8), torch.randn(1, 3, 8), torch.randn(1, 3, 8))
    with pytest.raises(ValueError, match=r"key and value the length S"):
        mha(torch.randn(1, 3, 8), torch.randn(1, 4, 5), torch.randn(1, 3, 8))
