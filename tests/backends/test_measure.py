"""``auto``'s timing of one backend against another (``backends/_measure.compare``): calls of
tens of microseconds are timed in several alternating rounds, so a burst of other work in one
round cannot hand the process to the slower backend; long calls are timed once. What is timed
is a proxy of the call (``_measure.proxy``): some of its rows, exactly as the call computes
them."""

from __future__ import annotations

import pytest
import torch
from helpers import MASK_KINDS, make_case, qkv

import multihead as mh
from multihead import masks
from multihead.backends import _measure, registry
from multihead.backends.call import prepare


def _scripted(times: dict[str, list[float]], order: list[str]):
    """A clock that returns each side's next scripted time and records who was timed."""

    def clock(fn) -> float:
        side = fn()
        order.append(side)
        return times[side].pop(0)

    return clock


def test_short_calls_are_timed_in_alternating_rounds():
    # the kernel's first round was stalled (a burst on the other core): 300 us against 150 us
    times = {"mine": [300e-6, 50e-6, 51e-6, 49e-6, 52e-6], "rival": [150e-6] * 5}
    order: list[str] = []
    faster = _measure.compare(lambda: "mine", lambda: "rival", clock=_scripted(times, order))
    assert faster  # its best of the rounds, 49 us, is below 0.9 x 150 us
    assert order == ["mine", "rival"] * _measure.ROUNDS
    assert times == {"mine": [], "rival": []}


def test_a_slower_candidate_stays_slower_over_the_rounds():
    times = {"mine": [140e-6] * 5, "rival": [150e-6, 400e-6, 150e-6, 150e-6, 150e-6]}
    order: list[str] = []
    assert not _measure.compare(lambda: "mine", lambda: "rival", clock=_scripted(times, order))
    assert len(order) == 2 * _measure.ROUNDS


def test_rounds_stay_within_the_short_call_budget():
    # a round of 2 ms: two rounds fit in 5 ms
    times = {"mine": [1e-3, 1e-3, 1e-3], "rival": [1e-3, 1e-3, 1e-3]}
    order: list[str] = []
    _measure.compare(lambda: "mine", lambda: "rival", clock=_scripted(times, order))
    assert order == ["mine", "rival"] * 2


def test_long_calls_are_timed_once():
    times = {"mine": [0.02], "rival": [0.03]}
    order: list[str] = []
    assert _measure.compare(lambda: "mine", lambda: "rival", clock=_scripted(times, order))
    assert order == ["mine", "rival"]


@pytest.mark.parametrize("kind", MASK_KINDS)
def test_a_proxy_computes_the_calls_own_rows(kind):
    """The proxy is the middle PROXY_ROWS query rows against the keys they can see: run on
    its own, it gives exactly those rows of the whole call (float64, the reference
    backend, to float64 rounding), for every mask kind, with a bias cropped alongside."""
    b, h, length = 2, 2, 600
    q, k, v = qkv(b, h, h, length, length, 8, dtype=torch.float64, seed=4)
    case = make_case(kind, b, h, length, length)
    bias = torch.randn(b, h, length, length, dtype=torch.float64)
    call = prepare(q, k, v, case.mask, bias, None, 0.0, False)
    part = _measure.proxy(call)
    q0 = (length - _measure.PROXY_ROWS) // 2
    assert torch.equal(part.query, q[:, :, q0 : q0 + _measure.PROXY_ROWS])
    whole = mh.attention(q, k, v, case.mask, bias=bias, backend="reference")
    rows = registry.BACKENDS["reference"].run(part)[0]
    # float64: a product over fewer keys rounds its sums in another order (600 terms, 1e-16)
    torch.testing.assert_close(rows, whole[:, :, q0 : q0 + _measure.PROXY_ROWS], rtol=0, atol=1e-13)


PACKED = torch.arange(12).repeat_interleave(100)  # 12 documents of 100 tokens
NARROWING = {
    "documents": (masks.documents(torch.stack([PACKED, PACKED])), True),
    "documents&causal": (masks.documents(PACKED) & masks.causal(), True),
    "window": (masks.sliding_window(64), True),
    "causal": (masks.causal(), False),
}


@pytest.mark.parametrize("kind", list(NARROWING))
def test_a_proxy_keeps_only_the_keys_its_rows_see(kind):
    """Keys no proxy row can see are cut away (packed documents: a few documents of the
    call's many), and none that one of them sees."""
    mask, narrow = NARROWING[kind]
    b, h, length = 2, 2, 1200
    q, k, v = qkv(b, h, h, length, length, 4, seed=5)
    part = _measure.proxy(prepare(q, k, v, mask, None, None, 0.0, False))
    q0 = (length - _measure.PROXY_ROWS) // 2
    keep = mask.to_dense(length, length)[..., q0 : q0 + _measure.PROXY_ROWS, :]
    seen = keep.reshape(-1, length).any(dim=0).nonzero()
    first, last = int(seen.min()), int(seen.max()) + 1
    assert part.key.shape[2] == part.value.shape[2] == last - first
    assert torch.equal(part.key, k[:, :, first:last])
    assert torch.equal(part.value, v[:, :, first:last])
    assert (part.key.shape[2] < length // 2) == narrow


def test_a_proxy_of_an_unmasked_call_keeps_every_key():
    q, k, v = qkv(1, 2, 2, 700, 900, 4)
    part = _measure.proxy(prepare(q, k, v, None, None, None, 0.0, False))
    assert part.key.shape[2] == part.value.shape[2] == 900
