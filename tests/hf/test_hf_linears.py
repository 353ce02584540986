"""``multihead.hf.fast_decoding`` on a model it takes the few-row linears for (a Qwen2): the
model's float32 linear layers on the few-row kernel, the rest of the model untouched.

The reference is the same model before the change, run by transformers itself. The kernel sums
each product in another order than the BLAS, so logits agree to float32 rounding: within 1e-5
of their largest entry (a 2-layer model of width 64, each logit the end of about ten chained
float32 products of 64-256 terms, whose rounding is a few 1e-7 each).
"""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import transformers as tf

import multihead.hf as mhf
from multihead.modules import few_rows
from multihead.modules.few_rows import RowsLinear

RTOL = 1e-5


def _qwen2(tie: bool = True) -> tf.PreTrainedModel:
    config = tf.Qwen2Config(
        vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        initializer_range=0.2, pad_token_id=0, tie_word_embeddings=tie,
    )  # fmt: skip
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config, attn_implementation="multihead").eval()


@pytest.fixture
def on_kernel(monkeypatch) -> list[tuple[int, int, int]]:
    """The kernel leads every product it may run (the tests do not time it against the BLAS);
    lists (rows, out, in) of each product it ran."""
    ran: list[tuple[int, int, int]] = []
    compiled = few_rows._LOADER.load()
    original = compiled.rows_linear

    def spy(x, weight, scale, bias):  # x (..., K): its leading dimensions are the rows
        ran.append((x.numel() // x.shape[-1], *weight.shape))
        return original(x, weight, scale, bias)

    monkeypatch.setattr(few_rows, "_kernel_faster", lambda x, w, b: True)
    monkeypatch.setattr(compiled, "rows_linear", spy)
    return ran


def test_every_float32_linear_moves_with_its_parameters(on_kernel):
    model = _qwen2()
    before = {name: p for name, p in model.named_parameters()}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    linears = [n for n, m in model.named_modules() if type(m) is torch.nn.Linear]
    assert mhf.fast_decoding(model) is model
    moved = [n for n, m in model.named_modules() if type(m) is RowsLinear]
    assert moved == linears and len(moved) == 2 * 7 + 1  # q, k, v, o, gate, up, down; lm_head
    # the same parameter objects: the state dict, tying and optimizers are unchanged
    assert all(p is before[name] for name, p in model.named_parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert state.keys() == model.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert mhf.fast_decoding(model) is model  # again: nothing left to move, no error


def test_decoding_steps_run_on_the_kernel_with_transformers_results(on_kernel):
    """generate()'s steps (one row per sequence) run their products on the kernel; the
    prompt's forward (many rows) does not. Tokens and every step's logits are those of the
    model before the change, to float32 rounding."""
    want_model = _qwen2()
    model = mhf.fast_decoding(copy.deepcopy(want_model))
    ids = torch.randint(3, 101, (2, 12), generator=torch.Generator().manual_seed(1))
    keep = torch.ones(2, 12, dtype=torch.long)
    keep[1, :4] = 0  # left padding
    args = dict(attention_mask=keep, max_new_tokens=6, do_sample=False, pad_token_id=0,
                output_logits=True, return_dict_in_generate=True)  # fmt: skip
    with torch.inference_mode():
        want = want_model.generate(ids, **args)
        assert on_kernel == []  # the model before the change never reaches the kernel
        got = model.generate(ids, **args)
    assert torch.equal(got.sequences, want.sequences)
    for g, w in zip(got.logits, want.logits, strict=True):
        assert (g - w).abs().max() <= RTOL * w.abs().max()
    rows = {r for r, _, _ in on_kernel}
    assert rows == {2}  # the steps' products; the prompt's (24 rows) ran on F.linear
    assert (2, 101, 64) in on_kernel and (2, 96, 64) in on_kernel  # lm_head, a gate


def test_gradients_and_long_inputs_keep_f_linear(on_kernel):
    model = mhf.fast_decoding(_qwen2())
    ids = torch.randint(3, 101, (1, 20), generator=torch.Generator().manual_seed(2))
    model(ids).logits.sum().backward()  # autograd: F.linear, gradients as nn.Linear's
    assert model.lm_head.weight.grad is not None
    with torch.no_grad():
        model(ids)  # 20 rows: past the kernel's 16
    assert on_kernel == []


def test_refuses_what_it_cannot_move():
    with pytest.raises(TypeError, match=r"takes a torch\.nn\.Module"):
        mhf.fast_decoding("model")
    with pytest.raises(ValueError, match=r"has none: 15 linear layers \(torch.bfloat16 on cpu\)"):
        mhf.fast_decoding(_qwen2().to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"has none: 0 linear layers\. Convert"):
        mhf.fast_decoding(torch.nn.Embedding(3, 4))


def test_a_missing_kernel_is_said_once_and_the_model_decodes_as_before(monkeypatch):
    from multihead.hf import decoding as adapter

    monkeypatch.setattr(few_rows, "kernel_error", lambda: "no C++ compiler found")
    monkeypatch.setattr(adapter, "_warned", [])
    model, want = _qwen2(), _qwen2()
    with pytest.warns(RuntimeWarning, match=r"not available \(no C\+\+ compiler found\).*doctor"):
        assert mhf.fast_decoding(model) is model
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mhf.fast_decoding(_qwen2())  # said once per process
    assert not any(type(m) is RowsLinear for m in model.modules())
    assert mhf.decoding_path(model) is None
    ids = torch.randint(3, 101, (1, 8), generator=torch.Generator().manual_seed(4))
    args = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        assert torch.equal(model.generate(ids, **args), want.generate(ids, **args))


@pytest.mark.slow
def test_a_model_saved_after_the_change_loads_in_a_new_process(tmp_path):
    """save_pretrained writes what transformers writes for the model before the change: a new
    process loads it with transformers alone and gets the same logits."""
    model = mhf.fast_decoding(_qwen2(tie=False))
    model.save_pretrained(tmp_path)
    ids = torch.arange(3, 15)[None]
    with torch.inference_mode():
        want = model(ids).logits
    torch.save(want, tmp_path / "want.pt")
    code = textwrap.dedent(
        f"""
        import sys, torch, transformers as tf
        model = tf.AutoModelForCausalLM.from_pretrained({str(tmp_path)!r}).eval()
        assert "multihead" not in sys.modules
        with torch.inference_mode():
            got = model(torch.arange(3, 15)[None]).logits
        want = torch.load({str(tmp_path / "want.pt")!r})
        assert (got - want).abs().max() <= {RTOL} * want.abs().max(), (got - want).abs().max()
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
