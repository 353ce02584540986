"""The child process of ``bench hf``'s first-use rows (``bench.hf.first_use``): the first call
a new user makes, in a new process with an empty cache, before anything was measured, built or
warmed. ``python -m multihead.bench.first_use WHAT LENGTH`` prints one JSON line:

* ``forward``: the Llama-like model's first forward on ``"multihead"`` with
  ``output_attentions``, against eager's with ``output_attentions`` (the median of two after a
  warm-up) in the same process;
* ``capture``: the first ``capture`` of 2 heads of layer 1, its time against the second's and
  its peak memory growth against the captured weights.
"""

from __future__ import annotations

import json
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


def _forward(length: int) -> dict[str, float]:
    import multihead.hf  # noqa: F401  registers "multihead"

    model, ids = _model(length)

    def weights() -> object:
        with torch.inference_mode():
            return model(ids, use_cache=False, output_attentions=True).attentions

    model.set_attn_implementation("multihead")
    first = _clock(weights)
    second = _clock(weights)
    model.set_attn_implementation("eager")
    weights()  # warm-up
    eager = statistics.median(_clock(weights) for _ in range(2))
    return {"first_s": first, "second_s": second, "eager_s": eager}


def _capture(length: int) -> dict[str, float]:
    from multihead.hf import capture

    from .hf import peak_growth

    model, ids = _model(length)
    model.set_attn_implementation("multihead")

    def grab() -> object:
        with capture(model, layers=[1], heads=[0, 2]) as cap, torch.inference_mode():
            model(ids, use_cache=False)
        return cap.weights[1]

    start = time.perf_counter()
    growth, found = peak_growth(grab)
    first = time.perf_counter() - start
    captured = found.numel() * found.element_size()
    del found
    second = _clock(grab)
    return {
        "first_s": first,
        "second_s": second,
        "growth_bytes": float("nan") if growth is None else growth,
        "captured_bytes": captured,
    }


if __name__ == "__main__":
    what, length = sys.argv[1], int(sys.argv[2])
    found = _forward(length) if what == "forward" else _capture(length)
    print(json.dumps(found))
