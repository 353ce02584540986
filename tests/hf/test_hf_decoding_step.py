"""``multihead.hf.fast_decoding`` on a transformers Llama model: its decoding steps in one C++
call (the native step) over its own weights and its own DynamicCache. Greedy tokens equal
sdpa's, each step's logits equal the model's own forward within float32 rounding, and every
call it does not cover runs the model's forward unchanged. Other architectures take the
few-row linears; the two entries it replaces warn and keep working."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import transformers as tf
from hf_archs import BY_NAME, VOCAB

import multihead.hf as mhf
from multihead._deprecation import MultiheadDeprecationWarning
from multihead.hf import decoding as adapter
from multihead.modules import decoding_native as native_step
from multihead.modules import few_rows
from multihead.modules.few_rows import RowsLinear

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
    real = kernel.native_step
    monkeypatch.setattr(kernel, "native_step", lambda *a: calls.append(1) or real(*a))
    return calls


def _generate(model, ids, new=10, **kw):
    with torch.inference_mode():
        return model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
            do_sample=False, **kw,
        )  # fmt: skip


def test_greedy_tokens_equal_sdpa_and_every_step_is_one_call(monkeypatch):
    reference = _llama()
    model = mhf.fast_decoding(_llama("multihead"))
    assert mhf.fast_decoding(model) is model  # again: nothing changes
    assert mhf.decoding_path(model) == adapter.NATIVE == "native step"
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
    model = mhf.fast_decoding(_llama("multihead"))
    ids = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(2))
    logits = {}
    for native in (True, False):
        monkeypatch.setattr(native_step, "enabled", native)
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
    model = mhf.fast_decoding(_llama("multihead"))
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


def test_other_architectures_take_the_few_row_linears(monkeypatch):
    config = BY_NAME["mistral"].make()
    torch.manual_seed(0)
    mistral = tf.AutoModelForCausalLM.from_config(config, attn_implementation="multihead").eval()
    calls = _counting(monkeypatch)
    assert mhf.fast_decoding(mistral) is mistral
    assert mhf.decoding_path(mistral) == adapter.LINEARS == "few-row linears"
    assert type(mistral.lm_head) is RowsLinear
    _generate(mistral, torch.randint(3, VOCAB, (1, 5)), 3)
    assert calls == []  # no native step: it covers LlamaForCausalLM only


def test_the_old_entries_warn_and_keep_their_behaviour():
    """``decoding_step`` and ``decoding_linears`` are kept for a release: each call warns with
    MultiheadDeprecationWarning (a DeprecationWarning and a FutureWarning) naming the new
    entry, and does what it did."""
    assert issubclass(MultiheadDeprecationWarning, DeprecationWarning)
    assert issubclass(MultiheadDeprecationWarning, FutureWarning)
    new = r"deprecated .*use multihead\.hf\.fast_decoding instead"
    with pytest.warns(MultiheadDeprecationWarning, match="decoding_step is " + new):
        llama = mhf.decoding_step(_llama("multihead"))
    assert mhf.decoding_path(llama) == adapter.NATIVE
    mistral = tf.AutoModelForCausalLM.from_config(BY_NAME["mistral"].make())
    with (
        pytest.warns(MultiheadDeprecationWarning, match="decoding_step is " + new),
        pytest.raises(TypeError, match=r"takes a transformers LlamaForCausalLM.*Mistral"),
    ):
        mhf.decoding_step(mistral)
    with pytest.warns(MultiheadDeprecationWarning, match="decoding_linears is " + new):
        assert mhf.decoding_linears(mistral) is mistral
    assert mhf.decoding_path(mistral) == adapter.LINEARS


def test_a_missing_kernel_is_said_once_and_a_llama_decodes_as_before(monkeypatch):
    monkeypatch.setattr(few_rows, "kernel_error", lambda: "no C++ compiler found")
    monkeypatch.setattr(adapter, "_warned", [])
    with pytest.warns(RuntimeWarning, match=r"no C\+\+ compiler found.*as it did"):
        model = mhf.fast_decoding(_llama("multihead"))
    assert mhf.decoding_path(model) is None and not model.model.__dict__.get(adapter._FLAG)
    ids = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(5))
    assert torch.equal(_generate(model, ids, 4), _generate(_llama(), ids, 4))


def test_a_script_calling_an_old_entry_sees_the_warning(tmp_path):
    """Python hides DeprecationWarning outside __main__; the warning points at the caller's
    line, so a script that calls an old entry shows it with no flag given."""
    script = tmp_path / "old.py"
    script.write_text(
        "import torch\n"
        "import multihead.hf as mhf\n"
        "mhf.decoding_linears(torch.nn.Sequential(torch.nn.Linear(4, 4)))\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, check=True)  # fmt: skip
    assert "old.py:3: MultiheadDeprecationWarning: multihead.hf.decoding_linears" in done.stderr
