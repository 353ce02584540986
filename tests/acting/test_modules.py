"""``MultiHeadAttention`` as a reader of plans (``multihead.acting.run_plan``): a bare module
and a stack are models whose layers are their ``MultiHeadAttention`` modules; every block
against the same call written out by hand (``run`` weights, the head's output scaled or
replaced, the mask joined); a BERT encoder (``models.bert.load``) against transformers'
``BertModel`` on the same weights."""

from __future__ import annotations

import pytest
import torch

import multihead as mh
import multihead.hf as mhf
from multihead import acting, masks
from multihead.modules import (
    MultiHeadAttention,
    TransformerEncoder,
    TransformerEncoderLayer,
    merge_heads,
    split_heads,
)

B, L, E, H = 2, 7, 24, 4


@pytest.fixture
def module():
    torch.manual_seed(0)
    return MultiHeadAttention(E, H, num_kv_heads=2).eval()


def _x(seed: int = 1) -> torch.Tensor:
    return torch.randn(B, L, E, generator=torch.Generator().manual_seed(seed))


def _by_hand(m, x, weights):
    """The module's output from given weights (B, H, L, L): weights @ V, merged, projected."""
    v = split_heads(m.v_proj(x), m.num_kv_heads).repeat_interleave(H // m.num_kv_heads, 1)
    return m.out_proj(merge_heads(weights @ v))


def test_a_capture_records_what_run_returns(module):
    x = _x()
    with torch.no_grad():
        want = module.run(x).weights
        with acting.capture(module, heads=[2, 0]) as cap:
            out = module(x)
        assert torch.equal(out, module(x))
        with acting.capture(module, heads=[3]) as both:
            ran = module.run(x, heads=[1, 2])  # the caller's heads and the capture's apart
    torch.testing.assert_close(cap.weights[0], want[:, [2, 0]], atol=1e-6, rtol=0)
    torch.testing.assert_close(ran.weights, want[:, [1, 2]], atol=1e-6, rtol=0)
    torch.testing.assert_close(both.weights[0], want[:, [3]], atol=1e-6, rtol=0)


def test_ablate_scales_the_heads_output_before_the_projection(module):
    x = _x()
    with torch.no_grad():
        weights = module.run(x).weights
        scale = torch.tensor([1.0, 0.0, 0.5, 1.0])
        want = _by_hand(module, x, weights * scale[None, :, None, None])
        with acting.ablate(module, {0: [1]}), acting.ablate(module, {0: [2]}, scale=0.5):
            got = module(x)
            ran = module.run(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(ran.output, got, atol=1e-6, rtol=0)  # another kernel
    torch.testing.assert_close(ran.weights, weights, atol=0, rtol=0)  # weights untouched


@pytest.mark.parametrize("given", ["none", "mask", "bool tensor", "from_torch"])
def test_knockout_joins_every_form_of_mask(module, given):
    x = _x()
    padding = torch.ones(B, L, dtype=torch.bool)
    padding[1, 5:] = False
    mask = {
        "none": None,
        "mask": masks.key_padding(padding),
        "bool tensor": padding[:, None, None, :],
        "from_torch": masks.from_torch(key_padding_mask=~padding),
    }[given]
    keep = padding[:, None, None, :] if given != "none" else torch.ones(1, 1, 1, L, dtype=bool)
    cut = torch.ones(1, H, L, L, dtype=torch.bool)
    cut[:, [0, 3], 4:6, 1:3] = False
    with torch.no_grad():
        want = module(x, mask=masks.dense(keep & cut))
        with acting.knockout(module, queries=[4, 5], keys=[1, 2], heads=[0, 3]):
            got = module(x, mask=mask)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    assert (got - module(x, mask=mask)).abs().max() > 1e-3


def test_patch_puts_the_captured_weights_in_place(module):
    clean, other = _x(1), _x(2)
    with torch.no_grad():
        with acting.capture(module, heads=[1]) as cap:
            module(clean)
        weights = module.run(other).weights.clone()
        weights[:, 1] = cap.weights[0][:, 0]
        with acting.patch(module, cap):
            got = module(other)
    torch.testing.assert_close(got, _by_hand(module, other, weights), atol=1e-5, rtol=0)


def test_a_stack_counts_its_modules_as_layers():
    torch.manual_seed(3)
    stack = TransformerEncoder([TransformerEncoderLayer(E, H, 32) for _ in range(3)]).eval()
    x = _x()
    with torch.no_grad():
        want = stack.run(x).weights
        with acting.capture(stack, layers=[2, 0], heads=[1]) as cap:
            stack(x)
    assert cap.num_layers == 3 and sorted(cap.weights) == [0, 2]
    for layer in (0, 2):
        torch.testing.assert_close(cap.weights[layer], want[layer][:, [1]], atol=1e-6, rtol=0)


def test_a_patch_of_another_length_names_both_shapes(module):
    with torch.no_grad(), acting.capture(module) as cap:
        module(_x())
    with (
        torch.no_grad(),
        acting.patch(module, cap),
        pytest.raises(ValueError, match=r"Received: captured \(2, 4, 7, 7\), call .*\(2, 5, 5\)"),
    ):
        module(_x()[:, :5])


def test_a_bert_encoder_acts_as_transformers_bert_does(tiny_bert):
    """``models.bert.load`` (a ``Pretrained``, its layers read through its module) and
    transformers' ``BertModel`` on the same weights: the same captured weights and the same
    hidden states under ablate and knockout."""
    transformers = pytest.importorskip("transformers")
    from multihead.models import bert

    ours = bert.load(tiny_bert)
    theirs = transformers.BertModel.from_pretrained(tiny_bert, attn_implementation="eager").eval()
    text = "the animal did not cross the street because it was too tired"
    ids = ours.tokenize([text]).input_ids

    def run(model):
        if model is ours:
            return ours([text])[1].last_hidden_state
        return theirs(input_ids=ids).last_hidden_state

    found = {}
    for model in (ours, theirs):
        with torch.no_grad():
            with acting.capture(model, layers=[1], heads=[3, 0]) as cap:
                run(model)
            with acting.ablate(model, {0: [1], 1: [2]}):
                ablated = run(model)
            with mhf.knockout(model, queries=[3, 4], keys=[1, 2, 5]):
                cut = run(model)
        found[model is ours] = (cap.weights[1], ablated, cut)
    for got, want in zip(found[True], found[False]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    with torch.no_grad():
        assert (found[True][1] - run(ours)).abs().max() > 1e-3


@pytest.mark.parametrize("method", ["forward", "run"])
def test_a_knockout_refuses_a_rolling_cache(module, method):
    """A rolling cache's keys are its ring slots followed by the new tokens: keys=[1] would hide
    a ring slot, not the input's position 1, so the call is refused rather than run."""
    cache = mh.KVCache(1, B, 2, E // H, window=4)
    cache.begin(torch.full((B,), L), L)
    call = module if method == "forward" else module.run
    with (
        torch.no_grad(),
        acting.knockout(module, queries=[4], keys=[1]),
        pytest.raises(ValueError, match=r"knockout names key positions .* rolling KVCache"),
    ):
        call(_x(), cache=cache[0])


def test_a_knockout_over_a_growing_cache_hides_the_named_positions(module):
    """With a growing cache the prompt's keys are its positions: the knockout under the cache
    gives what the same mask gives without one."""
    cut = torch.ones(1, H, L, L, dtype=torch.bool)
    cut[:, :, 4, 1] = False
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    cache = mh.KVCache(1, B, 2, E // H)
    cache.begin(torch.full((B,), L), L)
    with torch.no_grad():
        want = module(_x(), mask=masks.dense(cut & causal))
        with acting.knockout(module, queries=[4], keys=[1]):
            got = module(_x(), cache=cache[0])
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
