"""Properties of attention that must hold for every mask and backend (hypothesis, derandomized)."""

from __future__ import annotations

import torch
from helpers import MASK_KINDS, make_case, qkv
from hypothesis import given, settings
from hypothesis import strategies as st

import multihead as mh
from multihead import MultiHeadAttention, masks, merge_heads, split_heads

PROPS = settings(max_examples=25, deadline=None, derandomize=True)
backends = st.sampled_from(["reference", "sdpa", "tiled", "fused"])
sizes = st.integers(1, 9)
seeds = st.integers(0, 2**16)


@PROPS
@given(
    backend=backends,
    length_q=sizes,
    length_k=sizes,
    seed=seeds,
    kind=st.sampled_from(["none", "lengths", "key_padding", "dense"]),
)
def test_key_value_permutation_invariance(backend, length_q, length_k, seed, kind):
    """Permuting keys and values together (and the mask's key axis) changes nothing."""
    q, k, v = qkv(2, 2, 1, length_q, length_k, 4, seed=seed)
    keep = make_case(kind, 2, 2, length_q, length_k, seed=seed).keep.expand(
        2, 2, length_q, length_k
    )
    perm = torch.randperm(length_k, generator=torch.Generator().manual_seed(seed))
    a = mh.attention(q, k, v, keep, backend=backend)
    b = mh.attention(q, k[:, :, perm], v[:, :, perm], keep[..., perm], backend=backend)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@PROPS
@given(
    backend=backends, length_q=sizes, length_k=sizes, seed=seeds, kind=st.sampled_from(MASK_KINDS)
)
def test_query_permutation_equivariance(backend, length_q, length_k, seed, kind):
    q, k, v = qkv(2, 2, 2, length_q, length_k, 3, seed=seed)
    keep = make_case(kind, 2, 2, length_q, length_k, seed=seed).keep.expand(
        2, 2, length_q, length_k
    )
    perm = torch.randperm(length_q, generator=torch.Generator().manual_seed(seed))
    a = mh.attention(q, k, v, keep, backend=backend)
    b = mh.attention(q[:, :, perm], k, v, keep[:, :, perm], backend=backend)
    torch.testing.assert_close(a[:, :, perm], b, rtol=0, atol=1e-12)


@PROPS
@given(
    backend=backends, length_q=sizes, length_k=sizes, seed=seeds, kind=st.sampled_from(MASK_KINDS)
)
def test_masked_keys_have_no_influence(backend, length_q, length_k, seed, kind):
    """Changing keys/values a query cannot see leaves that query's output unchanged; keys that
    no query sees may even be NaN."""
    b, h = 2, 2
    q, k, v = qkv(b, h, h, length_q, length_k, 3, seed=seed)
    case = make_case(kind, b, h, length_q, length_k, seed=seed)
    keep = case.keep.expand(b, h, length_q, length_k)
    base = mh.attention(q, k, v, case.mask, backend=backend)
    k2, v2 = qkv(b, h, h, length_q, length_k, 3, seed=seed + 1)[1:]
    dead = ~keep.any(dim=2)[..., None]  # [B, H, S, 1]: keys no query sees
    k2 = torch.where(dead, torch.nan, k2)
    v2 = torch.where(dead, torch.nan, v2)
    for qi in range(length_q):
        # a fresh copy where only keys hidden from query qi (in every head) are replaced
        hidden = ~keep[:, :, qi, :, None]  # [B, H, S, 1]
        kk, vv = torch.where(hidden, k2, k), torch.where(hidden, v2, v)
        out = mh.attention(q, kk, vv, case.mask, backend=backend)
        torch.testing.assert_close(out[:, :, qi], base[:, :, qi], rtol=0, atol=1e-12)


@PROPS
@given(
    seed=seeds,
    length=sizes,
    heads=st.sampled_from([1, 2, 4]),
    kind=st.sampled_from(["none", "causal", "lengths", "dense_2d"]),
)
def test_module_equals_single_heads_concatenated(seed, length, heads, kind):
    """H-head attention == H separate single-head attentions, concatenated, then projected."""
    torch.manual_seed(seed)
    e = 4 * heads
    mha = MultiHeadAttention(e, heads).double()
    x = torch.randn(2, length, e, dtype=torch.float64)
    mask = make_case(kind, 2, heads, length, length, seed=seed).mask
    q, k, v = mha.q_proj(x), mha.k_proj(x), mha.v_proj(x)
    parts = []
    for i in range(heads):
        cols = slice(4 * i, 4 * (i + 1))
        one = mh.attention(
            q[None, :, :, cols].transpose(0, 1),
            k[None, :, :, cols].transpose(0, 1),
            v[None, :, :, cols].transpose(0, 1),
            mask,
        )
        parts.append(one[:, 0])  # [B, L, 4]
    want = mha.out_proj(torch.cat(parts, dim=-1))
    torch.testing.assert_close(mha(x, mask=mask), want, rtol=0, atol=1e-12)


@PROPS
@given(backend=backends, length=st.integers(2, 12), cut=st.integers(1, 11), seed=seeds)
def test_causal_prefix_consistency(backend, length, cut, seed):
    """With top-left causal attention, outputs of a prefix do not depend on later tokens."""
    cut = min(cut, length - 1)
    q, k, v = qkv(1, 2, 2, length, length, 3, seed=seed)
    full = mh.attention(q, k, v, masks.causal(), backend=backend)
    prefix = mh.attention(
        q[:, :, :cut], k[:, :, :cut], v[:, :, :cut], masks.causal(), backend=backend
    )
    torch.testing.assert_close(full[:, :, :cut], prefix, rtol=0, atol=1e-12)
    # bottom-right alignment is KV-cache decoding: the last `cut` queries against all keys
    tail = mh.attention(q[:, :, -cut:], k, v, masks.causal(), backend=backend)
    torch.testing.assert_close(full[:, :, -cut:], tail, rtol=0, atol=1e-12)


@PROPS
@given(
    backend=backends, length_q=sizes, length_k=sizes, seed=seeds, kind=st.sampled_from(MASK_KINDS)
)
def test_batch_independence(backend, length_q, length_k, seed, kind):
    q, k, v = qkv(3, 2, 1, length_q, length_k, 3, seed=seed)
    case = make_case(kind, 3, 2, length_q, length_k, seed=seed)
    keep = case.keep.expand(3, 2, length_q, length_k)
    whole = mh.attention(q, k, v, keep, backend=backend)
    for i in range(3):
        one = mh.attention(
            q[i : i + 1], k[i : i + 1], v[i : i + 1], keep[i : i + 1], backend=backend
        )
        torch.testing.assert_close(whole[i : i + 1], one, rtol=0, atol=1e-12)


@PROPS
@given(
    backend=backends, length_q=sizes, length_k=sizes, seed=seeds, kind=st.sampled_from(MASK_KINDS)
)
def test_non_contiguous_inputs_equal_contiguous(backend, length_q, length_k, seed, kind):
    q, k, v = qkv(2, 2, 2, length_q, length_k, 5, seed=seed)
    mask = make_case(kind, 2, 2, length_q, length_k, seed=seed).mask

    def strided(t):  # same values, every second element of a wider buffer
        wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
        wide[..., ::2] = t
        return wide[..., ::2]

    qs, ks, vs = strided(q), strided(k), strided(v)
    assert not (qs.is_contiguous() or ks.is_contiguous() or vs.is_contiguous())
    a = mh.attention(q, k, v, mask, backend=backend)
    b = mh.attention(qs, ks, vs, mask, backend=backend)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@PROPS
@given(seed=seeds, length=sizes, heads=st.sampled_from([1, 2, 3]))
def test_split_and_merge_heads_are_inverse(seed, length, heads):
    x = torch.randn(2, length, 4 * heads, generator=torch.Generator().manual_seed(seed))
    h = split_heads(x, heads)
    assert h.shape == (2, heads, length, 4)
    assert torch.equal(h[:, 1 % heads, :, :], x[:, :, 4 * (1 % heads) : 4 * (1 % heads) + 4])
    assert torch.equal(merge_heads(h), x)
