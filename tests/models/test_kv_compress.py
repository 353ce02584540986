"""KV-cache compression on multihead's own decoders (``KVCache(policy=)``,
``generate(compress=)``), against transformers' models on the same weights under
``multihead.hf.compress`` (itself checked against the full cache with knockouts in
tests/hf/test_hf_compress.py): the same kept positions and the same logits at every step.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from decoders import build

import multihead.hf as mhf
from multihead import kv
from multihead.models import gpt2, llama

LOADERS = {"gpt2": gpt2, "llama": llama}
PROMPT = 30
STEPS = 5

POLICIES = {
    "snapkv": kv.SnapKV(10, window=4, pool=3, sinks=2),
    "h2o": kv.H2O(10, recent=3, sinks=2),
    "tova": kv.TOVA(10, sinks=2),
    "streaming": kv.StreamingLLM(10, sinks=2),
    "adaptive": kv.SnapKV(10, window=4, pool=3, sinks=2, budget="adaptive"),
    "chunkkv": kv.ChunkKV(10, window=4, pool=3, sinks=2, span=3),
    "spankv": kv.SpanKV(10, window=4, pool=3, sinks=2, span=3),
    "pyramidkv": kv.PyramidKV(10, window=4, pool=3, sinks=2, beta=4),
    "pyramid-adaptive": kv.PyramidKV(10, window=4, pool=3, sinks=2, beta=4, budget="adaptive"),
}


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def pair(request, tmp_path_factory):
    """(our model, transformers' model on "multihead") from one folder."""
    folder = build(request.param, tmp_path_factory.mktemp(request.param), layers=2)
    theirs = tf.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="multihead")
    return LOADERS[request.param].load(folder), theirs.eval()


def _ids(batch: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    return torch.randint(2, 250, (batch, PROMPT), generator=gen)


def _ours(model, ids, policy):
    """Greedy steps on our KVCache with ``policy``: (tokens, logits per step, kept after the
    prompt)."""
    b = ids.shape[0]
    cache = model.new_cache(b, policy=policy)
    lengths = torch.full((b,), ids.shape[1])
    hidden = model.extend(ids, lengths, cache)
    kept = cache.kept
    logits, tokens = [], []
    last = hidden[:, -1]
    for step in range(STEPS):
        out = model.lm_head(last)
        logits.append(out)
        token = out.argmax(-1)
        tokens.append(token)
        if step + 1 < STEPS:
            last = model.extend(token[:, None], 1, cache)[:, 0]
    return torch.stack(tokens, 1), logits, kept, cache


def _theirs(model, ids, policy):
    with mhf.compress(model, policy) as block:
        cache = tf.DynamicCache()
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        kept = block.kept
        logits, tokens = [], []
        for step in range(STEPS):
            logits.append(out.logits[:, -1])
            token = out.logits[:, -1].argmax(-1)
            tokens.append(token)
            if step + 1 < STEPS:
                out = model(input_ids=token[:, None], past_key_values=cache, use_cache=True)
    return torch.stack(tokens, 1), logits, kept


@pytest.mark.parametrize("name", list(POLICIES))
def test_our_compressed_decoding_equals_transformers_compressed(pair, name):
    ours, theirs = pair
    policy = POLICIES[name]
    ids = _ids()
    with torch.inference_mode():
        tokens, logits, kept, _ = _ours(ours, ids, policy)
        want_tokens, want, want_kept = _theirs(theirs, ids, policy)
    assert torch.equal(tokens, want_tokens)
    for got, ref in zip(logits, want):
        # two implementations of the same float32 model: 1e-5 on logits of size ~1
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    for layer in want_kept:
        a, b = kept[layer], want_kept[layer]
        if isinstance(b, torch.Tensor):
            assert torch.equal(a, b)
        else:
            assert [[t.tolist() for t in r] for r in a] == [[t.tolist() for t in r] for r in b]


def test_generate_with_compress_and_everything_kept_equals_plain_generate(pair):
    ours, _ = pair
    ids = _ids(2)
    lengths = torch.tensor([PROMPT, PROMPT - 7])
    plain = ours.generate(ids, 6, lengths=lengths)
    packed = ours.generate(ids, 6, lengths=lengths, compress=kv.SnapKV(1.0, window=4, pool=3))
    assert torch.equal(plain, packed)


@pytest.mark.parametrize("policy", [kv.H2O(1.0), kv.TOVA(1.0)])
def test_keep_1_of_a_decoding_eviction_policy_evicts_nothing(pair, policy):
    """The library's own decoders: keep 1.0 keeps every key while decoding too (issue 58)."""
    ours, _ = pair
    ids = _ids(1)
    assert torch.equal(ours.generate(ids, 12), ours.generate(ids, 12, compress=policy))


def test_a_row_of_a_ragged_batch_equals_the_row_alone(pair):
    ours, _ = pair
    ids = _ids(2)
    lengths = torch.tensor([PROMPT, PROMPT - 7])
    policy = kv.H2O(12, recent=3, sinks=2)
    both = ours.generate(ids, 6, lengths=lengths, compress=policy)
    alone = ours.generate(ids[1:, : PROMPT - 7], 6, compress=policy)
    assert torch.equal(both[1, : PROMPT - 7 + 6], alone[0])


def test_the_cache_frees_what_it_evicts(pair):
    ours, _ = pair
    ids = _ids()
    with torch.inference_mode():
        *_, cache = _ours(ours, ids, kv.SnapKV(10, window=4, pool=3))
        full = ours.new_cache(1)
        ours.extend(ids, torch.tensor([PROMPT]), full)
    per_token = full.bytes_per_token
    # 10 kept keys + the 4 tokens decoded after the prompt, nothing else allocated
    assert cache.nbytes == per_token * (10 + STEPS - 1)


def test_a_policy_needs_a_growing_or_fixed_cache(pair):
    ours, _ = pair
    with pytest.raises(ValueError, match="a rolling cache"):
        kv_cache = ours.new_cache(1)
        type(kv_cache)(2, 1, 2, 8, window=4, policy=kv.SnapKV(0.5))
    with pytest.raises(TypeError, match="Received: policy of type str"):
        type(ours.new_cache(1))(2, 1, 2, 8, policy="snapkv")


@pytest.mark.parametrize("name", ["snapkv", "h2o", "tova", "streaming"])
def test_our_chunked_prompt_equals_transformers_chunked(pair, name):
    """generate(compress=, chunk=) on the library's decoders against compress(chunk=) on
    transformers' model from the same folder: the same tokens, the same kept positions."""
    ours, theirs = pair
    policy = POLICIES[name]
    ids = _ids()
    got = ours.generate(ids, 6, compress=policy, chunk=8)
    with torch.inference_mode(), mhf.compress(theirs, policy, chunk=8) as block:
        want = theirs.generate(input_ids=ids, max_new_tokens=6, do_sample=False,
                               eos_token_id=None)  # fmt: skip
    assert torch.equal(got, want)
    assert all(state.length <= 10 + 5 for state in block.states.values())


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_keep_1_with_any_chunk_equals_plain_generate(pair, chunk):
    ours, _ = pair
    ids = _ids(2)
    lengths = torch.tensor([PROMPT, PROMPT - 7])  # the rows' chunks end at different columns
    plain = ours.generate(ids, 6, lengths=lengths)
    for policy in (kv.H2O(1.0), kv.SnapKV(1.0, window=4, pool=3)):
        assert torch.equal(plain, ours.generate(ids, 6, lengths=lengths, compress=policy,
                                                chunk=chunk))  # fmt: skip


def test_a_row_of_a_ragged_chunked_batch_equals_the_row_alone(pair):
    ours, _ = pair
    ids = _ids(2)
    lengths = torch.tensor([PROMPT, PROMPT - 7])
    policy = kv.H2O(12, recent=3, sinks=2)
    both = ours.generate(ids, 6, lengths=lengths, compress=policy, chunk=8)
    alone = ours.generate(ids[1:, : PROMPT - 7], 6, compress=policy, chunk=8)
    assert torch.equal(both[1, : PROMPT - 7 + 6], alone[0])


def test_chunk_needs_a_policy_and_a_positive_int(pair):
    ours, _ = pair
    with pytest.raises(ValueError, match="without compress the cache holds the whole prompt"):
        ours.generate(_ids(), 2, chunk=8)
    with pytest.raises(ValueError, match="chunk must be an int >= 1"):
        ours.generate(_ids(), 2, compress=kv.H2O(0.5), chunk=0)
