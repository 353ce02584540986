"""The first call a new user makes, in a new process with an empty cache (``bench hf``'s
first-use rows): what a fresh install gives before anything was measured, built or warmed.

Each measurement runs ``python -m multihead.bench.first_use WHAT LENGTH`` in a child process
whose home and cache folders are new and empty, so the kernel comes from the installation and
``auto`` measures its first shape classes then and there:

* ``forward``: the Llama-like model's first forward on ``"multihead"`` with
  ``output_attentions``, against eager's with ``output_attentions`` (the median of two after a
  warm-up) in the same process;
* ``capture``: the first ``capture`` of 2 heads of layer 1, its time against the second's and
  its peak memory growth against the captured weights.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

__all__ = ["GOALS", "first_use"]

# (name, figure): >= for the speedup over eager, <= for the ratios
GOALS = {
    "forward": "first forward with output_attentions >= 5.0x faster than eager's",
    "capture_time": "first capture of 2 heads <= 1.3x the time of the second",
    "capture_memory": "first capture's peak memory growth <= 1.5x the captured weights",
}


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


def _child(what: str, length: int) -> dict[str, Any]:
    """Run one measurement in a new process with a new, empty home and cache."""
    with tempfile.TemporaryDirectory(prefix="multihead-first-use-") as home:
        env = {k: v for k, v in os.environ.items() if k != "MULTIHEAD_EXTENSION_DIR"}
        env.update(HOME=home, XDG_CACHE_HOME=os.path.join(home, ".cache"))
        env.pop("MULTIHEAD_FUSED_AUTO", None)  # auto's measured choice, as a user gets it
        done = subprocess.run(
            [sys.executable, "-m", "multihead.bench.first_use", what, str(length)],
            capture_output=True,
            text=True,
            env=env,
            timeout=1800,
        )
    if done.returncode != 0:
        raise RuntimeError(f"the first-use {what} run failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def first_use(forward_length: int, capture_length: int, say: Callable[[str], None]) -> dict:
    """Both first-use measurements, each in a new process, with their goals said."""
    forward = _child("forward", forward_length)
    capture = _child("capture", capture_length)
    speedup = forward["eager_s"] / forward["first_s"]
    time_ratio = capture["first_s"] / capture["second_s"]
    memory_ratio = capture["growth_bytes"] / capture["captured_bytes"]
    goals = [
        {"text": GOALS["forward"], "figure": speedup, "met": speedup >= 5.0},
        {"text": GOALS["capture_time"], "figure": time_ratio, "met": time_ratio <= 1.3},
        {"text": GOALS["capture_memory"], "figure": memory_ratio, "met": memory_ratio <= 1.5},
    ]
    say(f"\nfirst use, a new process with an empty cache (Llama-like, L={forward_length}):")
    say(
        f"  first multihead forward with output_attentions {forward['first_s'] * 1e3:8.1f} ms,"
        f" second {forward['second_s'] * 1e3:8.1f} ms, eager {forward['eager_s'] * 1e3:8.1f} ms"
    )
    say(
        f"  first capture of 2 heads at L={capture_length} {capture['first_s'] * 1e3:8.1f} ms, "
        f"second {capture['second_s'] * 1e3:8.1f} ms; peak growth "
        f"{capture['growth_bytes'] / 2**20:.0f} MiB for {capture['captured_bytes'] / 2**20:.0f}"
        " MiB captured"
    )
    for g in goals:
        say(f"  goal {g['text']}: {g['figure']:.2f} -> {'met' if g['met'] else 'MISSED'}")
    return {"forward": forward, "capture": capture, "goals": goals}


if __name__ == "__main__":
    what, length = sys.argv[1], int(sys.argv[2])
    found = _forward(length) if what == "forward" else _capture(length)
    print(json.dumps(found))
