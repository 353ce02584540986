"""``multihead bench kv``: what KV-cache compression costs and saves on a real causal LM.

Three measurements on the model of ``--model`` (SmolLM2-135M-Instruct by default), float32, with
the machine's CPU, matmul peaks and read bandwidth printed beside them, every contender in one
process, interleaved, medians of ``--repeats``:

- **the scored prompt**: the prompt's forward inside ``multihead.hf.compress`` with SnapKV's
  statistic (``window_mass`` of the last 32 rows) and H2O's (``key_mass`` of every row),
  against the plain forward on the full cache; and against the eager reference, the way
  kvpress's observed-attention press gets the scores (``attn_implementation="eager"``, each
  layer's materialized weights reduced by hand in a hook), where it fits in memory;
- **decoding at a long context**: ms per decoding step after a ``--context``-token prompt with
  the cache compressed to keep 0.25 (SnapKV) against the full cache; the cache's bytes
  (measured on the tensors) and the run's peak growth of resident memory (prompt and steps).

With ``--lengths 2000,4000,8000`` it measures **the long-document table** instead (issue 58):
for each prompt length, each run in a process of its own (the model loaded and a short run
of the same kind made first, so the growth is the document's), the full cache, SnapKV
compressing after the whole prompt, and SnapKV with the prompt run in chunks of ``--chunk``
tokens (``compress(chunk=)``), both at ``--keep`` or a token budget ``--budget``: the peak
growth of resident memory over the prompt and ``--steps`` decoding steps, the prompt's seconds
and the median ms a step, logits for one position on every side. It writes kv_long.json and
a figure of memory against length (kv_long.png, the viz extra).

Goals (issue 50): scored prompt <= 1.1x plain (SnapKV) and <= 1.2x (H2O); >= 4x faster than
eager at 4,000 tokens; a step >= 1.3x faster at 8,000 tokens with keep 0.25; cache bytes <=
0.27x; peak growth <= 0.6x the full cache's run.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .. import _validation as V
from .._flags import option, positive_int
from .options import Timed, goal_line

__all__ = ["KvBenchOptions", "run_kv_bench"]


@dataclass(frozen=True, kw_only=True)
class KvBenchOptions(Timed):
    """What ``multihead bench kv`` takes (``multihead bench kv --help``)."""

    model: str = option(
        "smollm2", "the causal LM: 'smollm2', 'gemma3', a .gguf file or a transformers folder",
        metavar="MODEL",
    )  # fmt: skip
    prompt: int = option(4000, "prompt tokens of the scored-prompt timings", parse=positive_int)
    context: int = option(8000, "prompt tokens before the timed decoding steps", parse=positive_int)
    steps: int = option(16, "decoding steps timed after the long prompt", parse=positive_int)
    keep: float = option(0.25, "the share of the prompt the compressed cache keeps")
    eager: bool = option(True, "time the eager reference too (skipped where it would not fit)")
    lengths: str = option(
        "", "comma-separated prompt lengths: measure the long-document table instead",
        metavar="N,N,...",
    )  # fmt: skip
    chunk: int = option(512, "tokens a prompt chunk in the long-document table",
                        parse=positive_int)  # fmt: skip
    budget: int = option(0, "a token budget instead of --keep in the long-document table (0: "
                         "--keep)")  # fmt: skip


def _ids(length: int, vocab: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(5)
    return torch.randint(100, min(vocab, 30000), (1, length), generator=gen)


def _plain(model: Any, ids: torch.Tensor) -> Any:
    import transformers as tf

    cache = tf.DynamicCache()
    # logits of the last row only (generate's way): (L, vocab) logits would outweigh the cache
    model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return cache


def _scored(model: Any, ids: torch.Tensor, policy: Any) -> Any:
    import transformers as tf

    from ..hf import compress

    cache = tf.DynamicCache()
    with compress(model, policy):
        model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return cache


def _eager_scores(model: Any, ids: torch.Tensor, window: int) -> list[torch.Tensor]:
    """SnapKV's scores as a press computes them from eager attention: each layer's weights
    (B, H, L, S), materialized by the eager implementation, reduced in a forward hook."""
    from ..hf.reader import attention_layers

    scores: list[torch.Tensor] = []

    def reduce(module: Any, args: Any, output: Any) -> None:
        weights = output[1]
        scores.append(weights[:, :, -window:].sum(2))

    handles = [m.register_forward_hook(reduce) for m in attention_layers(model)]
    try:
        _plain(model, ids)
    finally:
        for h in handles:
            h.remove()
    return scores


def _fits_eager(model: Any, length: int) -> tuple[bool, str]:
    """Whether one layer's eager weights (and the softmax's copy) fit in the free memory."""
    config = model.config
    need = 3 * config.num_attention_heads * length * length * 4
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            free = next(
                int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable")
            )
    except (OSError, StopIteration):
        return True, ""
    ok = need < 0.6 * free
    return ok, "" if ok else f"one layer's eager weights need {need / 2**30:.1f} GiB"


def _time(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def _prompt_costs(model: Any, eager: Any, ids: torch.Tensor, repeats: int,
                  say: Callable[[str], None]) -> dict[str, Any]:  # fmt: skip
    """Interleaved repeats of the plain, SnapKV-scored, H2O-scored (and eager) prompts."""
    from ..kv import H2O, SnapKV

    contenders: dict[str, Callable[[], object]] = {
        "plain": lambda: _plain(model, ids),
        "snapkv": lambda: _scored(model, ids, SnapKV(0.25)),
        "h2o": lambda: _scored(model, ids, H2O(0.25)),
    }
    if eager is not None:
        contenders["eager"] = lambda: _eager_scores(eager, ids, 32)
    times: dict[str, list[float]] = {name: [] for name in contenders}
    with torch.inference_mode():
        for fn in contenders.values():  # one warm-up each
            fn()
        for _ in range(repeats):
            for name, fn in contenders.items():
                times[name].append(_time(fn))
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name, t in medians.items():
        say(f"  prompt of {ids.shape[1]} tokens, {name:>7}: {t:.3f} s (median of {repeats})")
    return {"seconds": medians, "all": times}


def _decode_run(model: Any, ids: torch.Tensor, steps: int, policy: Any) -> dict[str, Any]:
    """The prompt, then ``steps`` timed greedy steps, with the resident memory's peak growth
    (meaningful in a new process only: a process that ran before reuses pages it holds)."""
    from ..hf import compress
    from .hf import peak_growth

    times: list[float] = []
    found: dict[str, Any] = {}

    def go() -> None:
        import contextlib

        import transformers as tf

        cache = tf.DynamicCache()
        block = compress(model, policy) if policy is not None else contextlib.nullcontext()
        with block:
            out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            token = out.logits[:, -1:].argmax(-1)
            for _ in range(steps):
                started = time.perf_counter()
                out = model(input_ids=token, past_key_values=cache, use_cache=True)
                token = out.logits[:, -1:].argmax(-1)
                times.append(time.perf_counter() - started)
        found["bytes"] = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)

    with torch.inference_mode():
        growth, _ = peak_growth(go)
    # the first steps meet new shapes (routes chosen and measured once): the median of the rest
    settled = times[2:] if len(times) > 4 else times
    return {"step_ms": 1000 * statistics.median(settled), "bytes": found["bytes"],
            "peak_growth": growth, "steps_ms": [1000 * t for t in times]}  # fmt: skip


def _peak_in_process(model: str, context: int, steps: int, keep: float | None) -> int | None:
    """A decoding run's peak growth of resident memory, in a new process (the model loaded
    first: the growth is the prompt's, the cache's and the steps')."""
    import subprocess
    import sys

    code = (
        "import json, sys, torch; from multihead.bench import kv; "
        "print(json.dumps(kv._child_peak(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), "
        "None if sys.argv[4] == 'full' else float(sys.argv[4]))))"
    )
    args = [model, str(context), str(steps), "full" if keep is None else str(keep)]
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=1800)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"the memory run failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _child_peak(model: str, context: int, steps: int, keep: float | None) -> int | None:
    from ..hf import loading
    from ..kv import SnapKV

    loaded, _ = loading.load_with_tokenizer(model)
    ids = _ids(context, loaded.config.vocab_size)
    policy = None if keep is None else SnapKV(keep)
    return _decode_run(loaded, ids, steps, policy)["peak_growth"]


_MODES = ("full", "compressed", "chunked")


def _long_run(model: Any, ids: torch.Tensor, steps: int, mode: str, policy: Any,
              chunk: int) -> dict[str, Any]:  # fmt: skip
    """One long-document run: the prompt (logits of its last position), then ``steps`` greedy
    steps; the seconds of the prompt, the median step and the run's peak memory growth."""
    import contextlib

    import transformers as tf

    from ..hf import compress
    from .hf import peak_growth

    found: dict[str, Any] = {}

    def go() -> None:
        cache = tf.DynamicCache(config=model.config)
        if mode == "full":
            block: Any = contextlib.nullcontext()
        else:
            block = compress(model, policy, chunk=chunk if mode == "chunked" else None)
        with block:
            started = time.perf_counter()
            out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            found["prompt_s"] = time.perf_counter() - started
            token, times = out.logits[:, -1:].argmax(-1), []
            for _ in range(steps):
                started = time.perf_counter()
                out = model(input_ids=token, past_key_values=cache, use_cache=True)
                token = out.logits[:, -1:].argmax(-1)
                times.append(time.perf_counter() - started)
        settled = times[2:] if len(times) > 4 else times
        found["step_ms"] = 1000 * statistics.median(settled)
        found["cache_bytes"] = sum(
            layer.keys.nbytes + layer.values.nbytes
            for layer in cache.layers
            if getattr(layer, "keys", None) is not None
        )

    with torch.inference_mode():
        growth, _ = peak_growth(go)
    return {**found, "peak_growth": growth or 0}


def _child_long(model: str, length: int, steps: int, mode: str, keep: float, budget: int,
                chunk: int) -> dict[str, Any]:  # fmt: skip
    from ..hf import loading
    from ..kv import SnapKV

    loaded, _ = loading.load_with_tokenizer(model)
    ids = _ids(length, loaded.config.vocab_size)
    policy = SnapKV(budget if budget else keep)
    # a short run of the same kind first: what the first call of a process allocates once
    # (kernels loaded, routes measured, the allocator's arenas) is not the document's
    _long_run(loaded, ids[:, : min(length, 2 * chunk + 8)], 2, mode, policy, chunk)
    return _long_run(loaded, ids, steps, mode, policy, chunk)


def _long_in_process(options: KvBenchOptions, length: int, mode: str) -> dict[str, Any]:
    import subprocess
    import sys

    code = (
        "import json, sys; from multihead.bench import kv; a = sys.argv[1:]; "
        "print(json.dumps(kv._child_long(a[0], int(a[1]), int(a[2]), a[3], float(a[4]), "
        "int(a[5]), int(a[6]))))"
    )
    args = [options.model, str(length), str(options.steps), mode, str(options.keep),
            str(options.budget), str(options.chunk)]  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=3600)  # fmt: skip
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:]
        raise RuntimeError(f"the {mode} run at {length} tokens failed: {tail}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _parse_lengths(text: str) -> list[int]:
    try:
        lengths = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 1:
        raise ValueError(
            "--lengths takes comma-separated prompt lengths, each an int >= 1. "
            f"Received: --lengths {text!r}"
        )
    return sorted(set(lengths))


def run_long_table(options: KvBenchOptions, *, say: Callable[[str], None] = print) -> dict:
    """The long-document table: prompt length against peak memory growth, prompt seconds and
    ms a decoding step, for the full cache, compression after the prompt and in chunks."""
    from .._machine import cpu_info
    from .measuring import matmul_peaks

    lengths = _parse_lengths(options.lengths)
    if options.budget < 0 or not 0 < options.keep <= 1:
        raise ValueError(
            "--budget must be an int >= 0 and --keep in (0, 1]. "
            f"Received: --budget {options.budget}, --keep {options.keep}"
        )
    out = V.check_out_dir("--out", options.out)
    cpu, peaks = cpu_info()[0], matmul_peaks(1024)
    kept = f"a {options.budget}-token budget" if options.budget else f"keep {options.keep}"
    say(f"CPU: {cpu}; {torch.get_num_threads()} threads; torch {torch.__version__}; matmul peak "
        f"fp32 {peaks['float32']:.0f} GFLOP/s, bf16 {peaks['bfloat16']:.0f} GFLOP/s")  # fmt: skip
    say(f"model {options.model}, float32; SnapKV at {kept}, chunks of {options.chunk}; "
        f"{options.steps} decoding steps; each run in a process of its own")  # fmt: skip
    rows: list[dict[str, Any]] = []
    for length in lengths:
        for mode in _MODES:
            row = {"length": length, "mode": mode, **_long_in_process(options, length, mode)}
            rows.append(row)
            say(f"  {length:>6} tokens {mode:>10}: peak growth {row['peak_growth'] / 2**20:8.0f} "
                f"MiB, prompt {row['prompt_s']:7.2f} s, step {row['step_ms']:7.2f} ms, cache "
                f"{row['cache_bytes'] / 2**20:7.1f} MiB")  # fmt: skip
    report = {
        "command": "multihead bench kv --lengths",
        "cpu": cpu,
        "threads": torch.get_num_threads(),
        "peaks_gflops": peaks,
        "options": {k: str(v) for k, v in vars(options).items()},
        "rows": rows,
    }
    out.mkdir(parents=True, exist_ok=True)
    path = out / "kv_long.json"
    path.write_text(json.dumps(report, indent=2), encoding="utf-8")
    say(f"wrote {path}")
    figure = _long_figure(rows, out / "kv_long.png", f"{options.model}, SnapKV at {kept}")
    if figure is not None:
        say(f"wrote {figure}")
    return report


def _long_figure(rows: list[dict[str, Any]], path: Any, title: str) -> Any:
    """Peak memory growth against prompt length, one line a mode (None without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in _MODES:
        mine = [r for r in rows if r["mode"] == mode]
        ax.plot([r["length"] for r in mine], [r["peak_growth"] / 2**20 for r in mine],
                marker="o", label=mode)  # fmt: skip
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("peak memory growth (MiB)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run_kv_bench(options: KvBenchOptions, *, say: Callable[[str], None] = print) -> dict:
    """Run the three measurements; print them with the goals; write kv.json into --out. With
    ``--lengths``: the long-document table (``run_long_table``)."""
    if options.lengths:
        from .._extras import require

        require("transformers", "hf", "multihead bench kv")
        return run_long_table(options, say=say)
    from .._extras import require
    from .._machine import cpu_info
    from ..backends import fused
    from .decode import memory_bandwidth
    from .measuring import matmul_peaks

    require("transformers", "hf", "multihead bench kv")
    from ..hf import loading
    from ..kv import SnapKV

    if not 0 < options.keep <= 1:
        raise ValueError(f"--keep must be in (0, 1]. Received: --keep {options.keep}")
    repeats = options.repeats or 3
    out = V.check_out_dir("--out", options.out)
    fused.build_error()  # the kernel built now, as bench kernels does
    model, _ = loading.load_with_tokenizer(options.model)
    vocab = model.config.vocab_size
    cpu, flops, before = cpu_info()[0], matmul_peaks(1024), memory_bandwidth()
    say(f"CPU: {cpu}; {torch.get_num_threads()} threads; torch {torch.__version__}")
    say(f"matmul peak fp32 {flops['float32']:.0f} GFLOP/s, bf16 {flops['bfloat16']:.0f} GFLOP/s; "
        f"read bandwidth {before:.1f} GB/s; model {options.model}, float32")  # fmt: skip
    eager, why = None, "--no-eager"
    if options.eager:
        fits, why = _fits_eager(model, options.prompt)
        if fits:
            eager, _ = loading.load_with_tokenizer(options.model, attn_implementation="eager")
    prompt = _prompt_costs(model, eager, _ids(options.prompt, vocab), repeats, say)
    del eager
    long_ids = _ids(options.context, vocab)
    runs: dict[str, list[dict[str, Any]]] = {"full": [], "compressed": []}
    policy = SnapKV(float(options.keep))
    for _ in range(repeats):  # alternating full and compressed runs
        runs["full"].append(_decode_run(model, long_ids, options.steps, None))
        runs["compressed"].append(_decode_run(model, long_ids, options.steps, policy))
    after = memory_bandwidth()
    peaks = {  # each in a new process: one that ran before reuses pages it already holds
        "full": _peak_in_process(options.model, options.context, options.steps, None),
        "compressed": _peak_in_process(options.model, options.context, options.steps,
                                       float(options.keep)),
    }  # fmt: skip
    decode = {
        name: {
            "step_ms": statistics.median(r["step_ms"] for r in rs),
            "bytes": rs[0]["bytes"],
            "peak_growth": peaks[name] or 0,
        }
        for name, rs in runs.items()
    }
    for name, d in decode.items():
        mib, grew = d["bytes"] / 2**20, d["peak_growth"] / 2**20
        say(f"  decoding at {options.context} tokens, {name:>10}: {d['step_ms']:.2f} ms a step, "
            f"cache {mib:.1f} MiB, peak growth {grew:.0f} MiB")  # fmt: skip
    s = prompt["seconds"]
    full, packed = decode["full"], decode["compressed"]
    goals = [
        _goal(f"prompt with SnapKV's statistics <= 1.1x plain ({options.prompt} tokens)",
              s["snapkv"] / s["plain"], 1.1, below=True),
        _goal(f"prompt with H2O's statistics <= 1.2x plain ({options.prompt} tokens)",
              s["h2o"] / s["plain"], 1.2, below=True),
        _goal(f"decoding step at {options.context} tokens, keep {options.keep}: >= 1.3x faster "
              "than the full cache", full["step_ms"] / packed["step_ms"], 1.3, below=False),
        _goal(f"cache bytes <= 0.27x the full cache's (keep {options.keep})",
              packed["bytes"] / full["bytes"], 0.27, below=True),
        _goal("peak memory growth <= 0.6x the full cache's run",
              packed["peak_growth"] / max(full["peak_growth"], 1), 0.6, below=True),
    ]  # fmt: skip
    if "eager" in s:
        goals.append(_goal(f"scored prompt >= 4x faster than the eager reference "
                           f"({options.prompt} tokens)", s["eager"] / s["snapkv"], 4.0,
                           below=False))  # fmt: skip
    else:
        say(f"  eager reference not timed: {why}")
    say(f"read bandwidth after the runs {after:.1f} GB/s")
    for goal in goals:
        say(goal_line(goal))
    report = {
        "command": "multihead bench kv",
        "cpu": cpu,
        "threads": torch.get_num_threads(),
        "peaks_gflops": flops,
        "peak_growth": peaks,
        "bandwidth_gbs": [before, after],
        "options": {k: str(v) for k, v in vars(options).items()},
        "prompt": prompt,
        "decode": decode,
        "decode_runs": runs,
        "goals": goals,
    }
    path = out / "kv.json"
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str), encoding="utf-8")
    say(f"wrote {path}")
    return report


def _goal(text: str, figure: float, threshold: float, *, below: bool) -> dict[str, Any]:
    met = figure <= threshold if below else figure >= threshold
    return {"text": text, "figure": float(figure), "threshold": threshold, "met": bool(met)}
