"""The micro-batcher on its own: who shares a batch, how long a lone request waits, what a
failed model call does, and that stopping finishes the queue. The model call here maps each
sequence to (its length, its first id), so every answer can be checked against its request."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from multihead.serve.batcher import MicroBatcher


def _describe(sequences):
    return np.array([[len(s), s[0]] for s in sequences], dtype=np.float32)


def _batcher(run=_describe, **kwargs) -> tuple[MicroBatcher, list[list[int]], ThreadPoolExecutor]:
    sizes: list[list[int]] = []

    def recorded(sequences):
        sizes.append([len(s) for s in sequences])
        return run(sequences)

    pool = ThreadPoolExecutor(1)
    return MicroBatcher(recorded, pool, **kwargs), sizes, pool


def test_requests_arriving_together_share_a_batch_within_the_budget():
    async def main():
        batcher, sizes, pool = _batcher(max_batch_tokens=10, max_wait_ms=200)
        batcher.start()
        jobs = [[[i] * 3] for i in range(5)]  # five requests of one 3-token sequence
        jobs.append([[7] * 4, [8] * 2])  # one request of two sequences, 6 tokens
        answers = await asyncio.gather(*(batcher.submit(j) for j in jobs))
        await batcher.stop()
        pool.shutdown()
        return jobs, answers, sizes

    jobs, answers, sizes = asyncio.run(main())
    for job, answer in zip(jobs, answers):
        np.testing.assert_array_equal(answer, _describe(job))  # each gets its own rows
    # a full budget closes a batch at once; a request never splits across batches
    assert sizes == [[3, 3, 3], [3, 3], [4, 2]]


def test_a_lone_request_waits_at_most_max_wait():
    async def main():
        batcher, sizes, pool = _batcher(max_batch_tokens=1000, max_wait_ms=80)
        batcher.start()
        start = time.monotonic()
        await batcher.submit([[1, 2]])
        waited = time.monotonic() - start
        await batcher.stop()
        pool.shutdown()
        return waited, sizes

    waited, sizes = asyncio.run(main())
    assert sizes == [[2]]
    assert 0.07 <= waited < 5  # it waited for company for about 80 ms, not forever


def test_a_request_larger_than_the_budget_runs_alone():
    async def main():
        batcher, sizes, pool = _batcher(max_batch_tokens=4, max_wait_ms=0)
        batcher.start()
        answer = await batcher.submit([[5] * 9])
        await batcher.stop()
        pool.shutdown()
        return answer, sizes

    answer, sizes = asyncio.run(main())
    assert sizes == [[9]] and answer.tolist() == [[9, 5]]


def test_a_failed_model_call_fails_its_requests_and_the_next_batch_still_runs():
    def fragile(sequences):
        if any(s[0] == 13 for s in sequences):
            raise RuntimeError("unlucky batch")
        return _describe(sequences)

    async def main():
        batcher, _, pool = _batcher(fragile, max_batch_tokens=100, max_wait_ms=0)
        batcher.start()
        with pytest.raises(RuntimeError, match="unlucky batch"):
            await batcher.submit([[13]])
        answer = await batcher.submit([[4, 4]])
        await batcher.stop()
        pool.shutdown()
        return answer

    assert asyncio.run(main()).tolist() == [[2, 4]]


def test_stop_finishes_the_queue_then_refuses_new_work():
    async def main():
        batcher, sizes, pool = _batcher(max_batch_tokens=2, max_wait_ms=1000)
        batcher.start()
        pending = [asyncio.ensure_future(batcher.submit([[i, i]])) for i in range(3)]
        await asyncio.sleep(0)  # all three are queued
        await batcher.stop()  # does not wait out max_wait: it flushes
        answers = [p.result() for p in pending]
        with pytest.raises(RuntimeError, match="the batcher is not running"):
            await batcher.submit([[1]])
        pool.shutdown()
        return answers, sizes

    answers, sizes = asyncio.run(main())
    assert [a.tolist() for a in answers] == [[[2, 0]], [[2, 1]], [[2, 2]]]
    assert sizes == [[2], [2], [2]]


def test_a_cancelled_request_leaves_the_queue_and_never_runs():
    """A request whose client left is cancelled by the app: its sequences must not be part of
    any later batch (before, the batcher still computed them), and an identical request that
    stays is not confused with it."""

    async def main():
        batcher, sizes, pool = _batcher(max_batch_tokens=100, max_wait_ms=200)
        batcher.start()
        leaving = asyncio.ensure_future(batcher.submit([[9] * 5]))
        staying = asyncio.ensure_future(batcher.submit([[9] * 5]))
        await asyncio.sleep(0)
        assert batcher.queued == 2
        leaving.cancel()
        await asyncio.sleep(0)
        queued = batcher.queued
        answer = await staying
        await batcher.stop()
        pool.shutdown()
        return queued, answer, sizes

    queued, answer, sizes = asyncio.run(main())
    assert queued == 1 and sizes == [[5]] and answer.tolist() == [[5, 9]]


def test_expire_fails_the_queue_and_later_requests():
    async def main():
        batcher, sizes, pool = _batcher(max_batch_tokens=100, max_wait_ms=1000)
        batcher.start()
        pending = [asyncio.ensure_future(batcher.submit([[i]])) for i in range(3)]
        await asyncio.sleep(0)
        batcher.expire(lambda: LookupError("past the deadline"))
        errors = await asyncio.gather(*pending, return_exceptions=True)
        with pytest.raises(LookupError, match="past the deadline"):
            await batcher.submit([[1]])
        await batcher.stop()
        pool.shutdown()
        return errors, sizes

    errors, sizes = asyncio.run(main())
    assert [str(e) for e in errors] == ["past the deadline"] * 3
    assert len({id(e) for e in errors}) == 3 and sizes == []  # one error each, no model call
