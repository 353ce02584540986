"""``multihead.kv``: policy records, the selection function and a layer's compressed cache,
against plain Python re-statements of each rule."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from multihead import kv

# ---- the records -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: kv.SnapKV(0.0), r"a fraction keep must lie in \(0, 1\].*Received: keep=0.0"),
        (lambda: kv.H2O(1.5), r"Received: keep=1.5"),
        (lambda: kv.TOVA(float("nan")), r"Received: keep=nan"),
        (lambda: kv.SnapKV(0), r"a token budget keep must be an int >= 1. Received: keep=0"),
        (
            lambda: kv.SnapKV(30, window=32, sinks=4),
            r"at least the 36 keys.*sinks=4 \+ window=32.*Received: keep=30",
        ),
        (lambda: kv.H2O(10, recent=8, sinks=4), r"sinks=4 \+ recent=8.*Received: keep=10"),
        (lambda: kv.StreamingLLM(0.5, sinks=-1), r"sinks must be an int >= 0. Received: sinks=-1"),
        (lambda: kv.SnapKV(0.5, pool=4), r"pool must be odd.*Received: pool=4"),
        (lambda: kv.SnapKV(0.5, window=0), r"window must be an int >= 1. Received: window=0"),
        (lambda: kv.TOVA(0.5, budget="even"), r"budget must be one of.*Received: budget='even'"),
        (lambda: kv.policy("random", 0.5), r"unknown KV-cache policy.*Received: policy='random'"),
    ],
)
def test_bad_settings_are_named(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_keep_of_another_type_is_a_type_error():
    with pytest.raises(TypeError, match="Received: keep='half'"):
        kv.SnapKV("half")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Received: keep=True"):
        kv.H2O(True)


@pytest.mark.parametrize(
    ("policy", "length", "want"),
    [
        (kv.SnapKV(0.25), 4000, 1000),
        (kv.SnapKV(0.25), 100, 36),  # never below the sinks and the window
        (kv.SnapKV(1.0), 77, 77),
        (kv.H2O(512, recent=32), 4000, 512),
        (kv.H2O(512, recent=32), 300, 300),  # a budget past the input keeps it whole
        (kv.TOVA(0.125, sinks=0), 9, 1),
    ],
)
def test_the_budget_counts_every_kept_key(policy, length, want):
    assert policy.budget_for(length) == want


def test_policies_by_name():
    assert kv.policy("SnapKV", 0.5, window=8) == kv.SnapKV(0.5, window=8)
    assert sorted(kv.POLICIES) == [
        "chunkkv",
        "h2o",
        "pyramidkv",
        "reconstruction",
        "snapkv",
        "spankv",
        "streaming",
        "tova",
    ]
    spankv = kv.policy("spankv", 0.25)
    assert spankv == kv.SpanKV(0.25) and isinstance(spankv, kv.SnapKV)
    assert (spankv.span, spankv.spans, spankv.window, spankv.pool) == (15, "centred", 32, 7)


# ---- selection against the rule written out ----------------------------------------------------


def _rule(policy, scores, valid, budget):
    """The kept positions of one row and head: sinks (the first valid ones), the recent
    window, then the best pooled scores (ties: the earlier position)."""
    s = len(valid)
    real = [p for p in range(s) if valid[p]]
    forced = set(real[: policy.sinks]) | {p for p in real if p >= s - policy.window_size}
    if isinstance(policy, kv.StreamingLLM):
        rank = [float(p) for p in range(s)]
    elif isinstance(policy, kv.SnapKV):
        r = policy.pool // 2
        rank = [max(scores[max(0, p - r) : p + r + 1]) for p in range(s)]
    else:
        rank = list(scores)
    others = sorted((p for p in real if p not in forced), key=lambda p: (-rank[p], p))
    return sorted(forced | set(others[: max(budget - len(forced), 0)]))


@st.composite
def _cases(draw):
    length = draw(st.integers(4, 40))
    batch, heads = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    sinks = draw(st.integers(0, 3))
    window = draw(st.integers(1, 4))
    kind = draw(st.sampled_from(["snapkv", "h2o", "tova", "streaming"]))
    options = {"sinks": sinks}
    if kind == "snapkv":
        options |= {"window": window, "pool": draw(st.sampled_from([1, 3, 5]))}
    if kind == "h2o":
        options |= {"recent": window - 1}
    keep = draw(st.integers(sinks + window, sinks + window + length))
    policy = kv.policy(kind, keep, **options)
    # scores in steps of 1/8: ties happen, and the rule for them is part of the contract
    scores = draw(st.lists(st.integers(0, 8), min_size=batch * heads * length,
                           max_size=batch * heads * length))  # fmt: skip
    pads = draw(st.lists(st.integers(0, length // 2), min_size=batch, max_size=batch))
    return policy, batch, heads, length, scores, pads


@settings(derandomize=True, max_examples=150, deadline=None)
@given(_cases())
def test_select_keeps_what_the_rule_keeps(case):
    policy, scores, valid, budget, kept = _selected(*case)
    for r, h in itertools.product(range(scores.shape[0]), range(scores.shape[1])):
        want = _rule(policy, scores[r, h].tolist(), valid[r].tolist(), budget)
        assert kept(r, h) == want


def _selected(policy, batch, heads, length, flat, pads):
    """A drawn case through ``kv.select``: (policy, scores (B, H_kv, S) in steps of 1/8, valid
    (B, S) with each row's left padding, the budget, kept(row, head) -> the kept positions)."""
    scores = torch.tensor(flat, dtype=torch.float64).reshape(batch, heads, length) / 8
    valid = torch.ones(batch, length, dtype=torch.bool)
    for row, pad in enumerate(pads):
        valid[row, :pad] = False  # left padding
    positions = torch.arange(length).expand(batch, heads, length)
    budget = policy.budget_for(length)
    chosen = kv.select(
        policy, scores=scores, positions=positions, valid=valid[:, None].expand(-1, heads, -1),
        sinks_end=kv.sink_bound(valid, policy.sinks), ends=torch.full((batch,), length),
        budget=budget,
    )  # fmt: skip

    def kept(r: int, h: int) -> list[int]:
        got = chosen.index[r, h]
        return (got if chosen.ok is None else got[chosen.ok[r, h]]).tolist()

    return policy, scores, valid, budget, kept


def test_sink_bound_counts_valid_positions():
    valid = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1]]).bool()
    assert kv.sink_bound(valid, 2).tolist() == [4, 2, 6]
    assert kv.sink_bound(valid, 0).tolist() == [0, 0, 0]


def test_adaptive_budgets_keep_the_layers_total_and_favour_spread_heads():
    """Head 0's mass sits on two keys, head 1's is spread evenly: head 1 gets more keys, and
    the two together keep exactly twice the uniform budget."""
    length = 64
    scores = torch.full((1, 2, length), 1.0 / length, dtype=torch.float64)
    scores[0, 0] = 1e-4
    scores[0, 0, [10, 20]] = 0.5
    policy = kv.SnapKV(16, window=4, pool=1, sinks=2, budget="adaptive")
    keys = torch.randn(1, 2, length, 8)
    state = kv.LayerState.from_prompt(
        policy, keys, keys.clone(), scores, torch.ones(1, length, dtype=torch.bool)
    )
    kept = state.kept()
    assert isinstance(kept, list)
    sizes = [len(t) for t in kept[0]]
    assert sum(sizes) == 2 * 16 and sizes[1] > sizes[0]
    assert {10, 20} <= set(kept[0][0].tolist())
    # every kept slot's key is the key of its position
    for h in range(2):
        ok = state.ok[0, h]
        torch.testing.assert_close(
            state.keys[0, h][ok], keys[0, h, state.positions[0, h][ok]], rtol=0, atol=0
        )


# ---- a layer's state -----------------------------------------------------------------------


def _state(length=20, budget=8, heads=2, policy=None):
    policy = policy or kv.H2O(budget, recent=2, sinks=1)
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(1, heads, length, 4, generator=gen)
    scores = torch.rand(1, heads, length, generator=gen, dtype=torch.float64)
    valid = torch.ones(1, length, dtype=torch.bool)
    return kv.LayerState.from_prompt(policy, keys, keys + 1, scores, valid), keys


def test_the_prompt_keeps_its_budget_with_keys_at_their_positions():
    state, keys = _state()
    assert state.length == 8 and state.total == 20
    assert state.nbytes == 2 * (1 * 2 * 8 * 4 * 4)
    idx = state.positions[..., None].expand(-1, -1, -1, 4)
    assert torch.equal(state.keys, keys.gather(2, idx))
    assert torch.equal(state.values, keys.gather(2, idx) + 1)
    kept = state.kept()
    assert isinstance(kept, torch.Tensor) and bool((kept.diff(dim=-1) > 0).all())


def test_h2o_accumulates_and_evicts_the_lowest_unprotected_key():
    state, _ = _state()
    before = state.scores.clone()
    new = torch.zeros(1, 2, 1, 4)
    state.append(new, new)
    assert state.positions[0, 0, -1] == 20 and state.total == 21
    step = torch.rand(1, 2, 9, dtype=torch.float64)
    state.observe(step)
    # the evicted slot is hidden at once; its memory waits for the next gather
    assert state.length == 9 and state.ok is not None and state.ok.sum(-1).tolist() == [[8, 8]]
    total = torch.cat([before, torch.zeros(1, 2, 1, dtype=torch.float64)], 2) + step
    for h in range(2):
        # the evicted key: the lowest total among those neither a sink nor in the recent 2
        held = list(range(9))
        free = [i for i in held if not (i == 0 or i >= 7)]
        gone = min(free, key=lambda i: (float(total[0, h, i]), i))
        assert state.ok[0, h].tolist() == [i != gone for i in held]
        assert torch.equal(state.scores[0, h], total[0, h])


def test_evicted_slots_are_given_back_every_slack_steps():
    from multihead.kv.state import _SLACK

    state, _ = _state()
    gen = torch.Generator().manual_seed(1)
    lengths = []
    for _ in range(_SLACK + 1):
        new = torch.randn(1, 2, 1, 4, generator=gen)
        state.append(new, new)
        state.observe(torch.rand(1, 2, state.length, generator=gen, dtype=torch.float64))
        lengths.append((state.length, state.ok is None))
        assert state._valid().sum(-1).tolist() == [[8, 8]]  # always the budget in use
    # one slot more per step until SLACK are hidden, then gathered back to the budget
    assert lengths[: _SLACK - 1] == [(n, False) for n in range(9, 8 + _SLACK)]
    assert lengths[_SLACK - 1] == (8, True) and lengths[_SLACK] == (9, False)
    kept = state.kept()
    assert isinstance(kept, torch.Tensor) and kept.shape == (1, 2, 8)  # hidden slots left out


def test_slot_mask_reads_the_uncompressed_mask_at_the_kept_positions():
    state, _ = _state(heads=2)
    dense = torch.rand(1, 1, 3, 20) > 0.5  # (B, 1, L, total)
    got = state.slot_mask(dense, heads=4)
    assert got is not None and got.shape == (1, 4, 3, 8)
    for h in range(4):
        positions = state.positions[0, h // 2]
        assert torch.equal(got[0, h], dense[0, 0][:, positions])
    assert state.slot_mask(None, heads=4) is None


def test_fraction_rounding_matches_the_kept_count():
    for length in (7, 33, 100):
        policy = kv.TOVA(0.3, sinks=1)
        state, _ = _state(length=length, policy=policy)
        assert state.length == max(round(0.3 * length), 1) == policy.budget_for(length)
        assert math.isclose(state.length / length, 0.3, abs_tol=0.5 / length + 1e-9)


# ---- spans and per-layer budgets -------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: kv.ChunkKV(0.5, span=0), r"span must be an int >= 1. Received: span=0"),
        (lambda: kv.ChunkKV(0.5, spans="loose"), r"spans must be one of aligned, centred"),
        (
            lambda: kv.ChunkKV(0.5, budget="adaptive"),
            r"same spans in every KV head.*Received: span=20, budget='adaptive'",
        ),
        (lambda: kv.SnapKV(0.5, layers="cone"), r"layers must be one of.*Received: layers='cone'"),
        (lambda: kv.SnapKV(0.5, layers=(1.0, -1.0)), r"positive finite.*layers=\(1.0, -1.0\)"),
        (lambda: kv.SnapKV(0.5, layers=()), r"non-empty tuple.*Received: layers=\(\)"),
        (lambda: kv.PyramidKV(0.5, beta=0.5), r"beta must be a number >= 1.*Received: beta=0.5"),
        (lambda: kv.H2O(0.5, whole_layers=-1), r"whole_layers must be an int >= 0"),
        (lambda: kv.PyramidKV(0.5).budget_for(100), r"layer's index.*layer=None, layers=None"),
        (
            lambda: kv.SnapKV(0.5, layers=(1.0, 2.0)).budget_for(100, 0, 3),
            r"2 weights for a model of 3 layers",
        ),
        (
            lambda: kv.LayerState.from_prompt(
                kv.PyramidKV(8, window=2, sinks=1),
                *(torch.zeros(1, 1, 20, 2), torch.zeros(1, 1, 20, 2), torch.zeros(1, 1, 20)),
                torch.ones(1, 20, dtype=torch.bool),
            ),
            r"per-layer budgets needs each layer's place",
        ),
    ],
)
def test_bad_span_and_layer_settings_are_named(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def _uniform(policy):
    """The same policy with one budget for every layer (its mean)."""
    return dataclasses.replace(policy, layers="uniform", whole_layers=0)


def _pyramid(policy, length, layers):
    """PyramidKV's budgets (Cai et al. 2024), in float64: the scored part s = mean - fixed
    falls linearly over the layers that are not kept whole from 2s - s/beta to s/beta (the
    first clipped to the whole input, the last raised to keep the mean)."""
    mean = _uniform(policy).budget_for(length)
    whole = policy.whole_layers
    fixed = min(policy.fixed, length)
    whole = min(whole, layers)
    rest = layers - whole
    if rest == 0:
        return [length] * layers
    s = max((layers * mean - whole * length) / rest - fixed, 0.0)
    high, low = 2 * s - s / policy.beta, s / policy.beta
    if high > length - fixed:
        high, low = length - fixed, 2 * s - (length - fixed)
    out = [length] * whole
    for i in range(rest):
        share = s if rest == 1 else high - i * (high - low) / (rest - 1)
        out.append(fixed + round(min(max(share, 0.0), length - fixed)))
    return out


@settings(derandomize=True, max_examples=120, deadline=None)
@given(
    length=st.integers(40, 5000),
    layers=st.integers(1, 40),
    keep=st.sampled_from([0.1, 0.25, 0.5, 0.9]),
    beta=st.sampled_from([1.0, 2.0, 20.0]),
    whole=st.integers(0, 2),
)
def test_pyramid_budgets_follow_the_formula_and_keep_the_mean(length, layers, keep, beta, whole):
    policy = kv.PyramidKV(keep, window=8, sinks=4, beta=beta, whole_layers=whole)
    got = [policy.budget_for(length, i, layers) for i in range(layers)]
    assert got == [min(b, length) for b in _pyramid(policy, length, layers)]
    assert all(a >= b for a, b in itertools.pairwise(got))  # the first layers keep the most
    mean = _uniform(policy).budget_for(length)
    if whole * length <= layers * mean - (layers - whole) * policy.fixed:
        # the layers together keep the uniform budget's keys (each layer rounds once)
        assert abs(sum(got) - layers * mean) <= layers / 2 + 1e-9


def test_weights_per_layer_share_the_total_and_whole_layers_take_from_it():
    policy = kv.SnapKV(0.25, window=8, sinks=4, layers=(3.0, 2.0, 1.0, 2.0))
    got = [policy.budget_for(1000, i, 4) for i in range(4)]
    scored = 250 - 12
    assert got == [12 + round(scored * 4 * w / 8) for w in (3.0, 2.0, 1.0, 2.0)]
    whole = kv.SnapKV(0.5, window=8, sinks=4, whole_layers=1)
    got = [whole.budget_for(1000, i, 4) for i in range(4)]
    # the first layer whole; the other three share what is left of 4 x 500 keys
    assert got == [1000] + [12 + round((4 * 500 - 1000) / 3 - 12)] * 3 == [1000, 333, 333, 333]


def _span_rule(policy, scores, valid, budget):
    """Each head's kept positions under span selection, plainly: a position's rank is the mean
    of the pooled scores over every (head, valid position) pair of its span, then the policy's
    own rule (sinks, window, best ranks, ties to the earlier position)."""
    heads, s = len(scores), len(valid)
    r = policy.pool // 2
    pooled = [[max(row[max(0, p - r) : p + r + 1]) for p in range(s)] for row in scores]
    spans = {}
    for p in range(s):
        if valid[p]:
            spans.setdefault(p // policy.span, []).extend(pooled[h][p] for h in range(heads))
    rank = [sum(spans[p // policy.span]) / len(spans[p // policy.span])
            if p // policy.span in spans else 0.0 for p in range(s)]  # fmt: skip
    real = [p for p in range(s) if valid[p]]
    forced = set(real[: policy.sinks]) | {p for p in real if p >= s - policy.window_size}
    others = sorted((p for p in real if p not in forced), key=lambda p: (-rank[p], p))
    return sorted(forced | set(others[: max(budget - len(forced), 0)]))


@st.composite
def _span_cases(draw):
    length = draw(st.integers(6, 48))
    batch, heads = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    sinks, window = draw(st.integers(0, 3)), draw(st.integers(1, 4))
    span = draw(st.integers(2, 6))
    keep = draw(st.integers(sinks + window, sinks + window + length))
    policy = kv.ChunkKV(keep, window=window, sinks=sinks, span=span,
                        pool=draw(st.sampled_from([1, 3])))  # fmt: skip
    scores = draw(st.lists(st.integers(0, 8), min_size=batch * heads * length,
                           max_size=batch * heads * length))  # fmt: skip
    pads = draw(st.lists(st.integers(0, length // 2), min_size=batch, max_size=batch))
    return policy, batch, heads, length, scores, pads


@settings(derandomize=True, max_examples=150, deadline=None)
@given(_span_cases())
def test_span_selection_keeps_what_the_rule_keeps(case):
    policy, scores, valid, budget, kept = _selected(*case)
    for r in range(scores.shape[0]):
        want = _span_rule(policy, scores[r].tolist(), valid[r].tolist(), budget)
        for h in range(scores.shape[1]):  # every head keeps the same spans
            assert kept(r, h) == want


def _centred_rule(policy, scores, valid, budget):
    """Each head's kept positions with centred spans, plainly: the pooled scores summed over
    the heads at each valid position (-inf elsewhere), each position ranked by the largest sum
    within ``span // 2`` positions of it (``span`` rounded up to odd), then the policy's own
    rule (ties to the earlier position)."""
    s = len(valid)
    r = policy.pool // 2
    pooled = [[max(row[max(0, p - r) : p + r + 1]) for p in range(s)] for row in scores]
    shared = [sum(row[p] for row in pooled) if valid[p] else -math.inf for p in range(s)]
    half = (policy.span | 1) // 2
    rank = [max(shared[max(0, p - half) : p + half + 1]) for p in range(s)]
    real = [p for p in range(s) if valid[p]]
    forced = set(real[: policy.sinks]) | {p for p in real if p >= s - policy.window_size}
    others = sorted((p for p in real if p not in forced), key=lambda p: (-rank[p], p))
    return sorted(forced | set(others[: max(budget - len(forced), 0)]))


@settings(derandomize=True, max_examples=150, deadline=None)
@given(_span_cases())
def test_centred_spans_keep_what_the_rule_keeps(case):
    policy, *rest = case
    policy = dataclasses.replace(policy, spans="centred")
    policy, scores, valid, budget, kept = _selected(policy, *rest)
    for r in range(scores.shape[0]):
        want = _centred_rule(policy, scores[r].tolist(), valid[r].tolist(), budget)
        for h in range(scores.shape[1]):  # every head keeps the same positions
            assert kept(r, h) == want


def test_a_centred_span_keeps_the_value_after_its_cue_across_a_chunks_edge():
    """The cue (one key that draws the question's attention, at 27) and the seven-token value
    after it (28-34) cross the edge at 30 of ChunkKV's spans of 15: with a budget of one span
    beside the sinks and window, aligned spans keep the chunk holding the cue (15-29) and lose
    the value's last five tokens; the span of 15 centred on the cue (20-34) keeps them."""
    length = 60
    scores = torch.full((1, 2, length), 0.01, dtype=torch.float64)
    scores[0, :, 27] = 3.0
    scores[0, :, 28:35] = 0.05
    valid = torch.ones(1, length, dtype=torch.bool)
    keys = torch.randn(1, 2, length, 4)
    kept = {}
    for spans in ("aligned", "centred"):
        policy = kv.SnapKV(2 + 4 + 15, window=4, sinks=2, pool=1, span=15, spans=spans)
        state = kv.LayerState.from_prompt(policy, keys, keys, scores, valid)
        kept[spans] = set(state.kept()[0, 0].tolist())
        assert kept[spans] == set(state.kept()[0, 1].tolist())  # the same in every head
    assert kept["aligned"] == {0, 1, *range(15, 30), 56, 57, 58, 59}
    assert kept["centred"] == {0, 1, *range(20, 35), 56, 57, 58, 59}


def test_a_centred_span_pools_by_position_not_across_an_evicted_gap():
    """After an eviction the slots hold positions 0-9 and 50-59: a high score at position 50
    keeps its neighbours by position (51, 52 with a span of 5), not slots 8 and 9, which sit
    beside it in the cache but 41 positions away."""
    positions = torch.tensor([*range(10), *range(50, 60)]).expand(1, 2, 20)
    scores = torch.full((1, 2, 20), 0.01, dtype=torch.float64)
    scores[0, :, 10] = 3.0  # position 50
    valid = torch.ones(1, 2, 20, dtype=torch.bool)
    policy = kv.SnapKV(1 + 1 + 3, window=1, sinks=1, pool=1, span=5, spans="centred")
    chosen = kv.select(
        policy, scores=scores, positions=positions, valid=valid,
        sinks_end=torch.tensor([1]), ends=torch.tensor([60]), budget=policy.budget_for(60),
    )  # fmt: skip
    kept = positions[0, 0][chosen.index[0, 0]].tolist()
    assert kept == [0, 50, 51, 52, 59]


def test_a_span_is_kept_whole_where_its_keys_score_unevenly():
    """A five-token value whose middle token scores low key by key: SnapKV drops it, span
    selection keeps all five (the span's mean is high)."""
    length, span = 40, 5
    scores = torch.full((1, 2, length), 0.01, dtype=torch.float64)
    scores[0, :, 20:25] = torch.tensor([0.9, 0.9, 0.0, 0.9, 0.9], dtype=torch.float64)
    scores[0, :, 31] = 0.5  # a single strong key elsewhere
    valid = torch.ones(1, length, dtype=torch.bool)
    keys = torch.randn(1, 2, length, 4)
    kept = {}
    for name, policy in {
        "snapkv": kv.SnapKV(10, window=2, sinks=1, pool=1),
        "chunkkv": kv.ChunkKV(10, window=2, sinks=1, pool=1, span=span),
    }.items():
        state = kv.LayerState.from_prompt(policy, keys, keys, scores, valid)
        kept[name] = set(state.kept()[0, 0].tolist())
    assert 22 not in kept["snapkv"] and {20, 21, 23, 24} <= kept["snapkv"]
    assert set(range(20, 25)) <= kept["chunkkv"]


def test_a_layer_state_keeps_its_layers_budget():
    policy = kv.PyramidKV(0.25, window=4, sinks=2)
    keys = torch.randn(1, 2, 200, 4)
    scores = torch.rand(1, 2, 200, dtype=torch.float64)
    valid = torch.ones(1, 200, dtype=torch.bool)
    lengths = [
        kv.LayerState.from_prompt(policy, keys, keys, scores, valid, place=(i, 6)).length
        for i in range(6)
    ]
    assert lengths == [policy.budget_for(200, i, 6) for i in range(6)]
    assert lengths[0] > lengths[-1] and abs(sum(lengths) - 6 * 50) <= 3
