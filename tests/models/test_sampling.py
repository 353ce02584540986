"""How a generation step picks its token (multihead/models/sampling.py): ``greedy`` gives
``argmax``'s index on every row (ties, NaN, -inf, every dtype and layout), and top-k sampling
from the k candidates that ``topk`` reads draws from the same distribution as the whole row
filtered by ``filter_top_k`` and ``filter_top_p`` (the probabilities handed to the draw, put
back at their token ids, are compared)."""

from __future__ import annotations

import pytest
import torch

from multihead.models.sampling import Sampler, _sample, filter_top_k, filter_top_p, greedy

V = 1003  # an odd vocabulary
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def _rows(seed: int, dtype=torch.float32) -> torch.Tensor:
    """(5, V) logits with ties: small integers, so most values repeat within a row."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-40, 40, (5, V), generator=g).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_is_argmax_with_ties(dtype, seed):
    logits = _rows(seed, dtype)
    assert (logits == logits.amax(-1, keepdim=True)).sum(-1).min() > 1  # tied maxima
    assert torch.equal(greedy(logits), logits.argmax(-1))
    assert greedy(logits).dtype == torch.int64


def test_greedy_is_argmax_on_nan_inf_and_strided_rows():
    logits = torch.zeros(6, V)
    logits[0, [5, 7, 900]] = 1.0  # tied maxima: the first
    logits[1] = float("-inf")  # nothing possible: 0, as argmax says
    logits[2, [3, 600]] = float("inf")
    logits[3, [11, 700]] = float("nan")  # NaN counts as the maximum: the first NaN
    logits[4, 12] = float("nan")
    logits[4, 2] = float("inf")
    logits[5, -1] = 3.0
    assert torch.equal(greedy(logits), torch.tensor([5, 0, 3, 11, 12, V - 1]))
    assert torch.equal(greedy(logits), logits.argmax(-1))
    strided = _rows(4).t().contiguous().t()  # a column-major (5, V) view
    assert torch.equal(greedy(strided), strided.argmax(-1))
    assert torch.equal(greedy(_rows(5)[:, ::3]), _rows(5)[:, ::3].argmax(-1))


def test_the_greedy_sampler_takes_greedy():
    logits = _rows(6)
    assert torch.equal(Sampler(False, 1.0, None, None, None)(logits), logits.argmax(-1))


def _drawn_from(monkeypatch, logits, temperature, top_k, top_p) -> torch.Tensor:
    """The probabilities ``_sample`` hands to ``torch.multinomial``, as a (B, V) row of the
    vocabulary (zero where a token cannot be drawn)."""
    seen = []

    def record(probs, n, generator=None):
        seen.append(probs)
        return probs.argmax(-1, keepdim=True)

    monkeypatch.setattr(torch, "multinomial", record)
    tokens = _sample(logits, temperature, top_k, top_p, None)
    (probs,) = seen
    if probs.shape[-1] == logits.shape[-1]:
        return probs
    # a candidate path: the drawn token is the most probable candidate's id
    rows = torch.zeros(logits.shape, dtype=probs.dtype)
    order = torch.topk(logits, probs.shape[-1], dim=-1).indices
    assert torch.equal(tokens, order.gather(-1, probs.argmax(-1, keepdim=True))[:, 0])
    return rows.scatter(-1, order, probs)


def _whole_row(logits, temperature, top_k, top_p) -> torch.Tensor:
    """The distribution written out: the row scaled, filtered, softmaxed (float64)."""
    scores = (logits.double() - logits.double().amax(-1, keepdim=True)) / temperature
    return filter_top_p(filter_top_k(scores, top_k), top_p).softmax(-1)


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, 1, None), (0.7, 5, None), (1.3, 50, None), (0.7, 50, 0.9), (2.0, 17, 0.3)],
    ids=["k1", "k5", "k50", "k50-p0.9", "k17-p0.3"],
)
def test_top_k_draws_from_the_whole_rows_distribution(monkeypatch, temperature, top_k, top_p):
    g = torch.Generator().manual_seed(top_k)
    logits = torch.randn(4, V, generator=g) * 3  # no ties
    got = _drawn_from(monkeypatch, logits, temperature, top_k, top_p)
    want = _whole_row(logits, temperature, top_k, top_p)
    assert (got > 0).sum(-1).max() <= top_k  # only the candidates were drawn from
    assert (got - want).abs().max() <= 1e-12


def test_a_tie_at_the_kth_logit_keeps_every_tied_token(monkeypatch):
    """filter_top_k keeps tokens tied with the k-th (as transformers' warper does): 3 tokens
    share the 2nd-highest logit, so top_k=2 draws from 4."""
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(0))
    logits[:, [10, 20, 30]] = 5.0
    logits[:, 40] = 6.0
    got = _drawn_from(monkeypatch, logits, 1.0, 2, None)
    assert (got > 0).sum(-1).tolist() == [4, 4]
    assert (got - _whole_row(logits, 1.0, 2, None)).abs().max() <= 1e-12


def test_seeded_top_k_sampling_is_reproducible_and_k1_is_greedy():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(1)) * 2

    def sample(seed, **kw):
        return Sampler(True, 1.0, kw.get("top_k"), kw.get("top_p"),
                       torch.Generator().manual_seed(seed))(logits)  # fmt: skip

    assert torch.equal(sample(0, top_k=40, top_p=0.95), sample(0, top_k=40, top_p=0.95))
    draws = torch.stack([sample(s, top_k=40) for s in range(30)])
    assert len(draws.unique()) > 3  # it samples
    assert torch.equal(sample(0, top_k=1), logits.argmax(-1))
