"""``multihead doctor``: is the fused kernel built, what does this CPU offer, what does it do.

The instruction sets are shown for information only: ``auto`` never chooses from them, it
measures (``backends/fused.measured_faster``). The peaks are measured here, like the bench's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .. import _machine
from .._flags import option
from .._progress import stages

__all__ = ["Diagnosis", "DoctorOptions", "diagnose", "run"]

# the /proc/cpuinfo flags that decide how fast attention can run on a CPU
_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_fp16",
    "asimd",
    "sve",
)


@dataclass
class Diagnosis:
    kernel: str  # "built, from <where>" (the package build or the per-user cache) or why not
    built: bool
    cpu: str
    instruction_sets: list[str]
    threads: int
    peak_gflops: dict[str, float] = field(default_factory=dict)


def diagnose(*, measure: bool = True, size: int = 1024) -> Diagnosis:
    """Build the kernel if needed and describe the machine; ``measure`` times an fp32 and a
    bf16 matmul of ``size`` x ``size`` (median of 5, as ``multihead bench`` does)."""
    from ..backends import fused
    from .measuring import matmul_peak

    why = fused.build_error()
    cpu, flags = _machine.cpu_info()
    kernel = f"built, from {fused.origin()}" if why is None else f"not built: {why}"
    diagnosis = Diagnosis(
        kernel=kernel,
        built=why is None,
        cpu=cpu,
        instruction_sets=[f for f in _FLAGS if f in flags],
        threads=torch.get_num_threads(),
    )
    if measure:
        for dtype in (torch.float32, torch.bfloat16):
            diagnosis.peak_gflops[str(dtype).removeprefix("torch.")] = matmul_peak(dtype, size)
    return diagnosis


@dataclass(frozen=True, kw_only=True)
class DoctorOptions:
    """What ``multihead doctor`` takes (``multihead doctor --help``)."""

    measure: bool = option(
        True, "skip timing the matmul peaks (a few seconds)", flag="--no-measure"
    )


def run(options: DoctorOptions, *, say: Callable[[str], None] = print) -> int:
    """Diagnose (the kernel's first build takes a minute: a progress bar shows it) and print;
    the exit status: 0 when the fused kernel is built, else 1."""
    with stages("doctor", ["fused kernel (built on first use) and CPU peaks"]) as (bar, _):
        bar.begin("fused kernel (built on first use) and CPU peaks")
        d = diagnose(measure=options.measure)
    say(f"fused kernel: {d.kernel}")
    say(f"cpu: {d.cpu}")
    say(f"instruction sets: {' '.join(d.instruction_sets) or 'none of ' + ' '.join(_FLAGS)}")
    say(f"torch threads: {d.threads}")
    if d.peak_gflops:
        fp32, bf16 = d.peak_gflops["float32"], d.peak_gflops["bfloat16"]
        say(
            f"matmul peak: fp32 {fp32:.0f} GFLOP/s, bf16 {bf16:.0f} GFLOP/s "
            f"(bf16/fp32 = {bf16 / fp32:.2f})"
        )
    return 0 if d.built else 1
