"""Head statistics and rollout on hand-made weights with known answers."""

from __future__ import annotations

import math

import pytest
import torch

from multihead.inspect import for_text, head_stats, rollout, top_tokens

N = 6


def _previous_head() -> torch.Tensor:
    """Every token puts all weight on the token before it; the first on the second."""
    w = torch.zeros(N, N)
    w[0, 1] = 1.0
    for i in range(1, N):
        w[i, i - 1] = 1.0
    return w


def test_previous_token_head():
    stats = head_stats(_previous_head()[None])  # (H=1, L, L)
    assert stats.entropy.shape == (1, 1)
    assert stats.entropy.item() == 0.0
    assert stats.distance.item() == 1.0
    assert stats.previous.item() == pytest.approx(1.0)  # every query with a previous token
    assert stats.next.item() == pytest.approx(1 / (N - 1))  # only query 0 looks ahead
    assert stats.itself.item() == 0.0


def test_uniform_self_and_special_heads():
    uniform = torch.full((N, N), 1 / N)
    itself = torch.eye(N)
    on_cls = torch.zeros(N, N)
    on_cls[:, 0] = 1.0
    stats = head_stats(torch.stack([uniform, itself, on_cls])[None], special=[1, 0, 0, 0, 0, 1])
    assert stats.entropy.shape == (1, 3)
    assert stats.entropy[0, 0].item() == pytest.approx(math.log(N))
    # mean |i - j| over all pairs of 6 positions: sum over d of 2 (6 - d) d / 36 = 70 / 36
    assert stats.distance[0, 0].item() == pytest.approx(70 / 36)
    assert stats.distance[0, 1].item() == 0.0 and stats.itself[0, 1].item() == 1.0
    assert stats.special[0, 0].item() == pytest.approx(2 / N)
    assert stats.special[0, 2].item() == 1.0
    # all on token 0: distance is the mean position, 15 / 6
    assert stats.distance[0, 2].item() == pytest.approx(15 / 6)
    assert set(stats.as_dict()) == {"entropy", "distance", "special", "itself", "previous", "next"}


def test_top_tokens():
    w = torch.stack([_previous_head(), torch.eye(N)])[None]  # 1 layer, 2 heads
    tokens = ["[CLS]", "the", "cat", "sat", ".", "[SEP]"]
    top = top_tokens(w, tokens, query=3, k=2)
    assert top[0][0][0] == (2, "cat", 1.0)
    assert top[0][1][0] == (3, "sat", 1.0)
    assert len(top[0][0]) == 2
    with pytest.raises(ValueError, match=r"query must be a position in \[0, 6\)"):
        top_tokens(w, tokens, query=6)
    with pytest.raises(ValueError, match=r"one label per position \(6\)"):
        top_tokens(w, tokens[:3], query=0)


def test_rollout_by_hand():
    """Two layers, two tokens, one head each, residual 0.5:
    A1 = [[1, 0], [1, 0]] -> A1' = [[1, 0], [.5, .5]];
    A2 = [[0, 1], [0, 1]] -> A2' = [[.5, .5], [0, 1]];
    R = A2' A1' = [[.75, .25], [.5, .5]]."""
    a1 = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    a2 = torch.tensor([[0.0, 1.0], [0.0, 1.0]])
    r = rollout(torch.stack([a1[None], a2[None]]))
    torch.testing.assert_close(r, torch.tensor([[0.75, 0.25], [0.5, 0.5]]))
    # heads are averaged before the residual: two heads that disagree make a uniform layer
    both = torch.stack([torch.stack([a1, a2])])
    torch.testing.assert_close(rollout(both, residual=0.0), torch.full((2, 2), 0.5))


def test_rollout_rows_sum_to_one_and_identity_without_attention():
    torch.manual_seed(0)
    w = torch.rand(3, 4, 5, 5)
    w = w / w.sum(-1, keepdim=True)
    torch.testing.assert_close(rollout(w).sum(-1), torch.ones(5))
    torch.testing.assert_close(rollout(w, residual=1.0), torch.eye(5))


def test_for_text_cuts_padding():
    weights = [torch.rand(2, 3, 7, 7) for _ in range(4)]
    got = for_text(weights, 1, 5)
    assert got.shape == (4, 3, 5, 5)
    torch.testing.assert_close(got[2], weights[2][1, :, :5, :5])


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: head_stats(torch.rand(4, 4)), r"\(layers, H, L, L\) or \(H, L, L\)"),
        (lambda: head_stats(torch.rand(2, 4, 5)), "square in the last two dimensions"),
        (lambda: head_stats(torch.rand(2, 4, 4), special=[True]), r"shape \(4,\)"),
        (lambda: rollout(torch.rand(1, 1, 2, 2), residual=2.0), r"residual must be in \[0, 1\]"),
        (lambda: for_text([], 0, 1), "at least one layer"),
    ],
    ids=["rank", "square", "special", "residual", "empty"],
)
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()
