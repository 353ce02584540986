"""What this machine is, as the benchmarks and ``multihead doctor`` print it."""

from __future__ import annotations

import platform

__all__ = ["cpu_info"]


def cpu_info() -> tuple[str, set[str]]:
    """(model name, flags) from /proc/cpuinfo; the platform's processor string elsewhere."""
    model, flags = "", set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                name, _, value = line.partition(":")
                name = name.strip()
                if name == "model name" and not model:
                    model = value.strip()
                elif name in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return model or platform.processor() or platform.machine(), flags
