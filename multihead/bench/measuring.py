"""What every benchmark measures with: the machine's matmul peaks (the scale a report gives
its GFLOP/s against) and interleaved timing (each contender warmed up once, then timed in
rotated rounds, so drift in the machine's speed hits every contender alike)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

__all__ = ["interleaved", "matmul_peak", "matmul_peaks"]


# one timed product takes at most about this long: a dtype the CPU has no kernel for (bf16
# on a CPU without AVX512-BF16 or AMX runs at a few GFLOP/s or less) is timed at a smaller size
# instead of spending minutes on five products of the size asked for
PRODUCT_SECONDS = 1.0
_PROBE = 256  # the size that says how fast the dtype is before the size is chosen


def matmul_peak(dtype: torch.dtype, n: int) -> float:
    """GFLOP/s of an n x n matmul, median of 5; where one such product would take over
    ``PRODUCT_SECONDS`` (judged from a 256 x 256 one), of the largest size that does not."""
    size = min(n, _PROBE)
    rate = _median_rate(dtype, size, repeats=1)
    if n > size:  # the size whose product takes PRODUCT_SECONDS at the probe's rate
        fits = int((PRODUCT_SECONDS * rate * 1e9 / 2) ** (1 / 3))
        size = max(size, min(n, fits))
    return _median_rate(dtype, size, repeats=5)


def _median_rate(dtype: torch.dtype, n: int, repeats: int) -> float:
    """GFLOP/s of an n x n matmul in ``dtype``: one warm-up product, the median of ``repeats``."""
    a, bm = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    a @ bm
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        a @ bm
        times.append(time.perf_counter() - t)
    return 2 * n**3 / statistics.median(times) / 1e9


def matmul_peaks(n: int) -> dict[str, float]:
    """``matmul_peak`` in float32 and bfloat16, by dtype name: the peaks a report prints."""
    return {name: matmul_peak(getattr(torch, name), n) for name in ("float32", "bfloat16")}


def interleaved(contenders: dict[str, Callable], repeats: int) -> dict[str, list[float]]:
    """Each contender's wall times: one warm-up call each, then ``repeats`` rounds in a
    rotated order."""
    times: dict[str, list[float]] = {name: [] for name in contenders}
    with torch.inference_mode(False):
        for fn in contenders.values():
            fn()  # warm-up
        names = list(contenders)
        for r in range(repeats):
            # rotate the order so no contender always runs first (right after another's
            # large temporaries were freed) or last
            for name in names[r % len(names) :] + names[: r % len(names)]:
                t = time.perf_counter()
                contenders[name]()
                times[name].append(time.perf_counter() - t)
    return times
