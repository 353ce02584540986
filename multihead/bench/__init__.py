"""Benchmarks: every contender in one process, same inputs, interleaved repeats, medians."""

from .kernels import WORKLOADS, Workload, run_suite

__all__ = ["WORKLOADS", "Workload", "run_suite"]
