"""Backend choice: auto never picks a backend that cannot honour the call, and says why."""

from __future__ import annotations

import torch
from helpers import qkv

import multihead as mh
from multihead import masks
from multihead.backends import registry


def test_auto_prefers_sdpa_and_explains_the_reference():
    q, k, v = qkv(1, 2, 2, 3, 4, 5)
    choice = mh.explain_backend(q, k, v, masks.causal())
    assert choice.backend == "sdpa"
    assert choice.reasons == {
        "reference": "supported, but sdpa is expected to be faster for this call"
    }
    assert str(choice).splitlines()[0] == "chosen: sdpa"


def test_auto_falls_back_when_weights_are_requested():
    q, k, v = qkv(1, 2, 2, 3, 4, 5)
    choice = mh.explain_backend(q, k, v, return_weights=True)
    assert choice.backend == "reference"
    assert "does not return attention weights" in choice.reasons["sdpa"]


def test_auto_never_picks_an_unsupported_backend():
    q, k, v = qkv(1, 2, 2, 3, 4, 5)
    for return_weights in (False, True):
        choice = mh.explain_backend(q, k, v, return_weights=return_weights)
        assert (
            registry.BACKENDS[choice.backend].unsupported(
                registry.Call(q, k, v, None, None, 1.0, 0.0, return_weights)
            )
            is None
        )


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
