"""Cropped masks and biases, and the tiled kernel's log-sum-exp entry points: attention over key
shards merged through the log-sum-exp equals attention over the whole (what a ring of processes
does in context parallelism)."""

from __future__ import annotations

import itertools

import pytest
import torch
from helpers import MASK_KINDS, make_case, qkv

import multihead as mh
from multihead import bias as mb
from multihead.backends import tiled
from multihead.backends.call import prepare


def _merge(parts):
    """Exact merge of (out, lse) pairs over disjoint key sets."""
    lse = torch.logsumexp(torch.stack([p[1] for p in parts]), dim=0)
    safe = torch.where(torch.isfinite(lse), lse, 0.0)
    out = sum(o * torch.exp(part_lse - safe)[..., None] for o, part_lse in parts)
    return out, lse


@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("with_bias", [False, True], ids=["plain", "alibi+t5"])
def test_key_shards_merge_to_the_whole(kind, with_bias):
    b, h, h_kv, length, d = 2, 4, 2, 30, 5
    q, k, v = qkv(b, h, h_kv, length, length, d, seed=1)
    case = make_case(kind, b, h, length, length, seed=1)
    table = torch.randn(8, h, dtype=torch.float64, requires_grad=True)
    bias = mb.alibi(h) + mb.relative_buckets(table, max_distance=9) if with_bias else None
    cuts = [0, 7, 19, 30]
    grad_out = torch.randn(b, h, length, d, dtype=torch.float64)
    # the whole, with autograd
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    want = mh.attention(qg, kg, vg, case.mask, bias=bias)
    grads = torch.autograd.grad(want, (qg, kg, vg, table), grad_out, allow_unused=True)
    # shards of queries against shards of keys
    for r0, r1 in itertools.pairwise(cuts):
        calls = []
        for c0, c1 in itertools.pairwise(cuts):
            mask = None if case.mask is None else case.mask.crop(length, length, r0, r1, c0, c1)
            crop = None if bias is None else bias.crop(length, length, r0, r1, c0, c1)
            calls.append(
                (
                    c0,
                    c1,
                    prepare(
                        q[:, :, r0:r1], k[:, :, c0:c1], v[:, :, c0:c1], mask, crop, None, 0.0, False
                    ),
                )
            )
        out, lse = _merge([tiled.forward_with_lse(call) for _, _, call in calls])
        torch.testing.assert_close(out, want[:, :, r0:r1].detach(), rtol=0, atol=1e-12)
        dq = 0
        for c0, c1, call in calls:
            a, dk, dv, d_bias = tiled.backward_with_lse(call, grad_out[:, :, r0:r1], out, lse)
            dq = dq + a
            grads_k = grads[1][:, :, c0:c1]
            assert dk.shape == grads_k.shape
        torch.testing.assert_close(dq, grads[0][:, :, r0:r1], rtol=0, atol=1e-12)
    # key gradients: sum over query shards
    dk_total = torch.zeros_like(k)
    dv_total = torch.zeros_like(v)
    d_table = torch.zeros_like(table)
    for r0, r1 in itertools.pairwise(cuts):
        parts, calls = [], []
        for c0, c1 in itertools.pairwise(cuts):
            mask = None if case.mask is None else case.mask.crop(length, length, r0, r1, c0, c1)
            crop = None if bias is None else bias.crop(length, length, r0, r1, c0, c1)
            call = prepare(
                q[:, :, r0:r1], k[:, :, c0:c1], v[:, :, c0:c1], mask, crop, None, 0.0, False
            )
            calls.append((c0, c1, call))
            parts.append(tiled.forward_with_lse(call))
        out, lse = _merge(parts)
        for c0, c1, call in calls:
            _, dk, dv, d_bias = tiled.backward_with_lse(call, grad_out[:, :, r0:r1], out, lse)
            dk_total[:, :, c0:c1] += dk
            dv_total[:, :, c0:c1] += dv
            if with_bias:
                d_table += d_bias[1]
    torch.testing.assert_close(dk_total, grads[1], rtol=0, atol=1e-12)
    torch.testing.assert_close(dv_total, grads[2], rtol=0, atol=1e-12)
    if with_bias:
        torch.testing.assert_close(d_table, grads[3], rtol=0, atol=1e-12)


@pytest.mark.parametrize("kind", MASK_KINDS)
def test_a_cropped_mask_is_the_block_of_the_whole(kind):
    case = make_case(kind, 2, 3, 17, 21, seed=2)
    if case.mask is None:
        return
    crop = case.mask.crop(17, 21, 4, 13, 6, 20)
    crop.check(2, 3, 9, 14)
    keep = case.keep.expand(2, 3, 17, 21)[:, :, 4:13, 6:20]
    assert torch.equal(crop.to_dense(9, 14).expand(2, 3, 9, 14), keep)
    b, h, i, j = torch.meshgrid(
        torch.arange(2), torch.arange(3), torch.arange(9), torch.arange(14), indexing="ij"
    )
    assert torch.equal(crop.mask_mod(9, 14)(b, h, i, j), keep)
    for q0 in range(9):
        for bi in range(2):
            t = crop.tile(9, 14, q0, q0 + 1, batch=bi)
            visible = torch.nonzero(keep[bi, :, q0].any(0)).flatten()
            if visible.numel():
                assert t.start <= int(visible[0]) and int(visible[-1]) < t.stop


def test_crop_errors():
    m = mh.masks.causal().crop(10, 10, 0, 5, 0, 10)
    with pytest.raises(ValueError, match=r"this cropped mask is for \(L, S\)=\(5, 10\)"):
        m.check(1, 1, 4, 10)
    with pytest.raises(ValueError, match=r"a crop must lie inside"):
        mh.masks.causal().crop(10, 10, 0, 11, 0, 10)
    with pytest.raises(ValueError, match=r"forward_with_lse computes no dropout"):
        q = torch.randn(1, 1, 2, 2)
        tiled.forward_with_lse(prepare(q, q, q, None, None, None, 0.5, False))
