"""The child process of ``bench hf``'s first-use rows (``bench.hf.first_use``): the first call
a new user makes, in a new process with an empty cache, before anything was measured, built or
warmed. ``python -m multihead.bench.first_use WHAT LENGTH`` prints one JSON line:

* ``forward``: the Llama-like model's first forward on ``"multihead"`` with
  ``output_attentions``, against eager's with ``output_attentions`` (the median of two after a
  warm-up) in the same process;
* ``capture``: the first ``capture`` of 2 heads of layer 1, its time against the second's and
  its peak memory growth against the captured weights.

Beside the first and second calls' times it reports what each spent on first touches of new
memory: the minor page faults the call took and the system CPU seconds (``getrusage``). On a
virtual machine whose host backs a guest's pages lazily a first touch costs far more than on
bare metal, and only the first call touches that much.
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace

import torch

__all__: list[str] = []  # run as a module: python -m multihead.bench.first_use WHAT LENGTH


def _model(length: int):
    from .hf import VOCAB, WORKLOADS, _build

    model = _build(replace(WORKLOADS[0], length=length))
    ids = torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(5))
    return model, ids


def _clock(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _counted(fn: Callable[[], object], seconds: Callable[[Callable[[], object]], float]) -> dict:
    """``seconds(fn)`` with the minor page faults and system CPU seconds the call took
    ("s", "faults", "sys_s")."""
    before = resource.getrusage(resource.RUSAGE_SELF)
    took = seconds(fn)
    after = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "s": took,
        "faults": after.ru_minflt - before.ru_minflt,
        "sys_s": after.ru_stime - before.ru_stime,
    }


def _first_two(fn: Callable[[], object], first: Callable[[Callable[[], object]], float]) -> dict:
    """The first call timed by ``first``, the second by ``_clock``; each call's time, page
    faults and system seconds, flat ("first_s", "first_faults", ..., "second_sys_s"), and the
    page size ("page_bytes")."""
    found: dict = {"page_bytes": resource.getpagesize()}
    for name, seconds in (("first", first), ("second", _clock)):
        found.update({f"{name}_{key}": value for key, value in _counted(fn, seconds).items()})
    return found


def _forward(length: int) -> dict[str, float | int]:
    import multihead.hf  # noqa: F401  registers "multihead"

    model, ids = _model(length)

    def weights() -> object:
        with torch.inference_mode():
            return model(ids, use_cache=False, output_attentions=True).attentions

    model.set_attn_implementation("multihead")
    found = _first_two(weights, _clock)
    model.set_attn_implementation("eager")
    weights()  # warm-up
    return {**found, "eager_s": statistics.median(_clock(weights) for _ in range(2))}


def _capture(length: int) -> dict[str, float | int]:
    from multihead.hf import capture

    from .hf import peak_growth

    model, ids = _model(length)
    model.set_attn_implementation("multihead")

    def grab() -> object:
        with capture(model, layers=[1], heads=[0, 2]) as cap, torch.inference_mode():
            model(ids, use_cache=False)
        return cap.weights[1]

    measured: dict = {}

    def first(fn: Callable[[], object]) -> float:  # also its peak growth and the weights' size
        start = time.perf_counter()
        growth, found = peak_growth(fn)
        took = time.perf_counter() - start
        measured["growth_bytes"] = float("nan") if growth is None else growth
        measured["captured_bytes"] = found.numel() * found.element_size()
        return took

    return {**_first_two(grab, first), **measured}


if __name__ == "__main__":
    what, length = sys.argv[1], int(sys.argv[2])
    found = _forward(length) if what == "forward" else _capture(length)
    print(json.dumps(found))
