"""``--precision auto``: train under bf16 autocast only where it makes this model's training
step faster on this machine, measured, not guessed from CPU flags.

An Intel Xeon with AVX512-BF16 but no AMX runs a bf16 matmul at about 0.6x its fp32 speed, so
bf16 autocast can only slow training there; a CPU with AMX, an AMD EPYC of the Zen 4 family,
or a GPU runs bf16 matmuls two or more times faster. Even there bf16 autocast pays only for a
model whose step is dominated by large matmuls: it casts weights and activations at every op
and keeps norms, softmax statistics and losses in fp32, so a small model's step (many small
ops) can get slower.

``choose`` therefore decides in two stages. It times one square matmul of each dtype (once
per process and device, about a quarter of a second on 2 cores): where bf16 is not faster,
fp32 it is. Otherwise, given ``time_step`` (``loop.fit`` passes one that runs a forward and
backward pass of the model being trained on its first batch), it times the step under both
and takes bf16 only where it is at least ``STEP_PAYS`` times faster; without one it falls
back to the matmul ratio (``PAYS``). ``--precision bf16`` on a machine where bf16 is slower
still trains in bf16, after one line saying by how much.

``multihead embed`` and ``multihead serve`` decide with the same ``choose``: their
``time_step`` times an embedding pass with the model's linear layers in bf16 against fp32
(``embed_precision``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["REQUESTS", "STEP_PAYS", "Peaks", "PrecisionChoice", "choose", "matmul_peaks"]

REQUESTS = ("auto", "fp32", "bf16", "fp16")  # what --precision takes
# bf16 must measure at least this much faster than fp32 for auto to choose it: autocast casts
# weights and activations at every step and keeps softmax statistics, norms and losses in fp32,
# so only part of a step runs at the bf16 rate and a small edge in the matmul does not pay
PAYS = 1.5
# a timed training step in bf16 must be this much faster than in fp32: a tie keeps fp32, the
# more accurate, and the margin covers the timing's noise (a step timed 3 times per precision)
STEP_PAYS = 1.05
_SIZE = 512  # n of the n x n matmuls timed: 0.27 GFLOP each, past the small-size overheads
_REPEATS = 7
_STEP_REPEATS = 3  # timed steps per precision, after one untimed warm-up of each

_measured: dict[str, Peaks] = {}  # per device, for the process


@dataclass(frozen=True)
class Peaks:
    """The fp32 and bf16 matmul rates of one device, in GFLOP/s (n x n, best of 7 runs
    each, interleaved)."""

    device: str
    fp32_gflops: float
    bf16_gflops: float
    size: int

    @property
    def ratio(self) -> float:
        """bf16 over fp32: above 1, bf16 matmuls are faster."""
        return self.bf16_gflops / self.fp32_gflops


@dataclass(frozen=True)
class PrecisionChoice:
    """What ``--precision`` asked for, what training runs under, and why."""

    requested: str
    precision: str  # fp32, bf16 or fp16: what autocast is given
    reason: str
    peaks: Peaks | None = None  # measured for auto and bf16
    # auto with a step to time: the median seconds of the model's step per precision
    step_seconds: dict[str, float] | None = None

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "requested": self.requested,
            "chosen": self.precision,
            "reason": self.reason,
        }
        if self.step_seconds is not None:
            out["step_seconds"] = {k: round(v, 6) for k, v in self.step_seconds.items()}
        if self.peaks is not None:
            out.update(
                fp32_matmul_gflops=round(self.peaks.fp32_gflops, 1),
                bf16_matmul_gflops=round(self.peaks.bf16_gflops, 1),
                bf16_over_fp32=round(self.peaks.ratio, 3),
                matmul_size=self.peaks.size,
            )
        return out


def _timer(dtype: torch.dtype, device: torch.device, n: int) -> Callable[[], float]:
    """A function timing one n x n matmul of ``dtype`` on ``device``, in seconds."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def once() -> float:
        start = time.perf_counter()
        a @ b
        sync()
        return time.perf_counter() - start

    once()  # warm-up: first-call dispatch and allocation
    return once


def _rates(device: torch.device, n: int) -> tuple[float, float]:
    """(fp32, bf16) GFLOP/s: the best of ``_REPEATS`` runs each, interleaved so that load
    from other processes falls on both alike."""
    timers = [_timer(dtype, device, n) for dtype in (torch.float32, torch.bfloat16)]
    best = [float("inf")] * 2
    for _ in range(_REPEATS):
        for i, timer in enumerate(timers):
            best[i] = min(best[i], timer())
    flops = 2 * n**3
    return flops / best[0] / 1e9, flops / best[1] / 1e9


def matmul_peaks(device: torch.device | str = "cpu") -> Peaks:
    """The device's fp32 and bf16 matmul rates, measured on first use and kept for the
    process."""
    device = torch.device(device)
    key = str(device)
    if key not in _measured:
        fp32, bf16 = _rates(device, _SIZE)
        _measured[key] = Peaks(key, fp32, bf16, _SIZE)
    return _measured[key]


def _time_steps(time_step: Callable[[str], float]) -> dict[str, float]:
    """Median seconds of ``time_step`` under fp32 and bf16: one warm-up of each, then
    ``_STEP_REPEATS`` of each, alternating."""
    times: dict[str, list[float]] = {"fp32": [], "bf16": []}
    for precision in times:
        time_step(precision)
    for _ in range(_STEP_REPEATS):
        for precision, seen in times.items():
            seen.append(time_step(precision))
    return {precision: statistics.median(seen) for precision, seen in times.items()}


def choose(
    requested: str,
    device: torch.device | str = "cpu",
    *,
    say: Callable[[str], None] | None = None,
    time_step: Callable[[str], float] | None = None,
    work: str = "training step",
) -> PrecisionChoice:
    """The precision to run under for ``--precision requested`` on ``device``.

    ``auto`` measures the matmul peaks (``matmul_peaks``): where bf16 is not faster than
    fp32, fp32. Otherwise, with ``time_step`` (a function that runs one training step under
    "fp32" or "bf16" autocast, leaves the model as it found it and returns the seconds taken),
    bf16 where the step is at least ``STEP_PAYS`` times faster in bf16 (medians of
    ``_STEP_REPEATS`` interleaved runs); without it, bf16 where the matmul is at least ``PAYS``
    times faster. ``bf16`` is kept as asked; where it measures slower than fp32, ``say`` gets
    one line with the measured ratio. ``fp32`` and ``fp16`` are kept without measuring.
    ``work`` names what ``time_step`` times, in the reason and the warning ("training step";
    ``multihead embed`` times an "embedding pass").

    Raises:
        ValueError: ``requested`` is not one of ``REQUESTS``.
    """
    if requested not in REQUESTS:
        raise ValueError(
            f"precision must be one of {', '.join(REQUESTS)}. Received: precision={requested!r}"
        )
    if requested in ("fp32", "fp16"):
        return PrecisionChoice(requested, requested, "asked for")
    peaks = matmul_peaks(device)
    rates = (
        f"bf16 matmul {peaks.bf16_gflops:.0f} GFLOP/s against fp32 {peaks.fp32_gflops:.0f} "
        f"GFLOP/s on {peaks.device} ({peaks.ratio:.2f}x)"
    )
    if requested == "bf16":
        if peaks.ratio < 1 and say is not None:
            say(
                f"--precision bf16: on this machine bf16 matmuls are {1 / peaks.ratio:.2f}x "
                f"slower than fp32 ({rates}); each {work} will be slower than under "
                "--precision fp32 (--precision auto picks fp32 here)"
            )
        return PrecisionChoice("bf16", "bf16", f"asked for; {rates}", peaks)
    if peaks.ratio < 1:
        return PrecisionChoice("auto", "fp32", f"bf16 does not pay: {rates} < 1x", peaks)
    if time_step is not None:
        steps = _time_steps(time_step)
        speedup = steps["fp32"] / steps["bf16"]
        timed = (
            f"this model's {work} {steps['bf16'] * 1e3:.1f} ms in bf16 against "
            f"{steps['fp32'] * 1e3:.1f} ms in fp32 ({speedup:.2f}x faster); {rates}"
        )
        if speedup >= STEP_PAYS:
            return PrecisionChoice("auto", "bf16", f"bf16 pays: {timed}", peaks, steps)
        return PrecisionChoice(
            "auto", "fp32", f"bf16 does not pay: {timed} < {STEP_PAYS}x", peaks, steps
        )
    if peaks.ratio >= PAYS:
        return PrecisionChoice("auto", "bf16", f"bf16 pays: {rates} >= {PAYS}x", peaks)
    return PrecisionChoice("auto", "fp32", f"bf16 does not pay: {rates} < {PAYS}x", peaks)
