"""The usages a person migrating from torch.nn.MultiheadAttention, SDPA or Keras tries first."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

import multihead as mh
from multihead import MultiHeadAttention, masks


def _pair(e=8, h=2):
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(e, h, batch_first=True)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.3)
    return ref.eval(), MultiHeadAttention.from_torch(ref).eval()


@pytest.mark.parametrize("form", ["bool", "float"])
def test_from_torch_result_is_accepted_as_the_mask(form):
    ref, ours = _pair()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 8, generator=g)
    blocked = torch.zeros(5, 5, dtype=torch.bool)
    blocked[0, 3] = blocked[2, 1] = True
    padding = torch.tensor([[False] * 5, [False, False, False, True, True]])
    if form == "bool":
        am, kpm = blocked, padding
    else:
        am = torch.randn(5, 5, generator=g).masked_fill(blocked, -torch.inf)
        kpm = torch.zeros(2, 5).masked_fill(padding, -torch.inf)
        kpm[0, 1] = 0.8  # a finite additive term that must reach the scores
    want, want_w = ref(x, x, x, attn_mask=am, key_padding_mask=kpm, average_attn_weights=False)
    got, got_w = ours.run(x, mask=masks.from_torch(attn_mask=am, key_padding_mask=kpm))
    # float32 parity with torch's own kernel, as in test_attention.py
    assert (got - want).abs().max() <= 1e-5
    assert (got_w - want_w).abs().max() <= 1e-5


def test_from_torch_result_adds_to_an_explicit_bias():
    q, k, v = (torch.randn(1, 2, 3, 4, dtype=torch.float64) for _ in range(3))
    am = torch.tensor([[0.5, 0.0, -1.0]] * 3, dtype=torch.float64)
    extra = torch.randn(3, 3, dtype=torch.float64)
    got = mh.attention(q, k, v, masks.from_torch(attn_mask=am), bias=extra)
    want = mh.attention(q, k, v, bias=am + extra, backend="reference")
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_from_torch_is_keyword_only():
    kpm = torch.zeros(2, 5, dtype=torch.bool)
    with pytest.raises(TypeError, match=r"keyword arguments only.*Received: 1 positional"):
        masks.from_torch(kpm)


def test_from_keras_takes_a_padding_mask():
    pad = torch.tensor([[1, 1, 0], [1, 0, 0]])
    q, k, v = (torch.randn(2, 1, 4, 5, dtype=torch.float64) for _ in range(3))
    k, v = k[:, :, :3], v[:, :, :3]
    got = mh.attention(q, k, v, masks.from_keras(pad))
    want = mh.attention(q, k, v, masks.key_padding(pad.bool()))
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def _public_signatures():
    from multihead.models.bert import Bert
    from multihead.models.causal_lm import CausalLM
    from multihead.parallel import context_attention

    return [
        mh.attention,
        mh.attention_with_weights,
        mh.explain_backend,
        MultiHeadAttention.__init__,
        MultiHeadAttention.forward,
        MultiHeadAttention.run,
        mh.TransformerEncoderLayer.forward,
        mh.TransformerEncoder.forward,
        mh.TransformerDecoderLayer.forward,
        mh.TransformerDecoder.forward,
        Bert.forward,
        CausalLM.run,
        context_attention,
    ]


@pytest.mark.parametrize("fn", _public_signatures(), ids=lambda f: f.__qualname__)
def test_public_signatures_are_honest(fn):
    """No catch-all: what a function takes is what its signature says (editors and type
    checkers read it), and a keyword it does not take is Python's own TypeError."""
    kinds = [p.kind for p in inspect.signature(fn).parameters.values()]
    assert inspect.Parameter.VAR_KEYWORD not in kinds


def test_a_keyword_removed_before_the_release_is_an_ordinary_type_error():
    q = k = v = torch.randn(1, 1, 2, 4)
    with pytest.raises(TypeError, match=r"^attention\(\) got an unexpected keyword argument"):
        mh.attention(q, k, v, return_weights=True)
    with pytest.raises(TypeError, match=r"forward\(\) got an unexpected keyword argument"):
        MultiHeadAttention(4, 1)(torch.randn(1, 2, 4), return_weights=True)


@pytest.mark.parametrize(
    "keyword,hint",
    [
        ("attn_mask", r"mask=masks.from_torch\(attn_mask=...\)"),
        ("key_padding_mask", r"masks.key_padding\(keep\)"),
        ("need_weights", r"attention_with_weights\(\.\.\.\) or module.run\(\.\.\.\)"),
        ("is_causal", r"masks.causal\(align='top_left'\)"),
    ],
)
def test_torch_keywords_in_forward_point_to_the_equivalent(keyword, hint):
    mha = MultiHeadAttention(4, 2)
    with pytest.raises(TypeError, match=rf"does not take torch's.*{hint}"):
        mha(torch.randn(1, 2, 4), **{keyword: torch.zeros(2, 2, dtype=torch.bool)})


def test_batch_first_in_the_constructor_explains_the_convention():
    with pytest.raises(TypeError, match=r"always batch-first.*Received: batch_first=False"):
        MultiHeadAttention(4, 2, batch_first=False)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'nheads'"):
        MultiHeadAttention(4, 2, nheads=2)


def test_inputs_of_another_dtype_say_what_to_cast():
    mha = MultiHeadAttention(4, 2)
    with pytest.raises(TypeError, match=r"parameters, torch.float32.*Received: query.dtype"):
        mha(torch.randn(1, 2, 4, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"token ids go through an nn.Embedding.*torch.int64"):
        mha(torch.ones(1, 2, 4, dtype=torch.int64))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast casts inside the linears
        assert mha(torch.randn(1, 2, 4, dtype=torch.bfloat16)).shape == (1, 2, 4)


def test_keras_style_call_attends_to_the_value():
    # Keras: mha(query=q, value=context) uses the value as the key too
    torch.manual_seed(0)
    mha = MultiHeadAttention(4, 2).eval()
    q, context = torch.randn(1, 2, 4), torch.randn(1, 3, 4)
    torch.testing.assert_close(mha(query=q, value=context), mha(q, context, context))
    assert mha(query=q, value=context).shape == (1, 2, 4)


@pytest.mark.parametrize(
    "keyword,hint",
    [
        ("attn_mask", r"scaled_dot_product_attention bool mask \(True = may attend, as here\)"),
        ("is_causal", r"top-left aligned; masks.causal\(\) is bottom-right"),
        ("enable_gqa", r"follows from key.shape\[1\]"),
    ],
)
def test_sdpa_keywords_in_attention_point_to_the_equivalent(keyword, hint):
    q = k = v = torch.randn(1, 1, 2, 4)
    with pytest.raises(
        TypeError, match=rf"attention\(\) does not take torch's '{keyword}'.*{hint}"
    ):
        mh.attention(q, k, v, **{keyword: True})
    with pytest.raises(
        TypeError, match=r"explain_backend\(\) got an unexpected keyword argument .mask_mod."
    ):
        mh.explain_backend(q, k, v, mask_mod=None)
