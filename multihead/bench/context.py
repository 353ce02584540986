"""Context-parallel benchmark behind ``multihead bench context-parallel``.

One long sequence, forward + backward through ``multihead.parallel.context_attention``, split
across 1, 2 and 4 processes that this benchmark launches itself (gloo on CPU, rendezvous
through a file in a temporary folder). Each process builds only its own shard of the inputs;
reported per configuration: the wall time of the step (slowest rank), the peak resident memory
of every process and the part of it above the process's own baseline (Python, torch and the
process group, which do not shrink with more processes), the shards each rank computed, and
the largest difference of outputs and gradients from the one-process run.

On a machine with C cores, P processes share them (C // P threads each, at least one): more
processes cannot make one step faster than one process using every core; what they buy is
memory per process (and, across machines, a sequence no single one could hold).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import platform
import queue
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

import torch

from .. import _validation as V
from .._flags import option, positive_int
from .._progress import stages
from .options import Timed

__all__ = ["ContextBenchOptions", "ContextConfig", "run_context_bench"]

_BLOCK = 1024  # inputs are drawn in blocks of rows, each from its own seed
_MASKS = ("causal", "window")


@dataclass(frozen=True)
class ContextConfig:
    """What one benchmark run measures (the defaults are the issue's measurement)."""

    length: int = 131072  # L = S, the whole sequence
    # H = 1 query head of D = 32: a causal fwd+bwd at L = 131072 is 3.9 TFLOP, about a minute
    # on 2 cores; H = 8, D = 64 would take over an hour per configuration
    heads: int = 1
    head_dim: int = 32
    window: int = 256  # sliding_window(256): keys i - 256 ... i
    repeats: int = 1  # timed steps per configuration (the median is reported)
    seed: int = 0


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def _status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> None:
    """Start a new peak-RSS window (Linux: writing 5 to clear_refs resets VmHWM)."""
    Path("/proc/self/clear_refs").write_text("5")


def _rows(which: int, seed: int, start: int, stop: int, heads: int, dim: int) -> torch.Tensor:
    """Rows [start, stop) of a (1, H, L, D) tensor whose 1024-row blocks each have their own
    seed, so a shard is built without the whole and is the same for any number of processes."""
    parts = []
    for block in range(start // _BLOCK, (stop - 1) // _BLOCK + 1):
        g = torch.Generator().manual_seed(((seed * 8 + which) << 32) + block)
        x = torch.randn(1, heads, _BLOCK, dim, generator=g)
        lo, hi = max(start, block * _BLOCK), min(stop, (block + 1) * _BLOCK)
        parts.append(x[:, :, lo - block * _BLOCK : hi - block * _BLOCK])
    return torch.cat(parts, dim=2)


def _split(length: int, world: int) -> list[int]:
    return [length // world + (r < length % world) for r in range(world)]


def _worker(rank: int, world: int, init: str, cfg: ContextConfig, folder: str, results) -> None:
    """One process of the ring: every mask once for warm-up at a small size, then timed."""
    try:
        results.put((rank, _measure(rank, world, init, cfg, Path(folder))))
    except Exception as err:  # reported by the parent, which stops the other ranks
        results.put((rank, f"{type(err).__name__}: {err}"))
    # skip the interpreter's teardown of torch (seconds per process) once the result is out
    results.close()
    results.join_thread()
    os._exit(0)


def _measure(rank: int, world: int, init: str, cfg: ContextConfig, folder: Path) -> dict:
    import torch.distributed as dist

    from .. import masks
    from ..parallel import context_attention, visible_shards

    threads = max(1, _cores() // world)
    torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(hours=1)
    )
    lengths = _split(cfg.length, world)
    start = sum(lengths[:rank])
    stop = start + lengths[rank]
    out: dict = {"threads": threads, "masks": {}}
    for name in _MASKS:
        mask = masks.causal() if name == "causal" else masks.sliding_window(cfg.window)
        # warm-up at a small size: thread pools, gloo connections, first-call costs
        small = [(x.requires_grad_()) for x in (torch.randn(1, 1, 64, 8) for _ in range(3))]
        context_attention(*small, mask).sum().backward()
        dist.barrier()
        _reset_peak()  # then the baseline: the high-water mark is >= every RSS read after it
        base = _status_mib("VmRSS")
        q, k, v = (
            _rows(i, cfg.seed, start, stop, cfg.heads, cfg.head_dim).requires_grad_()
            for i in range(3)
        )
        times = []
        for _ in range(cfg.repeats):
            q.grad = k.grad = v.grad = None
            dist.barrier()
            t = time.perf_counter()
            o = context_attention(q, k, v, mask)
            o.sum().backward()
            dist.barrier()  # the step ends when the slowest rank is done
            times.append(time.perf_counter() - t)
        # Linux updates VmHWM lazily (at unmaps), so it can read below an RSS seen earlier in
        # the window: the peak is at least the baseline
        peak = max(_status_mib("VmHWM"), base)
        torch.save(
            {"out": o.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad},
            folder / f"{name}-{world}-{rank}.pt",
        )
        computed = visible_shards(mask, lengths)[rank]
        out["masks"][name] = {
            "times_s": times,
            "baseline_rss_mib": base,
            "peak_rss_mib": peak,
            "above_baseline_mib": peak - base,
            "computed_shards": sum(computed),
        }
        del q, k, v, o
    dist.destroy_process_group()
    return out


def _launch(world: int, cfg: ContextConfig, folder: Path, timeout_s: float) -> list[dict]:
    """Start ``world`` processes, wait (bounded) for each rank's measurements."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init = (folder / f"rendezvous-{world}").resolve().as_uri()
    procs = [
        ctx.Process(target=_worker, args=(r, world, init, cfg, str(folder), results))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    got: dict[int, object] = {}
    try:
        _collect(results, procs, got, time.monotonic() + timeout_s, timeout_s)
    finally:
        for p in procs:
            p.join(timeout=30 if len(got) == world else 0.1)
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    return [got[r] for r in range(world)]


def _collect(results, procs: list, got: dict, deadline: float, timeout_s: float) -> None:
    """Fill ``got`` with each rank's result from ``results``; a rank that failed, died without
    a result, or the deadline passing is a RuntimeError."""
    world = len(procs)
    while len(got) < world:
        try:
            rank, value = results.get(timeout=1.0)
        except queue.Empty:
            # a rank that died before reporting (killed, or failed to start) never will
            dead = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in got]
            if dead:
                raise RuntimeError(
                    f"rank(s) {dead} of {world} exited without a result "
                    f"(exit codes {[procs[r].exitcode for r in dead]})"
                ) from None
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{world} processes did not finish within {timeout_s:.0f} s"
                ) from None
            continue
        if isinstance(value, str):
            raise RuntimeError(f"rank {rank} of {world} failed: {value}")
        got[rank] = value


def _max_diff(folder: Path, name: str, world: int) -> dict[str, float] | None:
    """Largest |difference| of out, dq, dk, dv between ``world`` processes and one."""
    if world == 1 or not (folder / f"{name}-1-0.pt").exists():
        return None
    one = torch.load(folder / f"{name}-1-0.pt")
    parts = [torch.load(folder / f"{name}-{world}-{r}.pt") for r in range(world)]
    return {
        key: float((torch.cat([p[key] for p in parts], dim=2) - one[key]).abs().max())
        for key in ("out", "dq", "dk", "dv")
    }


def _run_row(name: str, world: int, ranks: list[dict], folder: Path) -> dict:
    """One mask's result at ``world`` processes: the slowest rank's time per repeat, every
    rank's memory, and the output's difference from the one-process run."""
    rows = [r["masks"][name] for r in ranks]
    times = [max(ts) for ts in zip(*(row["times_s"] for row in rows))]
    return {
        "mask": name,
        "processes": world,
        "threads_per_process": ranks[0]["threads"],
        "seconds": statistics.median(times),
        "times_s": times,
        "peak_rss_mib": [row["peak_rss_mib"] for row in rows],
        "baseline_rss_mib": [row["baseline_rss_mib"] for row in rows],
        "above_baseline_mib": [row["above_baseline_mib"] for row in rows],
        "computed_shards": [row["computed_shards"] for row in rows],
        "max_abs_diff_vs_one_process": _max_diff(folder, name, world),
    }


def _config(
    config: ContextConfig | None, quick: bool, repeats: int | None, processes: list[int]
) -> ContextConfig:
    """The settings to run: ``config``, or the default (L=8192 with ``quick``), with
    ``repeats`` applied; every process must get at least one position."""
    cfg = config or ContextConfig()
    if quick and config is None:
        cfg = ContextConfig(length=8192)
    if repeats is not None:
        cfg = ContextConfig(**{**asdict(cfg), "repeats": V.check_positive_int("repeats", repeats)})
    if cfg.length < max(processes):
        raise ValueError(
            f"each process needs at least one position of the sequence. "
            f"Received: L={cfg.length}, processes={processes}"
        )
    return cfg


@dataclass(frozen=True, kw_only=True)
class ContextBenchOptions(Timed):
    """What ``multihead bench context-parallel`` takes (its ``--help``)."""

    quick: bool = option(False, "a short sequence, seconds")
    processes: tuple[int, ...] = option(
        (1, 2, 4), "process counts", metavar="P", parse=positive_int
    )


def run_context_bench(
    options: ContextBenchOptions,
    *,
    config: ContextConfig | None = None,
    timeout_s: float = 3600.0,
    say: Callable[[str], None] = print,
) -> dict:
    """Measure, print a table, write ``context_parallel.json`` and ``context_parallel.png``.

    ``options.quick`` shrinks L to 8192 (seconds instead of minutes); ``config`` replaces the
    sizes. Each number of processes is a fresh launch, so every process's peak memory is its
    own.
    """
    quick = options.quick
    out_dir = V.check_out_dir("--out", options.out)
    processes = sorted({V.check_positive_int("processes", p) for p in options.processes})
    cfg = _config(config, quick, options.repeats, processes)
    if not Path("/proc/self/clear_refs").exists():
        raise RuntimeError("the context-parallel benchmark reads peak memory from Linux's /proc")
    cores = _cores()
    report: dict = {
        "command": "multihead bench context-parallel"
        + (" --quick" if quick else "")
        + f" --processes {' '.join(map(str, processes))}",
        "machine": {
            "cores": cores,
            "python": platform.python_version(),
            "torch": torch.__version__,
            "processor": platform.processor() or platform.machine(),
        },
        "config": {**asdict(cfg), "dtype": "float32", "batch": 1, "kv_heads": cfg.heads},
        "note": (
            f"{cores} cores shared by P processes ({cores} // P threads each, at least 1): "
            "more processes cannot make a step faster than one process on every core; they "
            "divide the memory each process needs."
        ),
        "runs": [],
    }
    say(
        f"context parallel: L=S={cfg.length}, B=1, H={cfg.heads}, D={cfg.head_dim}, fp32, "
        f"fwd+bwd, {cfg.repeats} timed step(s); {cores} cores"
    )
    by_mask: dict[str, dict[int, dict]] = {name: {} for name in _MASKS}
    steps = [f"{world} process{'es' * (world > 1)}" for world in processes]
    with (
        tempfile.TemporaryDirectory(prefix="mh-cp-") as tmp,
        stages("bench context-parallel", steps, unit="launch", say=say) as (bar, tell),
    ):
        folder = Path(tmp)
        for world, step in zip(processes, steps):
            bar.begin(step)
            ranks = _launch(world, cfg, folder, timeout_s)
            for name in _MASKS:
                run = _run_row(name, world, ranks, folder)
                by_mask[name][world] = run
                report["runs"].append(run)
                tell(_line(run, by_mask[name].get(1)))
    for run in report["runs"]:
        one = by_mask[run["mask"]].get(1)
        run["memory_above_baseline_vs_one_process"] = (
            None if one is None else max(run["above_baseline_mib"]) / one["above_baseline_mib"][0]
        )
        run["time_vs_one_process"] = None if one is None else run["seconds"] / one["seconds"]
    out_dir.mkdir(exist_ok=True)
    (out_dir / "context_parallel.json").write_text(json.dumps(report, indent=2))
    chart = _chart(report, out_dir / "context_parallel.png")
    say(report["note"])
    say(f"wrote {out_dir / 'context_parallel.json'}" + (f" and {chart}" if chart else ""))
    return report


def _line(run: dict, one: dict | None) -> str:
    above = max(run["above_baseline_mib"])
    text = (
        f"  {run['mask']:7s} P={run['processes']} ({run['threads_per_process']} thread(s) each): "
        f"{run['seconds']:8.2f} s, peak RSS per process {max(run['peak_rss_mib']):7.0f} MiB, "
        f"{above:7.0f} MiB above its baseline, shards computed {run['computed_shards']}"
    )
    if one is not None and run["processes"] > 1:
        diff = run["max_abs_diff_vs_one_process"]
        text += (
            f"; memory {above / one['above_baseline_mib'][0]:.2f}x and time "
            f"{run['seconds'] / one['seconds']:.2f}x of P=1; max |diff| out {diff['out']:.1e}, "
            f"grads {max(diff['dq'], diff['dk'], diff['dv']):.1e}"
        )
    return text


def _chart(report: dict, path: Path) -> Path | None:
    """Memory per process and time against the number of processes, one line per mask."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the bench extra brings matplotlib; the JSON is written regardless
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for name in _MASKS:
        runs = [r for r in report["runs"] if r["mask"] == name]
        ps = [r["processes"] for r in runs]
        left.plot(ps, [max(r["above_baseline_mib"]) for r in runs], "o-", label=name)
        right.plot(ps, [r["seconds"] for r in runs], "o-", label=name)
    cfg = report["config"]
    left.set(
        xlabel="processes",
        ylabel="MiB per process above its baseline",
        title="peak memory per process",
    )
    right.set(xlabel="processes", ylabel="seconds", title=f"fwd+bwd time ({cfg['length']} tokens)")
    for ax in (left, right):
        ax.set_xticks(sorted({r["processes"] for r in report["runs"]}))
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(
        f"context parallel, L={cfg['length']}, H={cfg['heads']}, D={cfg['head_dim']}, "
        f"{report['machine']['cores']} cores"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
