"""A group of spawned processes joined by a gloo process group, kept for many tests.

Starting a process that imports torch costs seconds, so a test module starts one group and
sends it tasks: a picklable function ``fn(rank, world, *args)`` runs on every rank and each
rank's return value (or exception) comes back. Rendezvous goes through a file in a temporary
folder (nothing listens on a port); every wait is bounded, and ``close`` ends the processes it
started.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
from datetime import timedelta
from pathlib import Path

TASK_TIMEOUT_S = 120  # a deadlock fails the test instead of hanging the suite
START_TIMEOUT_S = 120  # spawning P interpreters that import torch on a loaded 2-core machine


def _serve(rank: int, world: int, init: str, tasks, results) -> None:
    import torch
    import torch.distributed as dist

    # one thread each: P processes share the machine's cores
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=init,
        rank=rank,
        world_size=world,
        # collectives that wait on a rank that failed give up instead of hanging
        timeout=timedelta(seconds=TASK_TIMEOUT_S),
    )
    results.put((rank, "ready", None))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args = task
        try:
            results.put((rank, "ok", fn(rank, world, *args)))
        except Exception as err:  # sent back and re-raised by the test
            results.put((rank, "error", err))
    dist.destroy_process_group()
    # leave without the interpreter's teardown of torch (seconds per process); the results
    # already sent are flushed first
    results.close()
    results.join_thread()
    os._exit(0)


class Pool:
    """``world`` processes in one gloo group; ``run`` executes a function on all of them."""

    def __init__(self, world: int, folder: Path) -> None:
        ctx = mp.get_context("spawn")
        self.world = world
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world)]
        init = (Path(folder) / "rendezvous").resolve().as_uri()
        self.procs = [
            ctx.Process(
                target=_serve, args=(r, world, init, self.tasks[r], self.results), daemon=True
            )
            for r in range(world)
        ]
        for p in self.procs:
            p.start()
        try:
            self._collect(START_TIMEOUT_S)
        except BaseException:
            self.close()
            raise

    def _collect(self, timeout: float) -> list[tuple[str, object]]:
        deadline = time.monotonic() + timeout
        out: list[tuple[str, object] | None] = [None] * self.world
        for _ in range(self.world):
            remaining = deadline - time.monotonic()
            try:
                rank, status, value = self.results.get(timeout=max(remaining, 0.01))
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                raise TimeoutError(
                    f"ranks did not answer within {timeout} s (dead: {dead})"
                ) from None
            out[rank] = (status, value)
        return out

    def outcomes(self, fn, *args) -> list[object]:
        """Each rank's return value, or the exception it raised."""
        for q in self.tasks:
            q.put((fn, args))
        return [value for _, value in self._collect(TASK_TIMEOUT_S)]

    def run(self, fn, *args) -> list[object]:
        """Each rank's return value; the first rank's exception is raised if any failed."""
        results = self.outcomes(fn, *args)
        for value in results:
            if isinstance(value, Exception):
                raise value
        return results

    def stop(self) -> None:
        """Ask every rank to leave the group and exit (``close`` waits for them)."""
        for q in self.tasks:
            q.put(None)
        self.tasks = []

    def close(self) -> None:
        self.stop()
        for p in self.procs:
            p.join(timeout=20)
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
