"""Attention sinks on hand-made weights: which positions and heads are found, and the weights
and rollout with them set aside, against float64 formulas written here."""

from __future__ import annotations

import pytest
import torch

from multihead.inspect import find_sinks, rollout, without_sinks

L = 7  # odd on purpose


def _rows(*rows: list[float]) -> torch.Tensor:
    w = torch.tensor(rows, dtype=torch.float64)
    return w / w.sum(-1, keepdim=True)


def _weights(seed: int, layers: int = 3, heads: int = 5, causal: bool = False) -> torch.Tensor:
    """Random rows that sum to 1 (causal: nothing above the diagonal)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(layers, heads, L, L, generator=g, dtype=torch.float64)
    if causal:
        w = w.tril()
    return w / w.sum(-1, keepdim=True)


def _park(w: torch.Tensor, layer: int, heads: list[int], key: int, share: float) -> None:
    """Make ``heads`` of ``layer`` put ``share`` of every row on ``key``, the rest spread as
    before (a row that saw only ``key`` puts all on it)."""
    for h in heads:
        rest = w[layer, h].clone()
        rest[:, key] = 0
        rest = rest / rest.sum(-1, keepdim=True).clamp_min(1e-300)
        w[layer, h] = (1 - share) * rest
        w[layer, h, :, key] = share
        w[layer, h] /= w[layer, h].sum(-1, keepdim=True)


def _without_reference(w: torch.Tensor, positions: list[int]) -> torch.Tensor:
    """Row by row, key by key, in float64."""
    out = torch.zeros_like(w, dtype=torch.float64)
    flat, res = w.reshape(-1, L).double(), out.view(-1, L)
    for r in range(flat.shape[0]):
        total = sum(float(flat[r, k]) for k in range(L) if k not in positions)
        for k in range(L):
            if k not in positions and total > 0:
                res[r, k] = float(flat[r, k]) / total
    return out


def _rollout_reference(w: torch.Tensor, positions: list[int], residual: float) -> torch.Tensor:
    result = torch.eye(L, dtype=torch.float64)
    for layer in w.double():
        mean = sum(layer[h] for h in range(layer.shape[0])) / layer.shape[0]
        clean = _without_reference(mean, positions)
        for row in range(L):
            if clean[row].sum() == 0:  # all on sinks: the row stays where it is
                clean[row, row] = 1.0
        a = residual * torch.eye(L, dtype=torch.float64) + (1 - residual) * clean
        a = a / a.sum(-1, keepdim=True)
        result = a @ result
    return result


def test_first_and_special_positions_are_sinks_and_nothing_else_on_spread_weights():
    w = _weights(0)
    sinks = find_sinks(w, special=[1, 0, 0, 0, 0, 0, 1])
    assert sinks.positions == (0, 6)
    assert sinks.reasons == ("the first token, a special token", "a special token")
    assert find_sinks(w).positions == (0,)  # the first token always
    # mass: each head's mean share of a row on the sinks, here columns 0 and 6
    torch.testing.assert_close(sinks.mass, (w[..., 0] + w[..., 6]).mean(-1).float())
    assert not sinks.heads.any()  # random rows put about 2/7 there, under a half


def test_a_key_most_heads_park_on_is_found_in_its_layer():
    w = _weights(1)
    _park(w, 1, [0, 2, 4], key=3, share=0.8)  # 3 of 5 heads: most
    _park(w, 2, [1, 3], key=5, share=0.9)  # 2 of 5: not most
    sinks = find_sinks(w, share=0.5)
    assert sinks.positions == (0, 3)
    assert sinks.reasons[1] == "at least 50% of the weight of most rows in most heads of layer 1"
    # the parking heads are sink heads: 0.8 of every row on key 3, plus their share on key 0
    assert sinks.heads[1].tolist() == [True, False, True, False, True]
    assert sinks.heads.sum() == 3
    # a higher threshold than the heads give finds key 3 no more
    assert find_sinks(w, share=0.85).positions == (0,)


def test_reasons_name_the_layers_in_spans():
    w = _weights(7, layers=6)
    for layer in (0, 1, 2, 4):
        _park(w, layer, [0, 1, 2], key=5, share=0.9)
    sinks = find_sinks(w)
    assert sinks.positions == (0, 5)
    assert sinks.reasons[1].endswith("most heads of layers 0-2, 4")


def test_sink_heads_by_share():
    w = _weights(2, layers=1, heads=2)
    w[0, 0] = 0
    w[0, 0, :, 0] = 1.0  # all on the first token
    sinks = find_sinks(w, share=0.5)
    assert sinks.heads.tolist() == [[True, False]]
    assert sinks.mass[0, 0].item() == 1.0
    assert sinks.share == 0.5


def test_causal_rows_count_among_all_rows():
    """In a causal model key 4 of 7 is seen by 3 rows: never most, even when each gives it all."""
    w = _weights(3, causal=True)
    _park(w, 0, list(range(5)), key=4, share=0.7)
    w = w.tril()
    w = w / w.sum(-1, keepdim=True)
    assert find_sinks(w).positions == (0,)
    w2 = _weights(3, causal=True)
    _park(w2, 0, list(range(5)), key=2, share=0.7)  # seen by rows 2..6: 5 of 7
    w2 = w2.tril()
    w2 = w2 / w2.sum(-1, keepdim=True)
    assert find_sinks(w2).positions == (0, 2)


@pytest.mark.parametrize("positions", [[0], [0, 6], [2, 3, 5]], ids=["first", "ends", "inner"])
def test_without_sinks_against_reference(positions):
    w = _weights(4, causal=True).float()
    got = without_sinks(w, positions)
    assert got.dtype == torch.float32 and got.shape == w.shape
    want = _without_reference(w, positions)
    assert (got.double() - want).abs().max() <= 1e-6
    assert (got[..., positions] == 0).all()
    # causal row 0 sees only key 0: all 0 once key 0 is set aside; every other row sums to 1
    sums = got.sum(-1).double()
    for row in range(L):
        seen = [k for k in range(row + 1) if k not in positions]
        expected = 1.0 if seen else 0.0
        assert (sums[..., row] - expected).abs().max() <= 1e-6, row


def test_without_no_sinks_is_the_weights():
    w = _weights(5)
    torch.testing.assert_close(without_sinks(w, []), w)


@pytest.mark.parametrize("residual", [0.5, 0.0, 0.3])
def test_rollout_without_sinks_against_reference(residual):
    w = _weights(6, causal=True)
    _park(w, 0, [0, 1, 2], key=0, share=0.95)
    got = rollout(w, residual=residual, sinks=[0])
    want = _rollout_reference(w, [0], residual)
    assert (got.double() - want).abs().max() <= 1e-6
    torch.testing.assert_close(got.sum(-1), torch.ones(L))
    assert (got[1:, 0] == 0).all()  # the sink keeps no share of any other position
    # the raw rollout is the same formula without the removal
    raw = rollout(w, residual=residual)
    assert raw[1:, 0].min() > got[1:, 0].max()
    assert (rollout(w, residual=residual, sinks=[]) - raw).abs().max() <= 1e-6


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (
            lambda: find_sinks(_weights(0), share=0.0),
            r"share must be in \(0, 1\]. Received: share=0.0",
        ),
        (lambda: find_sinks(_weights(0), share=1.5), r"Received: share=1.5"),
        (lambda: find_sinks(_weights(0), special=[True]), r"one flag per token, shape \(7,\)"),
        (lambda: without_sinks(_weights(0), [7]), r"in \[0, 7\). Received: positions=\[7\]"),
        (lambda: rollout(_weights(0), sinks=[-1]), r"Received: positions=\[-1\]"),
    ],
    ids=["share0", "share_big", "special", "position", "rollout_position"],
)
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()
