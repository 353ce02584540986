"""Backend choice: auto never picks a backend that cannot honour the call, and says why."""

from __future__ import annotations

import pytest
import torch
from helpers import MASK_KINDS, make_case, qkv

import multihead as mh
from multihead import masks
from multihead.backends import registry
from multihead.functional import _prepare


@pytest.mark.parametrize(
    "mask,expected",
    [
        (None, "sdpa"),
        (masks.causal(), "sdpa"),  # L == S: torch's is_causal is exact
        (masks.sliding_window(2), "tiled"),
        (masks.lengths(torch.tensor([3, 1])), "tiled"),
        (masks.dense(torch.ones(4, 4, dtype=torch.bool)), "sdpa"),
    ],
    ids=["none", "causal", "window", "lengths", "dense"],
)
def test_auto_choice_and_reasons(mask, expected):
    q, k, v = qkv(2, 2, 2, 4, 4, 5)
    choice = mh.explain_backend(q, k, v, mask)
    assert choice.backend == expected
    assert set(choice.reasons) == {"tiled", "sdpa", "reference", "flex", "fused"} - {expected}
    assert all(
        r.startswith(f"supported, but {expected} is expected to be faster: ")
        for name, r in choice.reasons.items()
        if name != "flex"  # float64 inputs: flex says why it cannot run them on CPU
    )
    assert str(choice).splitlines()[0] == f"chosen: {expected}"


def test_bottom_right_causal_with_fewer_queries_goes_to_tiled():
    q, k, v = qkv(1, 2, 2, 3, 8, 5)
    assert mh.explain_backend(q, k, v, masks.causal()).backend == "tiled"
    assert mh.explain_backend(q, k, v, masks.causal(align="top_left")).backend == "sdpa"


def test_auto_with_weights_uses_tiled_and_says_why_not_sdpa():
    q, k, v = qkv(1, 2, 2, 3, 4, 5)
    choice = mh.explain_backend(q, k, v, return_weights=True)
    assert choice.backend == "tiled"
    assert "does not return attention weights" in choice.reasons["sdpa"]


@pytest.mark.parametrize("return_weights", [False, True])
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_auto_never_picks_an_unsupported_backend(kind, return_weights):
    q, k, v = qkv(2, 2, 2, 5, 6, 3)
    mask = make_case(kind, 2, 2, 5, 6).mask
    for bias in (None, torch.zeros(5, 6, dtype=torch.float64, requires_grad=True)):
        call = _prepare(q, k, v, mask, bias, None, 0.0, return_weights)
        chosen = registry.explain(call).backend
        assert registry.BACKENDS[chosen].unsupported(call) is None


def test_sdpa_uses_is_causal_only_when_equivalent(monkeypatch):
    seen = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append((bool(kwargs.get("is_causal")), kwargs.get("attn_mask") is None))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    q, k, v = qkv(1, 2, 2, 4, 4, 5)
    mh.attention(q, k, v, masks.causal(), backend="sdpa")
    mh.attention(q[:, :, :2], k, v, masks.causal(align="top_left"), backend="sdpa")
    mh.attention(q[:, :, :2], k, v, masks.causal(), backend="sdpa")  # bottom-right, L != S
    assert seen == [(True, True), (True, True), (False, False)]


def test_auto_picks_the_branch_free_reference_while_exporting(monkeypatch):
    q, k, v = qkv(1, 2, 2, 4, 4, 5)
    monkeypatch.setattr(torch.compiler, "is_exporting", lambda: True)
    choice = mh.explain_backend(q, k, v, masks.sliding_window(2))
    assert choice.backend == "reference"
    assert "exported graph" in choice.reasons["tiled"]


def test_reference_exports_with_a_dense_mask():
    class Attend(torch.nn.Module):
        def forward(self, q, k, v, keep):
            return mh.attention(q, k, v, masks.dense(keep[:, None, None, :]))

    q, k, v = qkv(2, 2, 2, 5, 5, 4)
    keep = torch.tensor([[True] * 5, [True, True, True, False, False]])
    program = torch.export.export(Attend(), (q, k, v, keep))
    torch.testing.assert_close(program.module()(q, k, v, keep), Attend()(q, k, v, keep))


def test_export_puts_no_bound_on_the_length():
    from torch.utils._sympy.numbers import int_oo

    """While exporting, auto never asks flex's CPU threshold (L >= 4096): on a symbolic L
    that comparison would cap the exported length axis below 4096."""

    class Attend(torch.nn.Module):
        def forward(self, q, k, v, keep):
            return mh.attention(q, k, v, masks.causal() & masks.dense(keep[:, None, None, :]))

    q, k, v = qkv(2, 2, 2, 5, 5, 4, dtype=torch.float32)  # flex's CPU rule is float32 only
    keep = torch.tensor([[True] * 5, [False, False, True, True, True]])
    length = torch.export.Dim("length", min=2)  # no max
    shapes = ({2: length}, {2: length}, {2: length}, {1: length})
    program = torch.export.export(Attend(), (q, k, v, keep), dynamic_shapes=shapes)
    assert [r.upper for r in program.range_constraints.values()] == [int_oo]
    q, k, v = qkv(2, 2, 2, 3, 3, 4, dtype=torch.float32)
    keep = keep[:, 2:]
    torch.testing.assert_close(program.module()(q, k, v, keep), Attend()(q, k, v, keep))
