"""``auto``'s timing of one backend against another (``backends/_measure.compare``): calls of
tens of microseconds are timed in several alternating rounds, so a burst of other work in one
round cannot hand the process to the slower backend; long calls are timed once."""

from __future__ import annotations

from multihead.backends import _measure


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
