"""context_attention across 2 and 4 real processes (gloo on CPU) against single-process
``multihead.attention`` on the whole sequence: outputs, gradients (bias tables included),
skipped shards, and the errors every rank raises together."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from cp_cases import Spec, call_with, count_kernel_calls, run_shard, run_split, subgroup, whole
from cp_pool import Pool
from helpers import naive_attention

import multihead as mh
from multihead.parallel import ProcessGroupError, context_attention, visible_shards
from multihead.parallel.context import _band_pieces, _check_device, _Piece, _same_band


@pytest.fixture(scope="module")
def pools(tmp_path_factory):
    """One process group per world size, started on first use and shared by this module."""
    started: dict[int, Pool] = {}

    def get(world: int) -> Pool:
        if world not in started:
            started[world] = Pool(world, tmp_path_factory.mktemp(f"ring{world}"))
        return started[world]

    yield get
    for pool in started.values():  # all stop at once, then each is waited for
        pool.stop()
    for pool in started.values():
        pool.close()


def _reference(spec: Spec) -> dict:
    """Single-process attention on the whole sequence, and its gradients."""
    t = whole(spec)
    q, k, v = (x.clone().requires_grad_() for x in (t.q, t.k, t.v))
    out = mh.attention(q, k, v, t.mask, bias=t.bias)
    wrt = [q, k, v] + ([t.table] if t.table is not None else [])
    grads = torch.autograd.grad(out, wrt, t.grad_out)
    return {
        name: x.detach().numpy()
        for name, x in zip(["out", "dq", "dk", "dv", "dtable"], [out, *grads])
    }


def _check(spec: Spec, results: list[dict], out_tol: float, grad_tol: float) -> None:
    want = _reference(spec)
    got = {
        "out": np.concatenate([r["out"] for r in results], axis=2),
        "dq": np.concatenate([r["dq"] for r in results], axis=2),
        "dk": np.concatenate([r["dk"] for r in results], axis=2),
        "dv": np.concatenate([r["dv"] for r in results], axis=2),
    }
    assert got["out"].shape == want["out"].shape and got["dk"].shape == want["dk"].shape
    np.testing.assert_allclose(got["out"], want["out"], rtol=0, atol=out_tol)
    for name in ("dq", "dk", "dv"):
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=grad_tol, err_msg=name)
    for r in results:  # the same forward without autograd (no saved state, no Function)
        np.testing.assert_array_equal(r["no_grad_out"], r["out"])
    if spec.bias == "alibi+t5":  # every rank holds the gradient of the whole table
        for r in results:
            np.testing.assert_allclose(r["dtable"], want["dtable"], rtol=0, atol=grad_tol)


UNEVEN = {2: (29, 18), 4: (14, 5, 17, 11)}  # shards of unequal length, 47 positions in all


@pytest.mark.parametrize("bias", ["none", "alibi"])
@pytest.mark.parametrize("kind", ["causal", "window", "documents"])
@pytest.mark.parametrize("world", [2, 4])
def test_matches_single_process_attention_fp32(pools, world, kind, bias):
    spec = Spec(kind, UNEVEN[world], bias=bias, seed=world)
    # the fp32 rule (docs/design.md, "Error rules"): outputs within 1e-5, gradients within
    # 1e-4 of the reference
    _check(spec, pools(world).run(run_shard, spec), out_tol=1e-5, grad_tol=1e-4)


@pytest.mark.parametrize("kind", ["causal", "window", "documents", "none"])
def test_float64_is_exact_and_t5_table_gradient_is_summed_over_ranks(pools, kind):
    spec = Spec(kind, (9, 0, 21, 13), bias="alibi+t5", dtype="float64", seed=5)
    # float64: the only difference from one process is the order of the log-sum-exp merges
    # and of the gradient sums, worth a few ulps of values of order 1
    _check(spec, pools(4).run(run_shard, spec), out_tol=1e-12, grad_tol=1e-12)


@pytest.mark.parametrize("kind", ["causal", "documents"])
def test_bfloat16_within_twice_the_naive_formula_error(pools, kind):
    spec = Spec(kind, (20, 11, 0, 30), dtype="bfloat16", d=16, seed=9)
    t = whole(spec)
    ref, _ = naive_attention(t.q.double(), t.k.double(), t.v.double(), t.keep)
    naive_err = (naive_attention(t.q, t.k, t.v, t.keep)[0].double() - ref).abs().max()
    got = np.concatenate([r["out"] for r in pools(4).run(run_shard, spec)], axis=2)
    # the 2x rule (docs/design.md, "Error rules"): at most 2x the naive bf16 formula's
    # error, + 1 ulp
    ulp = torch.finfo(torch.bfloat16).eps * ref.abs().max()
    assert (torch.from_numpy(got).double() - ref).abs().max() <= 2 * naive_err + ulp


def test_key_shards_of_other_lengths_than_query_shards(pools):
    # L = 30 queries against S = 44 keys: causal is bottom-right aligned over the whole
    spec = Spec("causal", (10, 20), key_lengths=(30, 14), bias="alibi", dtype="float64")
    _check(spec, pools(2).run(run_shard, spec), out_tol=1e-12, grad_tol=1e-12)


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        # queries of rank r see key shards 0..r: 10 of 16 computed, 6 skipped
        ("causal", [1, 2, 3, 4]),
        # sliding_window(3) is narrower than a shard: only a rank's own shard and its left
        # neighbour's
        ("window", [1, 2, 2, 2]),
        ("none", [4, 4, 4, 4]),
    ],
)
def test_whole_shards_are_skipped(pools, kind, expected):
    spec = Spec(kind, (12, 12, 12, 12), seed=3)
    results = pools(4).run(count_kernel_calls, spec)
    assert [r["forward"] for r in results] == expected
    assert [r["backward"] for r in results] == expected
    assert [sum(row) for row in visible_shards(whole(spec).mask, spec.lengths)] == expected
    want = _reference(spec)["out"]
    got = np.concatenate([r["out"] for r in results], axis=2)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)  # the fp32 rule


def test_visible_shards_from_tile_answers():
    causal = visible_shards(mh.masks.causal(), [8, 8, 8])
    assert causal == [[True, False, False], [True, True, False], [True, True, True]]
    window = visible_shards(mh.masks.sliding_window(4), [10, 10, 10, 10])
    assert window == [[i - 1 <= j <= i for j in range(4)] for i in range(4)]
    # documents that end exactly at shard edges: every rank sees only its own shard
    ids = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4])
    assert visible_shards(mh.masks.documents(ids), [5, 7, 4]) == [
        [True, False, False],
        [False, True, False],
        [False, False, True],
    ]
    # an empty shard sees nothing and is seen by nobody
    assert visible_shards(None, [3, 0], [0, 4]) == [[False, True], [False, False]]
    # a bool tensor is a dense mask
    keep = torch.zeros(6, 6, dtype=torch.bool)
    keep[5, 0] = True
    assert visible_shards(keep, [3, 3]) == [[False, False], [True, False]]


def test_band_blocks_split_into_unmasked_calls_and_edge_strips():
    def p(r0, r1, c0, c1, full):
        return _Piece(r0, r1, c0, c1, full)

    # causal on the diagonal (query i sees keys j <= i), 4-row blocks, full ranges of >= 2 keys
    assert _band_pieces(None, 0, 10, 10, 4, 2) == [
        p(0, 4, 0, 4, False),  # the fully visible range [0, 1) is too narrow to run alone
        p(4, 8, 0, 5, True),
        p(4, 8, 5, 8, False),
        p(8, 10, 0, 9, True),
        p(8, 10, 9, 10, False),
    ]
    # a shard below the diagonal: one unmasked call for all its rows
    assert _band_pieces(None, 20, 10, 8, 4, 2) == [p(0, 10, 0, 8, True)]
    # sliding_window(3) (-3 <= j - i <= 0): strips on both sides of the full range
    assert _band_pieces(-3, 0, 10, 10, 4, 2) == [
        p(0, 4, 0, 4, False),
        p(4, 8, 1, 8, False),
        p(8, 10, 6, 9, True),
        p(8, 10, 5, 6, False),
        p(8, 10, 9, 10, False),
    ]
    # a band that misses the block entirely
    assert _band_pieces(-100, -50, 10, 8, 4, 2) == []


@pytest.mark.parametrize(
    ("whole", "box"),
    [
        (mh.masks.causal(), (1, 8)),  # a causal strip: row i' sees keys j' < i'
        (mh.masks.sliding_window(5), (-5, 8)),  # a window's block: 0 <= j' - i' <= 5
        (mh.masks.sliding_window(3, 2, align="top_left"), (-3, 10)),
    ],
)
def test_blocks_of_one_band_share_one_plan(whole, box):
    keys = set()
    for r0 in (8, 16, 40):
        crop = whole.crop(64, 64, r0, r0 + 8, r0 + box[0], r0 + box[1])
        rows, cols = 8, box[1] - box[0]
        same = _same_band(crop, rows, cols)
        assert torch.equal(
            same.to_dense(rows, cols)[0, 0].expand(rows, cols), crop.to_dense(rows, cols)[0, 0]
        )
        keys.add(same.structure_key)
    assert len(keys) == 1  # the tiled kernel caches plans under this key
    # masks that are no band have no stand-in
    ids = torch.zeros(1, 64, dtype=torch.long)
    assert _same_band(mh.masks.documents(ids).crop(64, 64, 0, 8, 0, 8), 8, 8) is None


def _covered(pieces, rows, cols):
    """How many pieces cover each (row, col) of the block."""
    count = np.zeros((rows, cols), dtype=int)
    for piece in pieces:
        count[piece.r0 : piece.r1, piece.c0 : piece.c1] += 1
    return count


@pytest.mark.parametrize(
    ("lo", "hi", "rows", "cols"),
    [(None, 0, 37, 37), (None, 5, 30, 41), (-9, 0, 37, 37), (-4, 6, 33, 29), (3, None, 20, 31)],
)
def test_band_pieces_cover_every_visible_pair_once(lo, hi, rows, cols):
    i, j = np.arange(rows)[:, None], np.arange(cols)[None, :]
    visible = np.ones((rows, cols), dtype=bool)
    if lo is not None:
        visible &= j - i >= lo
    if hi is not None:
        visible &= j - i <= hi
    pieces = _band_pieces(lo, hi, rows, cols, 8, 3)
    count = _covered(pieces, rows, cols)
    assert (count[visible] == 1).all() and (count <= 1).all()
    for piece in pieces:  # an unmasked piece holds visible pairs only
        if piece.full:
            assert visible[piece.r0 : piece.r1, piece.c0 : piece.c1].all()


def test_split_shards_match_single_process_attention(pools):
    # long shards are cut into row blocks; small blocks here put every cut inside the test
    for kind in ("causal", "window", "window_both"):
        spec = Spec(kind, (23, 9, 30, 17), bias="alibi+t5", dtype="float64", seed=11)
        results = pools(4).run(run_split, spec)
        _check(spec, results, out_tol=1e-12, grad_tol=1e-12)  # float64, as above


def test_visible_shards_errors():
    with pytest.raises(ValueError, match=r"one entry per rank each. Received: 2 query shards"):
        visible_shards(None, [3, 3], [6])
    with pytest.raises(ValueError, match=r"ints >= 0\), one per rank. Received: query_lengths"):
        visible_shards(None, [3, -1])
    with pytest.raises(ValueError, match=r"Received: query_lengths=\[\]"):
        visible_shards(None, [])


def test_no_process_group_is_a_clear_error():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ProcessGroupError, match=r"needs an initialized process group.*torchrun"):
        context_attention(q, q, q, mh.masks.causal())
    # both what torch.distributed raises (RuntimeError) and what this library raises
    assert issubclass(ProcessGroupError, RuntimeError) and issubclass(ProcessGroupError, ValueError)


def test_a_ring_of_one_and_a_rank_outside_the_group(pools):
    spec = Spec("documents", (20, 20), seed=7)
    results = pools(2).run(subgroup, spec)
    want = _reference(spec)["out"]
    np.testing.assert_allclose(results[0]["out"], want, rtol=0, atol=1e-5)  # the fp32 rule
    assert "not a member of the given group" in results[1]["error"]
    assert "Received: global rank 1" in results[1]["error"]


def _all_raise(pool, spec, per_rank, kind, pattern):
    outcomes = pool.outcomes(call_with, spec, per_rank)
    for rank, err in enumerate(outcomes):
        assert isinstance(err, kind), (rank, err)
        with pytest.raises(kind, match=pattern):
            raise err


SPEC = Spec("causal", (6, 6))


def test_ranks_disagreeing_on_batch_size_all_raise(pools):
    _all_raise(
        pools(2),
        SPEC,
        {1: {"b": 3}},
        ValueError,
        r"the ranks disagree on the batch size B .* Received: B per rank = \[2, 3\]",
    )


def test_ranks_disagreeing_on_heads_all_raise(pools):
    _all_raise(
        pools(2),
        SPEC,
        {0: {"h": 8}},
        ValueError,
        r"disagree on the number of query heads H;.*Received: H per rank = \[8, 4\]",
    )


def test_a_mask_on_some_ranks_only_is_refused(pools):
    _all_raise(
        pools(2),
        SPEC,
        {1: {"no_mask": True}},
        ValueError,
        r"whether a mask is given .* Received: mask per rank = \[True, False\]",
    )


def test_dropout_and_weights_are_refused(pools):
    both = {0: {"kwargs": {"dropout_p": 0.1}}, 1: {"kwargs": {"dropout_p": 0.1}}}
    _all_raise(pools(2), SPEC, both, ValueError, r"computes no dropout.*Received: dropout_p=0.1")
    weights = {0: {"kwargs": {"return_weights": True}}, 1: {"kwargs": {"return_weights": True}}}
    _all_raise(pools(2), SPEC, weights, TypeError, r"unexpected keyword argument 'return_weights'")


def test_one_rank_with_bad_input_stops_every_rank(pools):
    outcomes = pools(2).outcomes(call_with, SPEC, {1: {"kwargs": {"dropout_p": 0.5}}})
    with pytest.raises(ValueError, match=r"computes no dropout"):
        raise outcomes[1]
    with pytest.raises(
        ValueError,
        match=r"rank 1 rejected its inputs .* Received on rank 1: ValueError: context_attention "
        r"computes no dropout",
    ):
        raise outcomes[0]
    outcomes = pools(2).outcomes(call_with, SPEC, {0: {"q_rank": True}})
    with pytest.raises(ValueError, match=r"query must be a 4-D tensor"):
        raise outcomes[0]
    with pytest.raises(ValueError, match=r"rank 0 rejected its inputs"):
        raise outcomes[1]
    # a keyword it does not take fails the call itself, before any communication: on every
    # rank that passes it (the same code passes it on all of them)
    both = {0: {"kwargs": {"is_causal": True}}, 1: {"kwargs": {"is_causal": True}}}
    for outcome in pools(2).outcomes(call_with, SPEC, both):
        with pytest.raises(TypeError, match=r"does not take torch's 'is_causal'"):
            raise outcome


def test_backend_and_device_must_fit():
    with pytest.raises(ValueError, match=r"backend 'nccl' moves cuda tensors.*'gloo'"):
        _check_device("nccl", torch.device("cpu"))
    with pytest.raises(ValueError, match=r"backend 'gloo' moves cpu tensors.*'nccl'"):
        _check_device("gloo", torch.device("cuda", 0))
    with pytest.raises(ValueError, match=r"moves cpu tensors.*Received: tensors on cuda:0"):
        _check_device("cpu:gloo", torch.device("cuda", 0))
    _check_device("cpu:gloo,cuda:nccl", torch.device("cuda", 0))
    _check_device("gloo", torch.device("cpu"))
