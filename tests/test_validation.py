"""Every user-facing error: type, and a message that says what was expected and received."""

from __future__ import annotations

import pytest
import torch
from helpers import qkv

import multihead as mh
from multihead import MultiHeadAttention, masks


def test_embed_dim_not_divisible_lists_working_head_counts():
    with pytest.raises(
        ValueError,
        match=r"head counts that divide 100: 1, 2, 4, 5, 10, 20, 25, 50, 100\. Received: embed_dim=100, num_heads=3",
    ):
        MultiHeadAttention(100, 3)


def test_num_heads_not_divisible_by_num_kv_heads():
    with pytest.raises(
        ValueError, match=r"try num_kv_heads in 1, 2, 4, 8\. Received: num_heads=8, num_kv_heads=3"
    ):
        MultiHeadAttention(64, 8, num_kv_heads=3)


def test_bad_integers_and_dropout_in_module():
    with pytest.raises(TypeError, match=r"num_heads must be an int"):
        MultiHeadAttention(8, 2.0)
    with pytest.raises(ValueError, match=r"embed_dim must be a positive int"):
        MultiHeadAttention(0, 1)
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\).*Received: dropout=1.0"):
        MultiHeadAttention(8, 2, dropout=1.0)


def test_rank_errors():
    q, k, v = qkv(1, 2, 2, 3, 4, 5)
    with pytest.raises(
        ValueError,
        match=r"query must be a 4-D tensor \(B, H, L, D\). Received: query.shape=\(2, 3, 5\)",
    ):
        mh.attention(q[0], k, v)
    with pytest.raises(ValueError, match=r"value must be a 4-D tensor \(B, H_kv, S, D_v\)"):
        mh.attention(q, k, v[None])
    with pytest.raises(TypeError, match=r"key must be a torch.Tensor"):
        mh.attention(q, k.tolist(), v)


def test_head_dim_mismatch():
    q, k, v = qkv(1, 2, 2, 3, 4, 5)
    with pytest.raises(ValueError, match=r"same head dim D.*key.shape=\(1, 2, 4, 4\)"):
        mh.attention(q, k[..., :4], v)


def test_gqa_heads_must_divide():
    q, k, v = qkv(1, 6, 4, 3, 4, 5)
    with pytest.raises(
        ValueError,
        match=r"try H_kv in 1, 2, 3, 6\. Received: query heads H=6, key/value heads H_kv=4",
    ):
        mh.attention(q, k, v)


def test_key_value_and_batch_mismatch():
    q, k, v = qkv(2, 2, 2, 3, 4, 5)
    with pytest.raises(ValueError, match=r"same number of heads H_kv and the same length S"):
        mh.attention(q, k, v[:, :, :3])
    with pytest.raises(ValueError, match=r"same batch size B"):
        mh.attention(q, k[:1], v[:1])


def test_dtype_and_device_mismatch():
    q, k, v = qkv(1, 2, 2, 3, 4, 5)
    with pytest.raises(TypeError, match=r"share one dtype.*key.dtype=torch.float32"):
        mh.attention(q, k.float(), v)
    with pytest.raises(TypeError, match=r"query must be a floating-point tensor.*torch.int64"):
        mh.attention(q.long(), k.long(), v.long())
    with pytest.raises(ValueError, match=r"one device.*key.device=meta"):
        mh.attention(q, k.to("meta"), v)


def test_int_and_float_masks_are_rejected():
    q, k, v = qkv(1, 2, 2, 3, 4, 5)
    with pytest.raises(
        TypeError, match=r"float tensor is an additive bias: pass it as bias=.*torch.float32"
    ):
        mh.attention(q, k, v, torch.zeros(3, 4))
    with pytest.raises(
        TypeError, match=r"1 = attend integer mask use multihead.masks.from_keras.*torch.int64"
    ):
        mh.attention(q, k, v, torch.ones(3, 4, dtype=torch.long))
    with pytest.raises(TypeError, match=r"mask must be a multihead.masks.Mask.*list"):
        mh.attention(q, k, v, [[True]])
    with pytest.raises(TypeError, match=r"keep must be a bool tensor.*torch.int64"):
        masks.key_padding(torch.ones(1, 4, dtype=torch.long))


def test_padding_mask_passed_as_2d_mask_is_caught():
    # (B, S) = (2, 4) where (L, S) = (3, 4) was expected
    q, k, v = qkv(2, 2, 2, 3, 4, 5)
    with pytest.raises(
        ValueError,
        match=r"exactly \(L, S\)=\(3, 4\)\. A \(B, S\) tensor marks keys per batch entry: use masks.key_padding\(keep\)",
    ):
        mh.attention(q, k, v, torch.ones(2, 4, dtype=torch.bool))


def test_masks_that_do_not_fit():
    q, k, v = qkv(2, 2, 2, 3, 4, 5)
    with pytest.raises(
        ValueError, match=r"broadcast to \(B, H, L, S\)=\(2, 2, 3, 4\).*\(2, 3, 3, 4\)"
    ):
        mh.attention(q, k, v, torch.ones(2, 3, 3, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"key_padding\(keep\) must have shape \(B, S\)=\(2, 4\)"):
        mh.attention(q, k, v, masks.key_padding(torch.ones(2, 5, dtype=torch.bool)))
    with pytest.raises(ValueError, match=r"key_ids must have length S=4; pass key_ids="):
        mh.attention(q, k, v, masks.documents(torch.zeros(3, dtype=torch.long)))
    with pytest.raises(ValueError, match=r"batch size 3 but the inputs have B=2"):
        mh.attention(
            q,
            k,
            v,
            masks.documents(torch.zeros(3, 3, dtype=torch.long), torch.zeros(4, dtype=torch.long)),
        )


def test_valid_lens_out_of_range_or_wrong_length():
    q, k, v = qkv(2, 2, 2, 3, 4, 5)
    with pytest.raises(
        ValueError,
        match=r"valid_lens must be in \[0, S\] with S=4 keys. Received: valid_lens min=0, max=5",
    ):
        mh.attention(q, k, v, masks.lengths(torch.tensor([0, 5])))
    with pytest.raises(ValueError, match=r"valid_lens must be in \[0, S\].*min=-1"):
        mh.attention(q, k, v, masks.lengths(torch.tensor([-1, 2])))
    with pytest.raises(
        ValueError, match=r"one entry per batch element, B=2. Received: valid_lens.shape=\(3,\)"
    ):
        mh.attention(q, k, v, masks.lengths(torch.tensor([1, 2, 3])))
    with pytest.raises(ValueError, match=r"query_lens must be in \[0, L\] with L=3 queries"):
        mh.attention(q, k, v, masks.lengths(torch.tensor([1, 2]), query_lens=torch.tensor([4, 0])))
    with pytest.raises(ValueError, match=r"query_lens must have one entry per batch element"):
        masks.lengths(torch.tensor([1, 2]), query_lens=torch.tensor([1]))
    with pytest.raises(ValueError, match=r"per-query valid_lens must have shape \(B, L\)=\(2, 3\)"):
        mh.attention(q, k, v, masks.lengths(torch.ones(2, 4, dtype=torch.long)))


def test_dropout_scale_and_bias_errors():
    q, k, v = qkv(1, 2, 2, 3, 4, 5)
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\).*dropout_p=-0.1"):
        mh.attention(q, k, v, dropout_p=-0.1)
    with pytest.raises(
        ValueError, match=r"scale must be a positive finite float. Received: scale=0"
    ):
        mh.attention(q, k, v, scale=0)
    with pytest.raises(TypeError, match=r"bias must be a floating-point tensor.*torch.bool"):
        mh.attention(q, k, v, bias=torch.ones(3, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"bias does not fit \(L, S\)=\(3, 4\)"):
        mh.attention(q, k, v, bias=torch.ones(1, 4, dtype=torch.float64))
    with pytest.raises(
        ValueError, match=r"bias must be finite: express blocked positions with mask="
    ):
        mh.attention(q, k, v, bias=torch.full((3, 4), -torch.inf, dtype=torch.float64))


def test_weights_with_a_backend_that_cannot():
    q, k, v = qkv(1, 2, 2, 3, 4, 5)
    with pytest.raises(
        ValueError,
        match=r"backend 'sdpa' cannot run this call: .*does not return attention weights.*backend='reference'",
    ):
        mh.attention_with_weights(q, k, v, backend="sdpa")
    with pytest.raises(
        ValueError,
        match=r"backend must be 'auto' or one of \['flex', 'fused', 'half', 'reference', 'sdpa', 'tiled'\] \(more can be added with multihead.backends.register\). Received: backend='flash'",
    ):
        mh.attention(q, k, v, backend="flash")
