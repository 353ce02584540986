"""``multihead.kv``: policy records, the selection function and a layer's compressed cache,
against plain Python re-statements of each rule."""

from __future__ import annotations

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
    assert sorted(kv.POLICIES) == ["h2o", "snapkv", "streaming", "tova"]


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
    policy, batch, heads, length, flat, pads = case
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
    for r in range(batch):
        for h in range(heads):
            want = _rule(policy, scores[r, h].tolist(), valid[r].tolist(), budget)
            got = chosen.index[r, h]
            if chosen.ok is not None:
                got = got[chosen.ok[r, h]]
            assert got.tolist() == want


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
