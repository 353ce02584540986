"""Timing decoding steps, shared by ``multihead bench decode``'s GPT-2-shaped table
(``decode.py``) and its real-model table (``decode_model.py``): the read bandwidth, the bytes
a step reads, a streamer that stamps each token, and interleaved timed runs."""

from __future__ import annotations

import time

import torch

__all__ = ["Stamps", "linear_bytes", "memory_bandwidth", "timed"]


def memory_bandwidth(mib: int = 512, repeats: int = 5) -> float:
    """Read bandwidth in GB/s: the best of ``repeats`` sums over a float32 buffer of ``mib``
    MiB (far larger than the caches), each element read once."""
    x = torch.ones(mib * 2**18)
    x.sum()  # fault the pages in
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best / 1e9


def linear_bytes(model) -> int:
    """Bytes of the linear layers' weights (each matrix once, tied ones too): what a decoding
    step reads for the whole batch (an embedding lookup reads one row per token)."""
    from ..modules import quant

    seen, total = set(), 0
    for m in model.modules():
        if isinstance(m, quant.PackedLinear):
            tensors = [m.packed] + ([m.scale] if m.scale is not None else [])
        elif isinstance(m, torch.nn.Linear):
            tensors = [m.weight]
        else:
            continue
        for t in tensors:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
    return total


class Stamps:
    """A streamer (transformers' ``put`` / ``end`` protocol, which ``generate`` takes on both
    sides) that notes when each put came: the prompt's first, then every new token's."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: object) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def timed(contenders: dict, repeats: int) -> tuple[dict, dict, dict, list[float]]:
    """Each contender's runs, ``repeats`` times, the order of the contenders rotating from one
    repeat to the next: per run its whole time, its time to the first new token (the prompt)
    and the time from the first new token to the last (the decoding steps), each from its
    streamer's stamps; and the read bandwidth measured before each repeat and after the last
    (GB/s): the readings beside the timings."""
    names = list(contenders)
    times: dict[str, list[float]] = {name: [] for name in names}
    first_times: dict[str, list[float]] = {name: [] for name in names}
    step_spans: dict[str, list[float]] = {name: [] for name in names}
    readings = []
    for r in range(repeats):
        readings.append(memory_bandwidth())
        for name in names[r % len(names) :] + names[: r % len(names)]:
            stamps = Stamps()
            start = time.perf_counter()
            contenders[name](stamps)
            times[name].append(time.perf_counter() - start)
            tokens = stamps.times[1:]  # the first put is the prompt
            first_times[name].append(tokens[0] - start)
            step_spans[name].append(tokens[-1] - tokens[0])
    readings.append(memory_bandwidth())
    return times, first_times, step_spans, readings
