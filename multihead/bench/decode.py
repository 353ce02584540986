"""Greedy decoding throughput: ``multihead.models.gpt2`` against transformers' ``generate()`` on
the same random GPT-2-small-shaped weights, in the same process.

Decoding one token per row reads every weight once per step (and each row's cache), so the
machine's memory bandwidth bounds both sides; the report states the bytes read per generated
token and the bandwidth measured in the same run beside the tokens/s. Repeats alternate the
order of the contenders; medians are reported, and the generated tokens must be identical.

multihead runs three times: float32 weights, and weight-only ``"bf16"`` and ``"int8"``
(``gpt2.load(..., weights=)``); each row gives tokens/s, the ratio to transformers' fp32
``generate()``, the bytes its step reads per token and the GB/s that makes against the read
bandwidth measured in the same run; the packed formats report how many of their tokens match
the fp32 ones. ``quality(folder, text)`` measures the packed formats' held-out perplexity and
top-1 agreement against fp32 on a trained model (``--model DIR --text FILE``).
"""

from __future__ import annotations

import json
import math
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import _validation as V
from .._flags import option
from .._progress import stages
from .decode_timing import Stamps, linear_bytes, memory_bandwidth, timed
from .options import Timed, goal_line

__all__ = [
    "DecodeBenchOptions",
    "DecodeShape",
    "LongContext",
    "attention_call",
    "linear_bytes",
    "long_context",
    "memory_bandwidth",
    "quality",
    "run_decode_bench",
    "short_path",
]

FORMATS = (None, "bf16", "int8")  # gpt2.load(weights=...): fp32, then the packed formats


@dataclass(frozen=True)
class DecodeShape:
    """The model and the workload. Defaults: GPT-2 small (124M parameters), a 128-token prompt
    and 128 new tokens."""

    layers: int = 12
    embed_dim: int = 768
    heads: int = 12
    vocab: int = 50257
    positions: int = 1024
    prompt: int = 128
    new_tokens: int = 128


QUICK = DecodeShape(layers=2, embed_dim=64, heads=4, vocab=1000, positions=64, prompt=16,
                    new_tokens=8)  # fmt: skip


# readings further apart than this ratio are reported as a moved bandwidth
BANDWIDTH_MOVED = 1.15


def attention_call(
    batch: int, heads: int, head_dim: int, *, cache: int = 1024, calls: int = 200
) -> dict[str, float | str]:
    """One decoding step's attention call, as a layer makes it: one new query per row over a
    ``cache``-token cache (no mask), ``multihead.attention`` (auto's choice, the NaN rule
    and all) against torch's SDPA on the same tensors. Best of 5 rounds of ``calls`` calls,
    the two interleaved; microseconds per call."""
    import torch.nn.functional as F

    from ..functional import attention, explain_backend

    g = torch.Generator().manual_seed(2)
    q = torch.randn(batch, heads, 1, head_dim, generator=g)
    k, v = (torch.randn(batch, heads, cache, head_dim, generator=g) for _ in range(2))
    contenders = {
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v),
        "multihead": lambda: attention(q, k, v),
    }
    best = dict.fromkeys(contenders, float("inf"))
    with torch.inference_mode():
        for fn in contenders.values():
            for _ in range(10):  # warm-up (and auto's one measurement of this shape class)
                fn()
        for _ in range(5):
            for name, fn in contenders.items():
                start = time.perf_counter()
                for _ in range(calls):
                    fn()
                best[name] = min(best[name], (time.perf_counter() - start) / calls)
        backend = explain_backend(q, k, v).backend
    us = {name: t * 1e6 for name, t in best.items()}
    return {
        "sdpa_us": us["sdpa"],
        "multihead_us": us["multihead"],
        "above_sdpa_us": us["multihead"] - us["sdpa"],
        "backend": backend,
    }


@dataclass(frozen=True)
class LongContext:
    """One decoding step's attention over a long cache: B=1, one query row per head."""

    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    length: int = 32768


LONG = LongContext()
LONG_QUICK = LongContext(heads=4, kv_heads=2, head_dim=32, length=2048)
# issue 33's goals for that call: against torch SDPA (enable_gqa=True), and against the read
# bandwidth measured in the same run on the K/V bytes
LONG_GOAL_VS_SDPA, LONG_GOAL_BANDWIDTH = 2.0, 0.70


def long_context(
    shape: LongContext = LONG,
    *,
    bandwidth: float,
    repeats: int = 7,
    say: Callable[[str], None] = print,
) -> list[dict]:
    """``multihead.attention`` against torch's SDPA (``enable_gqa=True``) on one query row per
    head over a ``shape.length``-token cache, float32 and bfloat16: the medians of
    ``repeats`` interleaved runs (after a warm-up that includes ``auto``'s measurement), the
    K/V bytes read per call, and the goals met or missed."""
    g = torch.Generator().manual_seed(3)
    h, h_kv, d, s = shape.heads, shape.kv_heads, shape.head_dim, shape.length
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(1, h, 1, d, generator=g).to(dtype)
        k, v = (torch.randn(1, h_kv, s, d, generator=g).to(dtype) for _ in range(2))
        rows.append(_long_row(q, k, v, bandwidth, repeats, say))
    return rows


def _long_row(q, k, v, bandwidth: float, repeats: int, say: Callable[[str], None]) -> dict:
    import torch.nn.functional as F

    from ..functional import attention, explain_backend

    contenders = {
        "multihead": lambda: attention(q, k, v),
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
    }
    times: dict[str, list[float]] = {name: [] for name in contenders}
    with torch.inference_mode():
        for fn in contenders.values():
            fn(), fn()
        for _ in range(repeats):
            for name, fn in contenders.items():
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
        backend = explain_backend(q, k, v).backend
    med = {name: statistics.median(t) for name, t in times.items()}
    kv_bytes = (k.numel() + v.numel()) * k.element_size()
    rate = kv_bytes / med["multihead"] / 1e9
    vs_sdpa, fraction = med["sdpa"] / med["multihead"], rate / bandwidth
    goals = [
        {"text": f"vs SDPA >= {LONG_GOAL_VS_SDPA:g}x", "figure": vs_sdpa,
         "met": vs_sdpa >= LONG_GOAL_VS_SDPA},
        {"text": f"read bandwidth >= {LONG_GOAL_BANDWIDTH:.0%}", "figure": fraction,
         "met": fraction >= LONG_GOAL_BANDWIDTH},
    ]  # fmt: skip
    name = str(q.dtype).removeprefix("torch.")
    (_, h, _, d), (_, h_kv, s, _) = q.shape, k.shape
    say(
        f"long-context decode, {name}, B=1, {h}/{h_kv} heads, D={d}, S={s:,} "
        f"({kv_bytes / 1e6:.0f} MB of K/V): multihead ({backend}) "
        f"{med['multihead'] * 1e3:.2f} ms = {rate:.1f} GB/s ({fraction:.0%} of "
        f"{bandwidth:.1f}), SDPA {med['sdpa'] * 1e3:.2f} ms: {vs_sdpa:.2f}x"
    )
    for goal in goals:
        say(goal_line(goal))
    return {
        "dtype": name, "backend": backend, "median_s": med, "times_s": times,
        "kv_bytes": kv_bytes, "gb_per_s": rate, "fraction_of_bandwidth": fraction,
        "vs_sdpa": vs_sdpa, "goals": goals,
    }  # fmt: skip


def short_path(
    weights: str | None = None,
    *,
    shape: DecodeShape | None = None,
    rounds: int = 8,
    steps: int = 64,
    say: Callable[[str], None] = print,
) -> dict:
    """A decoding step of ``multihead.models.gpt2`` on the modules' path, on the Python short
    path through its layers (``modules/decoding_python.py``) and in one C++ call
    (``modules/decoding_native.py``), in one process on the same model and prompt:
    each round times ``generate(ids, steps + 1)`` and ``generate(ids, 1)`` on both paths, best
    of two each, and a step is their difference over ``steps``; medians of ``rounds``
    alternating rounds, in ms per step. ``weights``: None (fp32), "bf16" or "int8"; ``shape``:
    GPT-2 small by default (a small ``DecodeShape`` shows the overhead alone)."""
    from .._machine import cpu_info
    from ..models import gpt2
    from ..modules import decoding_native as native_step
    from ..modules import decoding_python as python_step
    from .measuring import matmul_peaks

    shape = shape or DecodeShape()
    peaks = matmul_peaks(1024)
    say(
        f"CPU: {cpu_info()[0]}; {torch.get_num_threads()} threads; matmul peak fp32 "
        f"{peaks['float32']:.0f} GFLOP/s, bf16 {peaks['bfloat16']:.0f} GFLOP/s; read bandwidth "
        f"{memory_bandwidth():.1f} GB/s"
    )
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _build(shape, Path(tmp))
        model = gpt2.load(tmp, weights=weights)
    ids = torch.randint(
        0, shape.vocab, (1, shape.prompt), generator=torch.Generator().manual_seed(3)
    )
    was = python_step.enabled, native_step.enabled
    # (Python short path, C++ step) per row: the modules, the Python short path, the C++ step
    paths = {"modules": (False, False), "short path": (True, False), "C++ step": (True, True)}

    def run(name: str, new: int) -> tuple[float, torch.Tensor]:
        python_step.enabled, native_step.enabled = paths[name]
        start = time.perf_counter()
        out = model.generate(ids, new)
        return time.perf_counter() - start, out

    try:
        tokens = {name: run(name, steps + 1)[1] for name in paths}
        same = torch.equal(tokens["short path"], tokens["modules"])
        same_native = torch.equal(tokens["C++ step"], tokens["modules"])
        per_step: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(rounds):
            for name in paths:
                whole = min(run(name, steps + 1)[0] for _ in range(2))
                first = min(run(name, 1)[0] for _ in range(2))
                per_step[name].append((whole - first) / steps * 1e3)
    finally:
        python_step.enabled, native_step.enabled = was
    med = {name: statistics.median(t) for name, t in per_step.items()}
    say(
        f"{shape.layers} layers, E={shape.embed_dim}, {_name(weights)}: a step on the modules' "
        f"path {med['modules']:.2f} ms, on the short path {med['short path']:.2f} ms, in one "
        f"C++ call {med['C++ step']:.2f} ms (medians of {rounds} rounds); tokens "
        + ("identical" if same else "DIFFER")
        + ("" if same_native else " (the C++ step's DIFFER)")
    )
    return {
        "ms_per_step": med,
        "rounds_ms": per_step,
        "tokens_identical": same,
        "native_tokens_identical": same_native,
    }


def _build(shape: DecodeShape, folder: Path):
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=shape.vocab,
        n_positions=shape.positions,
        n_embd=shape.embed_dim,
        n_layer=shape.layers,
        n_head=shape.heads,
        bos_token_id=shape.vocab - 1,  # GPT-2's <|endoftext|> is the last id
        eos_token_id=shape.vocab - 1,
    )
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    # every row gets exactly new_tokens tokens, as ours does without eos_token_id
    theirs.generation_config.eos_token_id = None
    theirs.generation_config.pad_token_id = 0
    return theirs


def _name(weights: str | None) -> str:
    return "multihead fp32" if weights is None else f"multihead {weights} weights"


def _contenders(models: dict, theirs, ids: torch.Tensor, new: int) -> dict[str, Callable]:
    """Each contender's ``generate`` of ``new`` tokens, as a function of a streamer."""
    mask = torch.ones_like(ids)

    def hf(**kw):
        def call(streamer: Stamps):
            with torch.inference_mode():
                return theirs.generate(
                    ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                    streamer=streamer, **kw,
                )  # fmt: skip

        return call

    ours = {
        _name(w): (lambda streamer, m=m: m.generate(ids, new, streamer=streamer))
        for w, m in models.items()
    }
    return {
        **ours,
        "transformers generate (dynamic cache)": hf(),
        "transformers generate (static cache)": hf(cache_implementation="static"),
    }


@dataclass(frozen=True, kw_only=True)
class DecodeBenchOptions(Timed):
    """What ``multihead bench decode`` takes (``multihead bench decode --help``)."""

    quick: bool = option(False, "a small model, seconds")
    model: Path | None = option(
        None,
        "smollm2 or a Llama .gguf file: the real model against llama.cpp and transformers; "
        "or a trained GPT-2/Llama folder with --text: quality rows of bf16/int8",
        metavar="MODEL",
    )
    text: Path | None = option(
        None,
        "held-out UTF-8 text: perplexity per weight kind (with a folder: required)",
        metavar="FILE",
    )

    def __post_init__(self) -> None:
        if self.real_model:  # --text optional: the weight kinds' perplexity over it
            return
        if (self.model is None) != (self.text is None):
            raise ValueError(
                "--model and --text go together (a trained model folder and held-out text for "
                "the quality rows), or --model smollm2 (or a .gguf file) alone. Received: "
                f"--model {self.model}, --text {self.text}"
            )

    @property
    def real_model(self) -> bool:
        """--model names a real model to time (``smollm2`` or a .gguf file)."""
        from ..hf.loading import is_llm_source

        return self.model is not None and is_llm_source(str(self.model))


def run_decode_bench(
    options: DecodeBenchOptions,
    *,
    batch_sizes: tuple[int, ...] = (1, 8),
    say: Callable[[str], None] = print,
) -> dict:
    """Time greedy generation for every batch size and weight format; write decode.json and
    decode.png. With ``options.model`` (a trained GPT-2/Llama folder) and ``options.text``
    (held-out text), add the packed formats' quality (``quality``)."""
    from .._machine import cpu_info
    from ..models import gpt2
    from .measuring import matmul_peaks

    shape, repeats = QUICK if options.quick else DecodeShape(), options.repeats or 3
    model, text = options.model, options.text
    out = V.check_out_dir("--out", options.out)  # before the work
    if options.real_model:
        return _real_model(str(model), out, repeats, say, text)
    cpu = cpu_info()[0]
    bandwidth = memory_bandwidth()
    size = 512 if shape.embed_dim < 256 else 1024
    peaks = matmul_peaks(size)
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' notes about generation settings
        theirs = _build(shape, Path(tmp))
        models = {w: gpt2.load(tmp, weights=w) for w in FORMATS}
    ours = models[None]
    weight_bytes = {_name(w): linear_bytes(m) for w, m in models.items()}
    hf_bytes = weight_bytes[_name(None)]
    cache_bytes = ours.new_cache(1).bytes_per_token
    say(f"CPU: {cpu}; {torch.get_num_threads()} threads; torch {torch.__version__}")
    say(
        f"matmul peak fp32 {peaks['float32']:.0f} GFLOP/s, bf16 {peaks['bfloat16']:.0f} GFLOP/s; "
        f"measured read bandwidth {bandwidth:.1f} GB/s"
    )
    say(
        f"GPT-2-shaped random model: {shape.layers} layers, E={shape.embed_dim}, "
        f"{shape.heads} heads, vocab {shape.vocab} "
        f"({hf_bytes / 1e6:.0f} MB of fp32 linear weights); "
        f"prompt {shape.prompt}, {shape.new_tokens} new tokens, {repeats} interleaved repeats; "
        f"KV cache {cache_bytes} bytes per token"
    )
    calls = _attention_calls(shape, batch_sizes, say)
    long = long_context(LONG_QUICK if options.quick else LONG, bandwidth=bandwidth, say=say)
    g = torch.Generator().manual_seed(1)
    results = []
    steps = [f"B={b}" for b in batch_sizes]
    with stages("bench decode", steps, unit="batch size", say=say) as (bar, tell):
        for b, step in zip(batch_sizes, steps):
            bar.begin(step)
            results.append(
                _time_batch(
                    b,
                    models,
                    theirs,
                    shape,
                    repeats,
                    g,
                    weight_bytes,
                    hf_bytes,
                    cache_bytes,
                    bandwidth,
                    tell,
                )
            )
    readings = _read_again(bandwidth, results, say)
    report = {
        "command": "multihead bench decode" + (f" --repeats {repeats}" if repeats != 3 else ""),
        "cpu": cpu,
        "shape": shape.__dict__,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "bandwidth_gb_s": bandwidth,
        "bandwidth_readings_gb_s": readings,
        "matmul_peak_gflops": peaks,
        "weight_bytes": weight_bytes,
        "kv_cache_bytes_per_token": cache_bytes,
        "attention_call": calls,
        "long_context": long,
        "results": results,
    }
    if model is not None and text is not None:
        report["quality"] = quality(model, text, say=say)
    out.mkdir(exist_ok=True)
    (out / "decode.json").write_text(json.dumps(report, indent=2))
    chart = _chart(report, out / "decode.png")
    say(f"\nwrote {out / 'decode.json'}" + (f" and {chart}" if chart else ""))
    return report


def _real_model(
    source: str, out: Path, repeats: int, say: Callable[[str], None], text: Path | None
) -> dict:
    """``--model smollm2``: the real model's table (``decode_model``), in decode.json and
    decode.png."""
    from .decode_model import run_model_bench

    report = run_model_bench(source, out, repeats, say, text)
    out.mkdir(exist_ok=True)
    (out / "decode.json").write_text(json.dumps(report, indent=2))
    chart = _model_chart(report, out / "decode.png")
    say(f"\nwrote {out / 'decode.json'}" + (f" and {chart}" if chart else ""))
    return report


def _read_again(bandwidth: float, results: list[dict], say: Callable[[str], None]) -> list[float]:
    """[the start's reading, a reading after all the timings]: a virtual machine's read
    bandwidth can move by 2x within a run (neighbours, host placement). Each row gets its
    decoding steps' fractions against the second reading too; the lines say so when the two
    differ by more than ``BANDWIDTH_MOVED``."""
    readings = [bandwidth, memory_bandwidth()]
    for row in results:
        row["step_fraction_of_end_bandwidth"] = {
            name: fraction * bandwidth / readings[1]
            for name, fraction in row["step_fraction_of_bandwidth"].items()
        }
    if max(readings) > BANDWIDTH_MOVED * min(readings):
        say(
            f"\nthe read bandwidth moved during the run: {readings[0]:.1f} GB/s at the start, "
            f"{readings[1]:.1f} GB/s at the end; the whole runs' fractions above are against "
            "the start's, the goals against the readings beside the repeats"
        )
        for row in results:
            at_end = row["step_fraction_of_end_bandwidth"]
            say(
                f"  B={row['batch']}, decoding steps against the end's reading: "
                + ", ".join(f"{name} {at_end[name]:.0%}" for name in map(_name, FORMATS))
            )
    return readings


def _attention_calls(shape: DecodeShape, batch_sizes, say: Callable[[str], None]) -> dict:
    head_dim = shape.embed_dim // shape.heads
    calls = {f"B={b}": attention_call(b, shape.heads, head_dim) for b in batch_sizes}
    for name, c in calls.items():
        say(
            f"attention call, {name}, one query over a 1,024-token cache ({shape.heads} heads, "
            f"D={head_dim}): multihead ({c['backend']}) {c['multihead_us']:.0f} us, raw SDPA "
            f"{c['sdpa_us']:.0f} us: {c['above_sdpa_us']:+.0f} us"
        )
    return calls


def _time_batch(b, models, theirs, shape, repeats, g, weight_bytes, hf_bytes, cache_bytes,
                bandwidth, say) -> dict:  # fmt: skip
    ids = torch.randint(0, shape.vocab, (b, shape.prompt), generator=g)
    contenders = _contenders(models, theirs, ids, shape.new_tokens)
    names = list(contenders)
    # warm-up, and the tokens
    outputs = {name: fn(Stamps()) for name, fn in contenders.items()}
    times, first_times, step_spans, readings = timed(contenders, repeats)
    beside = statistics.median(readings)
    med, med_first, med_spans = map(_medians, (times, first_times, step_spans))
    # decoding steps alone: the tokens after the first, over the time from the first new
    # token to the last (stamped as they came, in the same runs)
    steps = {name: b * (shape.new_tokens - 1) / max(med_spans[name], 1e-9) for name in names}
    tokens = b * shape.new_tokens
    # a step reads every weight once for the whole batch, plus each row's cache
    mean_keys = shape.prompt + (shape.new_tokens - 1) / 2
    per_token = {
        name: (weight_bytes.get(name, hf_bytes) + b * mean_keys * cache_bytes) / b for name in names
    }
    rate = {name: tokens / t for name, t in med.items()}
    hf = "transformers generate (dynamic cache)"
    fp32 = outputs[_name(None)]
    row = {
        "batch": b,
        "median_s": med,
        "times_s": times,
        "tokens_per_s": rate,
        "vs_transformers": {name: rate[name] / rate[hf] for name in names},
        "bytes_read_per_token": per_token,
        "gb_per_s": _fractions(per_token, rate, 1.0),
        "bandwidth_bound_tokens_per_s": bandwidth * 1e9 / per_token[_name(None)],
        "fraction_of_bandwidth": _fractions(per_token, rate, bandwidth),
        "prompt_s": med_first,  # the time to the first new token
        "steps_s": med_spans,  # the time from the first new token to the last
        "step_tokens_per_s": steps,
        "step_fraction_of_bandwidth": _fractions(per_token, steps, bandwidth),
        # the same against the readings taken between the timed repeats (their median): the
        # bandwidth while these steps ran, which a virtual machine can move by 2x in minutes
        "bandwidth_beside_gb_s": readings,
        "step_fraction_of_bandwidth_beside": _fractions(per_token, steps, beside),
        # fp32 against transformers must be identical; packed formats: the share of tokens
        # equal to fp32's (a different token early changes every later one)
        "identical_tokens": {
            name: bool(torch.equal(outputs[name], fp32))
            for name in names
            if name.startswith("transformers")
        },
        "tokens_equal_to_fp32": {
            name: float((outputs[name] == fp32).float().mean()) for name in names
        },
    }
    row["goals"] = _goals(row) if b == 1 else []
    _say_row(row, bandwidth * 1e9 / per_token[_name(None)], say)
    return row


def _medians(runs: dict[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(t) for name, t in runs.items()}


def _fractions(per_token: dict, rates: dict, reading: float) -> dict[str, float]:
    """Each contender's bytes per token x tokens/s, in GB/s, over ``reading`` (GB/s)."""
    return {name: per_token[name] * rates[name] / 1e9 / reading for name in rates}


# issue 33's goals at B=1: decoding steps at >= 70% of the read bandwidth (fp32, and the
# packed formats against their own bytes); fp32 generation >= 2x transformers'
STEP_GOAL_BANDWIDTH, GOAL_VS_TRANSFORMERS = 0.70, 2.5
# (issue 33 asked 2x transformers; issue 52, with the whole step in one C++ call, asks 2.5x
# at B=1 with identical tokens)


def _goals(row: dict) -> list[dict]:
    fraction = row["step_fraction_of_bandwidth_beside"]
    goals = [
        {"text": f"{name} decoding steps >= {STEP_GOAL_BANDWIDTH:.0%} of the read bandwidth "
                 "beside them",
         "figure": fraction[name], "met": fraction[name] >= STEP_GOAL_BANDWIDTH}
        for name in map(_name, FORMATS)
    ]  # fmt: skip
    ratio = row["vs_transformers"][_name(None)]
    goals.append({
        "text": f"multihead fp32 >= {GOAL_VS_TRANSFORMERS:g}x transformers", "figure": ratio,
        "met": ratio >= GOAL_VS_TRANSFORMERS,
    })  # fmt: skip
    return goals


def _say_row(row: dict, bound: float, say: Callable[[str], None]) -> None:
    """The lines of one batch size: the bandwidth's bound, then every contender."""
    say(f"\nB={row['batch']}: the bandwidth allows at most {bound:.0f} fp32 tokens/s")
    for name, rate in row["tokens_per_s"].items():
        extra = f"  {row['vs_transformers'][name]:.2f}x transformers"
        extra += f", {row['gb_per_s'][name]:.1f} GB/s = {row['fraction_of_bandwidth'][name]:.0%}"
        if name in row["identical_tokens"]:
            same = row["identical_tokens"][name]
            extra += ", identical tokens" if same else ", TOKENS DIFFER from multihead fp32"
        elif name != _name(None):
            extra += f", {row['tokens_equal_to_fp32'][name]:.0%} of tokens equal fp32's"
        say(f"  {name:40} {rate:7.1f} tokens/s{extra}")
    readings = row["bandwidth_beside_gb_s"]
    say(
        "  decoding steps alone (from the first new token to the last), against the "
        f"start's reading and against the {len(readings)} readings beside the repeats (median "
        f"{statistics.median(readings):.1f} GB/s; {', '.join(f'{r:.1f}' for r in readings)}):"
    )
    for name, rate in row["step_tokens_per_s"].items():
        fraction = row["step_fraction_of_bandwidth"][name]
        beside = row["step_fraction_of_bandwidth_beside"][name]
        say(
            f"  {name:40} {rate:7.1f} tokens/s = {fraction:.0%} of the start's, {beside:.0%} beside"
        )
    for goal in row["goals"]:
        say(goal_line(goal))


def quality(
    folder: Path | str,
    text: Path | str,
    *,
    formats: tuple[str, ...] = ("bf16", "int8"),
    max_tokens: int = 8192,
    say: Callable[[str], None] = print,
) -> dict:
    """Held-out perplexity of a trained decoder in fp32 and with each packed weight format,
    and the share of positions where the format's most likely next token is fp32's.

    Args:
        folder: a GPT-2 or Llama folder with ``tokenizer.json`` (``multihead train lm``).
        text: a UTF-8 text file the model was not trained on.
        formats: the ``weights=`` values to compare with fp32.
        max_tokens: tokens of the text used at most (windows of the model's positions, 256
            at most).

    Returns:
        {"tokens": n, "fp32": {"perplexity": p}, "int8": {"perplexity": p,
        "perplexity_vs_fp32": ratio, "top1_agreement": share}, ...}
    """
    from ..models import families

    body = Path(text).read_text(encoding="utf-8")
    base = families.load(folder)
    if getattr(base, "tokenizer", None) is None:
        raise ValueError(f"{folder} has no tokenizer.json; quality needs one. Received: {folder}")
    ids = torch.tensor(base.tokenizer.encode(body).ids[:max_tokens])
    window = min(256, base.max_positions or 256)
    if ids.numel() < 2:
        raise ValueError(f"{text} holds fewer than 2 tokens. Received: {ids.numel()} tokens")
    chunks = [ids[i : i + window] for i in range(0, ids.numel() - 1, window)]
    chunks = [c for c in chunks if c.numel() > 1]

    def scores(model):
        nll, top, n = 0.0, [], 0
        with torch.inference_mode():
            for c in chunks:
                logits = model(c[None])[0, :-1].double()
                nll += float(torch.nn.functional.cross_entropy(logits, c[1:], reduction="sum"))
                top.append(logits.argmax(-1))
                n += c.numel() - 1
        return math.exp(nll / n), torch.cat(top), n

    ppl, top, n = scores(base)
    report: dict = {"tokens": n, "fp32": {"perplexity": ppl}}
    say(f"\nquality on {n} held-out tokens of {text}: fp32 perplexity {ppl:.3f}")
    for w in formats:
        p, t, _ = scores(families.load(folder, weights=w))
        agree = float((t == top).double().mean())
        report[w] = {"perplexity": p, "perplexity_vs_fp32": p / ppl, "top1_agreement": agree}
        say(f"  {w} weights: perplexity {p:.3f} ({p / ppl - 1:+.2%}), top-1 agreement {agree:.2%}")
    return report


def _chart(report: dict, path: Path) -> Path | None:
    """Tokens/s per batch size for every contender, with the bandwidth bound; None without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = report["results"]
    names = list(rows[0]["tokens_per_s"])
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / (len(names) + 1)
    for i, name in enumerate(names):
        xs = [j + (i - len(names) / 2) * width for j in range(len(rows))]
        ax.bar(xs, [r["tokens_per_s"][name] for r in rows], width, label=name)
    xs = [j + (len(names) / 2) * width for j in range(len(rows))]
    ax.bar(xs, [r["bandwidth_bound_tokens_per_s"] for r in rows], width, color="lightgray",
           label=f"bound at {report['bandwidth_gb_s']:.0f} GB/s")  # fmt: skip
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([f"B={r['batch']}" for r in rows])
    ax.set_ylabel("generated tokens / s")
    s = report["shape"]
    ax.set_title(
        f"greedy decoding, {s['layers']} layers E={s['embed_dim']}, prompt {s['prompt']}, "
        f"{s['new_tokens']} new, {report['threads']} threads"
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _model_chart(report: dict, path: Path) -> Path | None:
    """The real model's ms per decoding step for every contender, each bar labelled with its
    share of the read bandwidth; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    row = report["real_model"]
    names = list(row["step_ms"])
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(names) + 1.5))
    colors = ["tab:orange" if n.startswith("llama.cpp") else "tab:blue" for n in names]
    bars = ax.barh(names, [row["step_ms"][n] for n in names], color=colors)
    for bar, name in zip(bars, names):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2,
                f" {row['step_fraction_of_bandwidth'][name]:.0%} of bandwidth",
                va="center", fontsize=8)  # fmt: skip
    ax.invert_yaxis()
    ax.set_xlabel("ms per decoding step (lower is faster)")
    w = report["workload"]
    ax.set_title(
        f"{report['model']['source']}: B={w['batch']}, greedy, prompt {w['prompt_tokens']}, "
        f"{w['new_tokens']} new, {report['threads']} threads", fontsize=9,
    )  # fmt: skip
    ax.margins(x=0.25)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
