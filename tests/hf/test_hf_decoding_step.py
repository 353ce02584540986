"""``multihead.hf.decoding_step``: a transformers Llama model's decoding steps in one C++ call
over its own weights and its own DynamicCache. Greedy tokens equal sdpa's, each step's logits
equal the model's own forward within float32 rounding, and every call it does not cover runs
the model's forward unchanged."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from hf_archs import BY_NAME, VOCAB

import multihead.hf as mhf
from multihead.modules import few_rows

pytestmark = pytest.mark.skipif(
    few_rows.kernel_error() is not None, reason=f"no few-row kernel: {few_rows.kernel_error()}"
)


def _llama(impl: str = "sdpa") -> tf.PreTrainedModel:
    config = BY_NAME["llama"].make()  # a new config for each model
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config, attn_implementation=impl).eval()


def _counting(monkeypatch) -> list:
    kernel = few_rows._LOADER.module or few_rows._LOADER.load()
    calls: list = []
    real = kernel.decoder_step
    monkeypatch.setattr(kernel, "decoder_step", lambda *a: calls.append(1) or real(*a))
    return calls


def _generate(model, ids, new=10, **kw):
    with torch.inference_mode():
        return model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
            do_sample=False, **kw,
        )  # fmt: skip


def test_greedy_tokens_equal_sdpa_and_every_step_is_one_call(monkeypatch):
    reference = _llama()
    model = mhf.decoding_step(_llama("multihead"))
    assert mhf.decoding_step(model) is model  # again: nothing changes
    calls = _counting(monkeypatch)
    ids = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    # 70 new tokens: the cache's buffer (64 slots at first) grows once on the way
    got = _generate(model, ids, 70)
    assert len(calls) == 69  # every step after the prompt
    assert torch.equal(got, _generate(reference, ids, 70))


def test_each_steps_logits_equal_the_models_own_forward(monkeypatch):
    """Teacher-forced steps over one DynamicCache: the C++ step's logits against the same
    model's forward with the step switched off, within float32 rounding (logits of order 1:
    the norms, softmax and activations sum in another order)."""
    model = mhf.decoding_step(_llama("multihead"))
    ids = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(2))
    logits = {}
    for native in (True, False):
        monkeypatch.setattr(mhf.decoding_step.__globals__["native_step"], "enabled", native)
        cache = tf.DynamicCache(config=model.config)
        steps = []
        with torch.inference_mode():
            model(ids[:, :5], past_key_values=cache, use_cache=True)
            for i in range(5, 12):
                out = model(ids[:, i : i + 1], past_key_values=cache, use_cache=True)
                steps.append(out.logits)
        logits[native] = torch.cat(steps, 1)
    want = logits[False]
    assert (logits[True] - want).abs().max() <= 1e-5 * max(1.0, want.abs().max().item())


def test_what_it_does_not_cover_runs_the_models_forward(monkeypatch):
    model = mhf.decoding_step(_llama("multihead"))
    calls = _counting(monkeypatch)
    ids = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # a left-padded row: rows of two lengths
    with torch.inference_mode():
        model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
        model.generate(ids[:1], max_new_tokens=3, do_sample=False, output_hidden_states=True,
                       return_dict_in_generate=True)  # fmt: skip
    assert calls == []
    handle = model.model.layers[1].mlp.register_forward_hook(lambda *a: None)
    _generate(model, ids[:1], 3)
    handle.remove()
    assert calls == []
    _generate(model, ids[:1], 3)
    assert len(calls) == 2  # the hook gone, the steps are native again


def test_only_llama_models_are_taken():
    config = BY_NAME["mistral"].make()
    mistral = tf.AutoModelForCausalLM.from_config(config)
    with pytest.raises(TypeError, match=r"takes a transformers LlamaForCausalLM.*Mistral"):
        mhf.decoding_step(mistral)
