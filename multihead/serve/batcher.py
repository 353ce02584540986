"""Micro-batching: concurrent embedding requests gathered into one model call.

A batch closes when its tokens would pass ``max_batch_tokens`` or when its oldest request has
waited ``max_wait_ms``. The model runs on one worker thread, never on the event loop; while it
runs, new requests queue up and form the next batch, so under load batches fill without any
waiting at all.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

__all__ = ["MicroBatcher"]


@dataclass(eq=False)  # jobs are found in the queue by identity: two may hold the same ids
class _Job:
    ids: Sequence[Sequence[int]]
    tokens: int
    future: asyncio.Future
    arrived: float = field(default_factory=time.monotonic)


class MicroBatcher:
    """Gathers ``submit`` calls into batches for ``run``.

    Args:
        run: the model call, (N sequences of token ids) -> (N, E) array, run on ``executor``.
        executor: the single model thread (shared with other model work such as attention).
        max_batch_tokens: most tokens in one batch; a larger request runs as a batch of its own.
        max_wait_ms: how long the oldest waiting request may wait for company.
        on_batch: called with (texts, tokens) of every batch that runs (metrics).
    """

    def __init__(
        self,
        run: Callable[[list[Sequence[int]]], np.ndarray],
        executor: ThreadPoolExecutor,
        *,
        max_batch_tokens: int,
        max_wait_ms: float,
        on_batch: Callable[[int, int], None] | None = None,
    ) -> None:
        self._run, self._executor = run, executor
        self.max_batch_tokens, self.max_wait = max_batch_tokens, max_wait_ms / 1000.0
        self._on_batch = on_batch
        self._pending: deque[_Job] = deque()
        self._pending_tokens = 0
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._closing = False
        self._expired: Callable[[], BaseException] | None = None

    @property
    def queued(self) -> int:
        """Requests waiting for a batch (not counting the one running)."""
        return len(self._pending)

    def start(self) -> None:
        """Start the batching task on the running event loop."""
        self._wake = asyncio.Event()
        self._closing = False
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        """Finish every queued request, then end the batching task."""
        if self._task is None:
            return
        self._closing = True
        self._wake.set()
        await self._task
        self._task = None

    def expire(self, error: Callable[[], BaseException]) -> None:
        """Fail every queued request with a fresh ``error()`` now, and every later ``submit``
        too (the drain deadline of a shutdown). The batch already in the model finishes."""
        self._expired = error
        while self._pending:
            job = self._pending.popleft()
            if not job.future.done():
                job.future.set_exception(error())
        self._pending_tokens = 0

    async def submit(self, ids: Sequence[Sequence[int]]) -> np.ndarray:
        """Embed these sequences as part of some batch; (len(ids), E) in the same order.

        Cancelling the caller (its client went away) takes the request out of the queue, so
        the model never computes it."""
        if self._expired is not None:
            raise self._expired()
        if self._task is None or self._closing:
            raise RuntimeError("the batcher is not running (start() it inside the app's lifespan)")
        job = _Job(ids, sum(len(s) for s in ids), asyncio.get_running_loop().create_future())
        self._pending.append(job)
        self._pending_tokens += job.tokens
        self._wake.set()
        try:
            return await job.future
        except asyncio.CancelledError:
            if job in self._pending:  # still queued: nobody will want its rows
                self._pending.remove(job)
                self._pending_tokens -= job.tokens
            raise

    async def _loop(self) -> None:
        while True:
            while not self._pending:
                if self._closing:
                    return
                self._wake.clear()
                await self._wake.wait()
            await self._gather()
            if not self._pending:  # every waiting client left while the batch gathered
                continue
            batch = self._take()
            try:
                vectors = await asyncio.get_running_loop().run_in_executor(
                    self._executor, self._run, [s for job in batch for s in job.ids]
                )
            except Exception as err:  # a failed model call fails its requests, not the loop
                for job in batch:
                    if not job.future.done():
                        job.future.set_exception(err)
                continue
            if self._on_batch is not None:
                self._on_batch(sum(len(job.ids) for job in batch), sum(j.tokens for j in batch))
            start = 0
            for job in batch:
                if not job.future.done():  # a client that went away cancelled its future
                    job.future.set_result(vectors[start : start + len(job.ids)])
                start += len(job.ids)

    async def _gather(self) -> None:
        """Wait until the batch is full or its oldest request has waited ``max_wait``."""
        deadline = self._pending[0].arrived + self.max_wait
        while self._pending_tokens < self.max_batch_tokens and not self._closing:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), left)
            except TimeoutError:
                return

    def _take(self) -> list[_Job]:
        batch = [self._pending.popleft()]  # always at least one, however large
        tokens = batch[0].tokens
        while self._pending and tokens + self._pending[0].tokens <= self.max_batch_tokens:
            job = self._pending.popleft()
            batch.append(job)
            tokens += job.tokens
        self._pending_tokens -= tokens
        return batch
