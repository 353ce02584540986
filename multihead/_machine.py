"""What this machine is, as the benchmarks and ``multihead doctor`` print it."""

from __future__ import annotations

import os
import platform

__all__ = ["available_memory", "cpu_info"]


def available_memory() -> int | None:
    """Bytes of memory that can still be allocated: the kernel's MemAvailable (Linux), else the
    physical memory; None where neither can be told."""
    try:
        with open("/proc/meminfo") as file:
            for line in file:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def cpu_info() -> tuple[str, set[str]]:
    """(model name, flags) from /proc/cpuinfo; the platform's processor string elsewhere."""
    model, flags = "", set[str]()
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
