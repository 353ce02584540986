"""``multihead.hf.compress``: KV-cache compression on transformers models.

Two independent references:
- the kept positions equal a plain re-implementation of each policy computed from
  transformers' eager attention weights (``output_attentions=True``) on the same model;
- decoding on the compressed cache equals decoding on the full cache with every evicted key
  knocked out (``multihead.hf.knockout``) from the query positions after its eviction, within
  1e-5 on the logits (float32 sums over a few dozen keys in another order: a few ulps of
  logits of size ~1).
"""

from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch
import transformers as tf
from hf_archs import ARCHS

import multihead.hf as mhf
from multihead import kv

_ARCHS = {a.name: a for a in ARCHS}
PROMPT = 40
STEPS = 5


def _model(name: str, impl: str = "multihead", **changes) -> tf.PreTrainedModel:
    torch.manual_seed(0)
    config = _ARCHS[name].make()
    config.max_position_embeddings = 256
    for key, value in changes.items():
        setattr(config, key, value)
    # each model its own config: set_attn_implementation writes into it
    return tf.AutoModelForCausalLM.from_config(
        copy.deepcopy(config), attn_implementation=impl
    ).eval()


def _inputs(batch: int = 2, pad: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 97, (batch, PROMPT), generator=gen)
    mask = torch.ones_like(ids)
    if batch > 1:
        mask[1, :pad] = 0
    return ids, mask


POLICIES = {
    "snapkv": lambda budget="uniform": kv.SnapKV(14, window=4, pool=3, sinks=2, budget=budget),
    "h2o": lambda budget="uniform": kv.H2O(14, recent=3, sinks=2, budget=budget),
    "tova": lambda budget="uniform": kv.TOVA(14, sinks=2, budget=budget),
    "streaming": lambda budget="uniform": kv.StreamingLLM(14, sinks=2, budget=budget),
    # spans of 3 shared by the KV heads; a pyramid of layer budgets (the first layer the most)
    "chunkkv": lambda budget="uniform": kv.ChunkKV(14, window=4, pool=3, sinks=2, span=3),
    # the heads' summed scores pooled over 3 positions centred on each key
    "spankv": lambda budget="uniform": kv.SpanKV(14, window=4, pool=3, sinks=2, span=3),
    "pyramidkv": lambda budget="uniform": kv.PyramidKV(
        14, window=4, pool=3, sinks=2, budget=budget, beta=4
    ),
}


# ---- the reference: each policy from eager weights, written plainly --------------------------


def _reference_kept(policy, attentions, valid, kv_heads):
    """{layer: [[sorted kept positions] per KV head] per row} from eager weights (B, H, S, S):
    each layer's budget (a pyramid's differs by layer), each KV head's scores (with spans:
    every head ranks a position by the mean of all heads' scores over its span)."""
    found = {}
    for layer, weights in enumerate(attentions):
        w = weights.double()
        b, h, s, _ = w.shape
        group = h // kv_heads
        per_layer = (layer, len(attentions)) if policy.per_layer else ()
        budget = policy.budget_for(s, *per_layer)
        rows = []
        for r in range(b):
            real = [p for p in range(s) if valid[r, p]]
            scores = [
                _scores(policy, w[r, g * group : (g + 1) * group], s) for g in range(kv_heads)
            ]
            if policy.span > 1 and policy.spans == "centred":
                scores = [_centred_ranks(scores, real, policy.span)] * kv_heads
            elif policy.span > 1:
                scores = [_span_means(scores, real, policy.span)] * kv_heads
            rows.append([_one_head(policy, one, real, s, budget) for one in scores])
        found[layer] = rows
    return found


def _span_means(scores, real, span):
    """Each position's rank under span selection: the mean of every head's score at the real
    positions of its span."""
    spans = {}
    for p in real:
        spans.setdefault(p // span, []).extend(head[p] for head in scores)
    return [sum(spans[p // span]) / len(spans[p // span]) if p // span in spans else 0.0
            for p in range(len(scores[0]))]  # fmt: skip


def _centred_ranks(scores, real, span):
    """Each position's rank under centred spans: every head's score summed at each real
    position, then the largest such sum within ``span // 2`` positions (``span`` made odd)."""
    s = len(scores[0])
    shared = [sum(head[p] for head in scores) if p in real else -math.inf for p in range(s)]
    half = (span | 1) // 2
    return [max(shared[max(0, p - half) : p + half + 1]) for p in range(s)]


def _scores(policy, part, s):
    if isinstance(policy, kv.SnapKV):
        mass = part[:, s - policy.window :].sum((0, 1))
        r = policy.pool // 2
        return [float(mass[max(0, p - r) : p + r + 1].max()) for p in range(s)]
    if isinstance(policy, kv.H2O):
        return part.sum((0, 1)).tolist()
    if isinstance(policy, kv.TOVA):
        return part[:, -1].sum(0).tolist()
    return list(range(s))  # StreamingLLM: the newest first


def _one_head(policy, scores, real, s, budget):
    forced = set(real[: policy.sinks]) | {p for p in real if p >= s - policy.window_size}
    others = sorted((p for p in real if p not in forced), key=lambda p: (-scores[p], p))
    return sorted(forced | set(others[: max(budget - len(forced), 0)]))


def _eager_attentions(name, ids, mask):
    model = _model(name, "eager")
    with torch.inference_mode():
        return model(input_ids=ids, attention_mask=mask, output_attentions=True).attentions


@pytest.mark.parametrize("name", list(POLICIES))
def test_kept_positions_equal_the_policy_computed_from_eager_weights(name):
    policy = POLICIES[name]()
    ids, mask = _inputs()
    model = _model("llama")
    with torch.inference_mode(), mhf.compress(model, policy) as block:
        model(input_ids=ids, attention_mask=mask, use_cache=True)
    want = _reference_kept(policy, _eager_attentions("llama", ids, mask), mask.bool(), 2)
    for layer, kept in block.kept.items():
        assert isinstance(kept, torch.Tensor) and kept.dtype == torch.long
        got = [[row.tolist() for row in heads] for heads in kept]
        # the padded row keeps as many keys as it has budget for among its 35 real ones
        assert got == want[layer], f"layer {layer}"


def _adaptive_reference(policy, attentions, valid, kv_heads):
    """AdaKV's sharing, plainly: each head's forced keys, then its best floor(0.2 * free) by
    its own normalized scores, then the row's remaining budget to the highest normalized
    scores of any head (ties: lower head, then earlier position)."""
    found = {}
    for layer, weights in enumerate(attentions):
        w = weights.double()
        b, h, s, _ = w.shape
        group = h // kv_heads
        budget = policy.budget_for(s)
        rows = []
        for r in range(b):
            real = [p for p in range(s) if valid[r, p]]
            forced = set(real[: policy.sinks]) | {p for p in real if p >= s - policy.window_size}
            picked, pool, left = [], [], 0
            for g in range(kv_heads):
                scores = _scores(policy, w[r, g * group : (g + 1) * group], s)
                cand = [p for p in real if p not in forced]
                total = sum(max(scores[p], 0.0) for p in cand)
                norm = {p: max(scores[p], 0.0) / total for p in cand}
                free = max(budget - len(forced), 0)
                floor = int(free * 0.2)
                best = sorted(cand, key=lambda p: (-norm[p], p))[:floor]
                picked.append(forced | set(best))
                pool += [(-norm[p], g, p) for p in cand if p not in best]
                left += free - floor
            for _, g, p in sorted(pool)[:left]:
                picked[g].add(p)
            rows.append([sorted(x) for x in picked])
        found[layer] = rows
    return found


@pytest.mark.parametrize("name", ["snapkv", "h2o"])
def test_adaptive_budgets_share_a_layer_by_concentration(name):
    policy = POLICIES[name]("adaptive")
    ids, mask = _inputs(batch=1)
    model = _model("llama")
    with torch.inference_mode(), mhf.compress(model, policy) as block:
        model(input_ids=ids, attention_mask=mask, use_cache=True)
    want = _adaptive_reference(policy, _eager_attentions("llama", ids, mask), mask.bool(), 2)
    for layer, kept in block.kept.items():
        got = (
            kept.tolist()
            if isinstance(kept, torch.Tensor)
            else [[t.tolist() for t in heads] for heads in kept]
        )
        assert got == want[layer], f"layer {layer}"
        # the layer keeps its whole budget, however it is shared
        assert sum(len(h) for h in got[0]) == 2 * policy.budget_for(PROMPT)


# ---- exact cache surgery ---------------------------------------------------------------------


def _greedy(model, ids, mask, steps, cache, blocks=()):
    """Greedy decoding one token a call; returns (tokens, logits of each call)."""
    logits, tokens = [], []
    out = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    for step in range(steps):
        logits.append(out.logits[:, -1])
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(token)
        mask = torch.cat([mask, torch.ones_like(token)], dim=1)
        if step + 1 < steps:
            out = model(input_ids=token, attention_mask=mask, past_key_values=cache, use_cache=True)
    return torch.cat(tokens, 1), logits


def _evictions(model, policy, ids, mask, steps):
    """Run compressed, recording after each call which positions each (layer, KV head) keeps."""
    history = []
    with mhf.compress(model, policy) as block:
        cache = tf.DynamicCache()
        logits, tokens = [], []
        m = mask
        out = model(input_ids=ids, attention_mask=m, past_key_values=cache, use_cache=True)
        history.append(block.kept)
        for step in range(steps):
            logits.append(out.logits[:, -1])
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(token)
            m = torch.cat([m, torch.ones_like(token)], dim=1)
            if step + 1 < steps:
                out = model(
                    input_ids=token, attention_mask=m, past_key_values=cache, use_cache=True
                )
                history.append(block.kept)
    return torch.cat(tokens, 1), logits, history


def _knockouts(model, history, heads, kv_heads, end):
    """Nested knockouts: a key evicted after the call that ended at position t is hidden from
    every query position after t, in the heads of its KV head."""
    stack = contextlib.ExitStack()
    group = heads // kv_heads
    seen: dict[tuple[int, int], set[int]] = {}
    for call, kept in enumerate(history):
        last = PROMPT - 1 + call  # the last position this call saw
        for layer, positions in kept.items():
            for g in range(kv_heads):
                now = set(positions[0, g].tolist())
                # what the call held: the last call's kept keys and its own new token
                before = seen.get((layer, g), set(range(last))) | {last}
                gone = sorted(p for p in before if p not in now and p <= last)
                seen[(layer, g)] = now
                if gone and last + 1 < end:  # a query that runs sees the eviction
                    stack.enter_context(
                        mhf.knockout(
                            model,
                            queries=list(range(last + 1, end)),
                            keys=gone,
                            layers=[layer],
                            heads=list(range(g * group, (g + 1) * group)),
                        )
                    )
    return stack


CASES = [("llama", p) for p in POLICIES] + [
    ("qwen2", "snapkv"),
    ("mistral", "snapkv"),
    ("gemma2", "snapkv"),
    ("mistral", "h2o"),
]


@pytest.mark.parametrize(("arch", "name"), CASES, ids=[f"{a}-{p}" for a, p in CASES])
def test_decoding_on_a_compressed_cache_equals_the_full_cache_with_knockouts(arch, name):
    policy = POLICIES[name]()
    changes = {"sliding_window": 24} if arch == "mistral" else {}
    model = _model(arch, **changes)
    ids, mask = _inputs(batch=1)
    with torch.inference_mode():
        tokens, logits, history = _evictions(model, policy, ids, mask, STEPS)
        config = model.config
        kv_heads = config.num_key_value_heads
        end = PROMPT + STEPS - 1  # one past the last query position that runs
        with _knockouts(model, history, config.num_attention_heads, kv_heads, end):
            # the full cache, never sliding, so that knockout's key j is position j
            want_tokens, want = _greedy(model, ids, mask, STEPS, tf.DynamicCache())
    assert torch.equal(tokens, want_tokens)
    for got, ref in zip(logits, want):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    # something was evicted: the test compares two different caches
    assert history[0][0].shape[-1] < PROMPT


@pytest.mark.parametrize("keep", [1.0, PROMPT, 500])
def test_keeping_everything_gives_the_tokens_of_a_plain_generate(keep):
    model = _model("llama")
    ids, mask = _inputs()
    args = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    with torch.inference_mode():
        plain = model.generate(**args)
        with mhf.compress(model, kv.SnapKV(keep, window=4, pool=3)):
            packed = model.generate(**args)
    assert torch.equal(plain, packed)


@pytest.mark.parametrize("policy", [kv.H2O(1.0), kv.TOVA(1.0)])
def test_keep_1_of_a_decoding_eviction_policy_evicts_nothing(policy):
    """H2O(keep=1.0) and TOVA(keep=1.0) evicted while decoding: the budget was the prompt's
    length, so every new token pushed one key out (issue 58: 10 and 7 of 12 tokens differed)."""
    model = _model("llama")
    ids, mask = _inputs()
    args = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    with torch.inference_mode():
        plain = model.generate(**args)
        with mhf.compress(model, policy) as block:
            packed = model.generate(**args)
    assert torch.equal(plain, packed)
    padding = (mask == 0).sum(-1)  # (B,): the only slots hidden are the prompt's padding
    for state in block.states.values():
        assert state.length == PROMPT + 11
        hidden = (~state.ok).sum(-1) if state.ok is not None else torch.zeros_like(padding)
        assert torch.equal(hidden, padding[:, None].expand_as(hidden))


def test_the_cache_holds_the_kept_share_of_the_full_cache_bytes():
    model = _model("llama")
    ids, _ = _inputs(batch=1)
    with torch.inference_mode():
        full = tf.DynamicCache()
        model(input_ids=ids, past_key_values=full, use_cache=True)
        with mhf.compress(model, kv.SnapKV(0.25, window=4, pool=3)) as block:
            small = tf.DynamicCache()
            model(input_ids=ids, past_key_values=small, use_cache=True)
    whole = sum(layer.keys.nbytes + layer.values.nbytes for layer in full.layers)
    kept = sum(layer.keys.nbytes + layer.values.nbytes for layer in small.layers)
    assert kept == block.nbytes
    assert kept * PROMPT == whole * round(0.25 * PROMPT)  # 10 of 40 keys per head
    assert small.get_seq_length() == PROMPT  # positions continue as without compression


@pytest.mark.parametrize(
    "policy",
    [
        kv.PyramidKV(0.25, window=4, pool=3, sinks=2),
        kv.PyramidKV(0.25, window=4, pool=3, sinks=2, budget="adaptive"),
        kv.SnapKV(0.25, window=4, pool=3, sinks=2, layers=(1.0, 3.0)),
        kv.ChunkKV(0.25, window=4, pool=3, sinks=2, span=4),
        kv.SpanKV(0.25, window=4, pool=3, sinks=2, span=5),
    ],
    ids=["pyramid", "pyramid-adaptive", "weights", "spans", "centred-spans"],
)
def test_layer_and_span_budgets_hold_the_kept_share_of_the_full_cache_bytes(policy):
    """Budgets shared unevenly between layers (or heads) still free the memory: the cache
    holds at most keep x the full cache's bytes + 5% (the layers' budgets round one by one),
    and the layers' sizes follow the policy's per-layer budgets."""
    model = _model("llama")
    ids, _ = _inputs(batch=1)
    with torch.inference_mode():
        full = tf.DynamicCache()
        model(input_ids=ids, past_key_values=full, use_cache=True)
        with mhf.compress(model, policy) as block:
            small = tf.DynamicCache()
            model(input_ids=ids, past_key_values=small, use_cache=True)
    whole = sum(layer.keys.nbytes + layer.values.nbytes for layer in full.layers)
    kept = sum(layer.keys.nbytes + layer.values.nbytes for layer in small.layers)
    assert kept == block.nbytes <= 1.05 * 0.25 * whole
    layers = len(small.layers)
    for index, state in block.states.items():
        place = (index, layers) if policy.per_layer else ()
        used = state.length if state.ok is None else int(state.ok.sum(-1).max())
        if policy.budget == "adaptive":  # the layer's total, shared among its heads
            used = int(state.ok.sum()) / state.ok.shape[1] if state.ok is not None else used
        assert used == policy.budget_for(PROMPT, *place)
    if policy.per_layer:  # the layers do differ
        assert len({s.length for s in block.states.values()}) > 1


def test_generated_tokens_keep_the_positions_of_the_uncompressed_sequence():
    model = _model("llama")
    ids, mask = _inputs()
    with torch.inference_mode(), mhf.compress(model, kv.StreamingLLM(8, sinks=2)) as block:
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    kept = block.kept[0]
    # the prompt's 40 positions and 3 fed-back tokens: the newest is position 42
    assert kept[:, :, -1].eq(PROMPT + 2).all()
    # the padded row's sinks are its first real tokens, after its 5 pads
    assert kept[1, 0, :2].tolist() == [5, 6] and kept[0, 0, :2].tolist() == [0, 1]


def test_knockout_takes_query_positions_only_generated_tokens_reach():
    model = _model("llama")
    ids, _ = _inputs(batch=1)
    with torch.inference_mode():
        plain = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
        with mhf.knockout(model, queries=[PROMPT + 1, PROMPT + 2], keys=list(range(PROMPT))):
            cut = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
    # the first new token comes from the prompt's call, which the block leaves alone
    assert torch.equal(plain[:, : PROMPT + 2], cut[:, : PROMPT + 2])
    assert not torch.equal(plain, cut)


# ---- errors ------------------------------------------------------------------------------------


def test_a_model_not_on_multihead_is_refused():
    model = _model("llama", "sdpa")
    with (
        torch.inference_mode(),
        pytest.raises(ValueError, match="Received: a model on 'sdpa'"),
        mhf.compress(model, kv.SnapKV(0.5)),
    ):
        pass


def test_gradients_enabled_are_refused():
    model = _model("llama")
    with (
        pytest.raises(ValueError, match="Received: gradients enabled"),
        mhf.compress(model, kv.SnapKV(0.5)),
    ):
        pass


def test_two_compress_blocks_on_one_model_are_refused():
    model = _model("llama")
    with (
        torch.inference_mode(),
        mhf.compress(model, kv.SnapKV(0.5)),
        pytest.raises(ValueError, match="a second compress block"),
        mhf.compress(model, kv.H2O(0.5)),
    ):
        pass


def test_a_static_cache_is_refused_with_the_reason():
    model = _model("llama")
    ids, _ = _inputs(batch=1)
    cache = tf.StaticCache(config=model.config, max_cache_len=64)
    with (
        torch.inference_mode(),
        mhf.compress(model, kv.SnapKV(0.5, window=4, pool=3)),
        pytest.raises(ValueError, match="a static cache cannot do"),
    ):
        model(input_ids=ids, past_key_values=cache, use_cache=True)


def test_a_policy_must_be_a_policy_record():
    model = _model("llama")
    with (
        torch.inference_mode(),
        pytest.raises(TypeError, match="Received: policy of type str"),
        mhf.compress(model, "snapkv"),  # type: ignore[arg-type]
    ):
        pass


def test_compress_with_another_block_on_the_same_layer_is_refused():
    model = _model("llama")
    ids, _ = _inputs(batch=1)
    with (
        torch.inference_mode(),
        mhf.compress(model, kv.SnapKV(0.5, window=4, pool=3)),
        mhf.capture(model, layers=[0]),
        pytest.raises(ValueError, match="does not combine with capture"),
    ):
        model(input_ids=ids, use_cache=True)


# ---- the prompt in chunks ----------------------------------------------------------------------

CHUNK = 12  # the 40-token prompt in chunks of 12, 12, 12 and 4


def _chunked_history(model, policy, ids, chunk):
    """The compressed prompt run by ``compress(chunk=)``: the logits it returns and, after
    each chunk, the positions each (layer, KV head) keeps."""
    history, held = [], {}
    inner = model.forward

    def spy(*args, **kwargs):  # the chunk driver wraps this: one call a chunk
        out = inner(*args, **kwargs)
        history.append(held["block"].kept)
        return out

    model.forward = spy
    try:
        with mhf.compress(model, policy, chunk=chunk) as block:
            held["block"] = block
            out = model(input_ids=ids, use_cache=True)
    finally:
        del model.forward
    return out.logits, history


def _chunk_by_hand(model, ids, history, chunk):
    """The same schedule by hand on the full cache: chunk c runs on every earlier key, with
    the keys evicted after chunk c - 1 knocked out from its queries, in the heads of their KV
    head; returns the last chunk's logits."""
    config = model.config
    group = config.num_attention_heads // config.num_key_value_heads
    cache = tf.DynamicCache()  # never sliding: key j is position j (the mask holds any window)
    starts = list(range(0, ids.shape[1], chunk))
    for c, start in enumerate(starts):
        end = min(start + chunk, ids.shape[1])
        with contextlib.ExitStack() as stack:
            for layer, kept in (history[c - 1] if c else {}).items():
                for g in range(kept.shape[1]):
                    gone = sorted(set(range(start)) - set(kept[0, g].tolist()))
                    if gone:
                        stack.enter_context(
                            mhf.knockout(
                                model, queries=list(range(start, end)), keys=gone,
                                layers=[layer], heads=list(range(g * group, (g + 1) * group)),
                            )
                        )  # fmt: skip
            out = model(input_ids=ids[:, start:end], past_key_values=cache, use_cache=True)
    return out.logits[:, -1]


CHUNK_CASES = [("llama", p) for p in POLICIES] + [
    ("qwen2", "snapkv"),
    ("qwen2", "h2o"),
    ("mistral", "snapkv"),
    ("mistral", "h2o"),
]


@pytest.mark.parametrize(("arch", "name"), CHUNK_CASES, ids=[f"{a}-{p}" for a, p in CHUNK_CASES])
def test_a_prompt_in_chunks_equals_the_schedule_applied_by_hand(arch, name):
    """Each chunk runs on the cache the previous one was cut back to: the same as running it
    on the full cache with the evicted keys knocked out (1e-5: float32 sums over a few dozen
    keys in another order). qwen2's second layer slides (window 5): it keeps its window
    cache and is not compressed; every mistral layer slides (window 24): compressed."""
    policy = POLICIES[name]()
    model = _model(arch, **({"sliding_window": 24} if arch == "mistral" else {}))
    ids, _ = _inputs(batch=1)
    with torch.inference_mode():
        logits, history = _chunked_history(model, policy, ids, CHUNK)
        want = _chunk_by_hand(model, ids, history, CHUNK)
    assert len(history) == 4 and logits.shape[1] == 1  # four chunks, the last position's logits
    torch.testing.assert_close(logits[:, -1], want, atol=1e-5, rtol=0)
    kept = history[-1]
    compressed = {0} if arch == "qwen2" else {0, 1}
    assert set(kept) == compressed  # a sliding layer of a mixed model keeps its window
    layers = model.config.num_hidden_layers
    for layer in compressed:  # cut back to the (layer's) budget after every chunk
        place = (layer, layers) if policy.per_layer else ()
        want_sizes = [policy.budget_for(seen, *place) for seen in (12, 24, 36, 40)]
        assert [h[layer].shape[-1] for h in history] == want_sizes
        if not policy.per_layer:
            assert want_sizes == [CHUNK, 14, 14, 14]


@pytest.mark.parametrize("chunk", [1, 5, 16, 64])
@pytest.mark.parametrize("policy", [kv.SnapKV(1.0, window=4, pool=3), kv.H2O(1.0), kv.TOVA(1.0),
                                    kv.StreamingLLM(1.0)], ids=lambda p: p.name)  # fmt: skip
def test_keep_1_with_any_chunk_gives_a_plain_generate(policy, chunk):
    model = _model("llama")
    ids, mask = _inputs()  # two rows, the second left-padded
    args = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    with torch.inference_mode():
        plain = model.generate(**args)
        with mhf.compress(model, policy, chunk=chunk):
            packed = model.generate(**args)
    assert torch.equal(plain, packed)


def test_a_mixed_model_compresses_its_global_layers_only():
    """Gemma 3's layout (sliding and global layers): generate's cache keeps the sliding
    layer's window and compresses the global one; keep 1.0 changes no token."""
    model = _model("gemma3")
    ids, mask = _inputs()
    args = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    with torch.inference_mode():
        plain = model.generate(**args)
        with mhf.compress(model, kv.H2O(1.0), chunk=8) as block:
            packed = model.generate(**args)
        with mhf.compress(model, kv.SnapKV(10, window=4, pool=3), chunk=8) as small:
            model.generate(**args)
    assert torch.equal(plain, packed)
    assert set(block.states) == {1} == set(small.states)  # layer 0 slides
    assert small.states[1].length == 10 + 5  # the budget, then the decoded tokens


def test_a_fractional_keep_counts_the_decoded_tokens():
    """H2O(0.5) keeps half of everything seen: its budget grows while decoding (a token
    budget stays fixed)."""
    model = _model("llama")
    ids, mask = _inputs(batch=1)
    with torch.inference_mode():
        for policy, want in ((kv.H2O(0.5, recent=3, sinks=2), round(0.5 * (PROMPT + 11))),
                             (kv.H2O(14, recent=3, sinks=2), 14)):  # fmt: skip
            with mhf.compress(model, policy) as block:
                model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12,
                               do_sample=False, eos_token_id=None)  # fmt: skip
            state = block.states[0]
            assert state.total == PROMPT + 11 and state.budget == want
            assert int(state._valid().sum(-1).max()) == want


def test_chunk_is_checked():
    model = _model("llama")
    for bad in (0, -3, 2.5, True):
        with (
            pytest.raises(ValueError, match="chunk must be an int >= 1"),
            torch.inference_mode(),
            mhf.compress(model, kv.H2O(0.5), chunk=bad),
        ):
            pass
    ids, _ = _inputs(batch=1)
    with (
        torch.inference_mode(),
        mhf.compress(model, kv.H2O(0.5), chunk=8),
        pytest.raises(ValueError, match="cannot return every position's attentions"),
    ):
        model(input_ids=ids, output_attentions=True)
    assert "forward" not in model.__dict__  # the model's own forward is back


@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
def test_knockout_on_a_sliding_cache_past_its_window_names_positions(arch):
    """A sliding-window cache that has slid holds its last W - 1 keys: knockout's key j is
    position j there too (it was taken as slot j, which stops being position j once the
    cache slides). Reference: the full cache, whose key j is position j, with the window in
    the mask."""
    model = _model(arch)  # window 5, 40-token prompt: the sliding cache has slid long before
    ids, mask = _inputs(batch=1)
    steps = 8
    queries = list(range(PROMPT, PROMPT + steps))
    keys = [PROMPT - 2, PROMPT + 1, PROMPT + 3]  # inside the window of the decoding steps
    with torch.inference_mode():
        with mhf.knockout(model, queries=queries, keys=keys):
            got_tokens, got = _greedy(model, ids, mask, steps, tf.DynamicCache(config=model.config))
            want_tokens, want = _greedy(model, ids, mask, steps, tf.DynamicCache())
        _, plain = _greedy(model, ids, mask, steps, tf.DynamicCache())
    assert any(tf.DynamicCache(config=model.config).is_sliding)  # the case the test is for
    assert torch.equal(got_tokens, want_tokens)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert not all(torch.allclose(a, b) for a, b in zip(got, plain))  # the knockout hid something


# ---- compress once, ask later: compress_context and Reconstruction ---------------------------


def test_reconstruction_keeps_what_the_second_reading_attends_to():
    """kv.Reconstruction's scores, plainly: eager weights of one causal pass over context,
    repeat request and context again; each context key's score is the weight the second
    reading's rows give it, summed over the rows and the KV head's query group; then the
    policy's rule (sinks, window, best scores)."""
    policy = kv.Reconstruction(14, window=4, sinks=2)
    model = _model("llama")
    ids, _ = _inputs(batch=1)
    repeat = torch.tensor([[7, 8, 9, 10, 11]])
    with torch.inference_mode():
        cache = mhf.compress_context(model, ids, policy, repeat_ids=repeat)
        whole = torch.cat([ids, repeat, ids], 1)
        eager = _model("llama", "eager")
        attentions = eager(input_ids=whole, output_attentions=True).attentions
    kv_heads, group = 2, model.config.num_attention_heads // 2
    real = list(range(PROMPT))
    for layer, weights in enumerate(attentions):
        w = weights.double()[0, :, -PROMPT:, :PROMPT].sum(1)  # (H, S): the second reading's rows
        want = []
        for g in range(kv_heads):
            scores = w[g * group : (g + 1) * group].sum(0).tolist()
            want.append(_one_head(policy, scores, real, PROMPT, policy.budget_for(PROMPT)))
        got = cache.layers[layer].state.kept()[0].tolist()
        assert got == want, f"layer {layer}"
    assert cache.get_seq_length() == PROMPT  # the second reading is cropped off


@pytest.mark.parametrize("policy", [kv.Reconstruction(1.0), kv.SnapKV(1.0, window=4, pool=3)],
                         ids=lambda p: p.name)  # fmt: skip
def test_a_context_compressed_with_everything_kept_answers_as_the_full_cache(policy):
    model = _model("llama")
    ids, _ = _inputs(batch=1)
    question = torch.tensor([[12, 13, 14, 15]])
    with torch.inference_mode():
        want = model(input_ids=torch.cat([ids, question], 1)).logits[:, -1]
        cache = mhf.compress_context(model, ids, policy, repeat_ids=question[:, :2])
        with mhf.compress(model, policy):
            got = model(input_ids=question, past_key_values=cache, use_cache=True).logits[:, -1]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_reconstruction_needs_compress_context_and_a_model_without_windows():
    model = _model("llama")
    ids, _ = _inputs(batch=1)
    needs = r"second reading.*multihead.hf.compress_context"
    with (
        torch.inference_mode(),
        mhf.compress(model, kv.Reconstruction(0.5)),
        pytest.raises(ValueError, match=needs),
    ):
        model(input_ids=ids, use_cache=True)
    sliding = _model("mistral", sliding_window=24)
    with torch.inference_mode(), pytest.raises(ValueError, match="sliding window"):
        mhf.compress_context(sliding, ids, kv.Reconstruction(0.5))
