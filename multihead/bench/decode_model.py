"""``multihead bench decode --model smollm2``: greedy decoding of a real model (SmolLM2-135M,
or any Llama-family GGUF file or folder) by multihead's own decoder in each weight kind, by
transformers' ``generate()`` on sdpa and on multihead (with ``fast_decoding``),
and by llama.cpp at the same precisions where ``llama_cpp`` (llama-cpp-python) is importable.

Every contender runs in this process on the same prompt ids, interleaved (the order rotates
from one repeat to the next), and is timed per decoding step from a streamer's stamps (the
time from the first new token to the last, over the tokens after the first). The share of
the read bandwidth is each step's bytes (the weights as held, read once per step, and the KV
cache at its mean length) times the steps per second, over the bandwidth measured between
the repeats (their median).

llama.cpp is never a dependency of multihead: it is a contender when installed
(``pip install llama-cpp-python``, which compiles llama.cpp, about 12 minutes on 2 cores).
Its F32, BF16 and Q8_0 files are made from the model's GGUF file once with its own
``llama_model_quantize`` (the Q4_1 values dequantized, then stored at that precision) and
kept in the user's cache beside the converted folder (``multihead.hf.loading.cache_root``).
"""

from __future__ import annotations

import importlib.util
import math
import os
import signal
import statistics
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .decode_timing import Stamps, linear_bytes, memory_bandwidth, timed

__all__ = ["GOALS", "run_model_bench"]

PROMPT = "The printing press changed how books were made in Europe, because the new"
PROMPT_TOKENS, NEW_TOKENS = 12, 96
# multihead's weight kinds beside llama.cpp's file types at the same precision
KINDS = (
    ("float32", None, "F32"),
    ("bf16", "bf16", "BF16"),
    ("int8", "int8", "Q8_0"),
    ("w8a16", "w8a16", "Q8_0"),  # int8 codes, activations rounded to int16: integer sums
)
GOALS = {
    "vs_llama_cpp": 1.0,  # multihead's own decoder at least as fast as llama.cpp, per precision
    # share of the read bandwidth
    "bandwidth": {"float32": 0.75, "bf16": 0.75, "int8": 0.70, "w8a16": 0.70},
    "hf_vs_sdpa": 2.0,  # transformers' generate() on multihead against sdpa
}
SDPA, HF_MULTIHEAD = "transformers sdpa", "transformers multihead + fast_decoding"
LLAMA_CPP_INSTALL = "pip install llama-cpp-python==0.3.36"


def _ours(kind: str) -> str:
    return f"multihead {kind}"


def _theirs(kind: str) -> str:
    return f"llama.cpp {kind}"


def run_model_bench(
    source: str,
    out: Path,
    repeats: int,
    say: Callable[[str], None],
    text: Path | None = None,
) -> dict[str, Any]:
    """Time every contender on ``source`` (``"smollm2"``, a GGUF file or a Llama folder) and
    return the report ``run_decode_bench`` writes (decode.json, decode.png). With ``text``,
    the report adds each weight kind's perplexity over it, from one-row steps (``quality``)."""
    from .._machine import cpu_info
    from .._progress import stages
    from ..hf import loading
    from .measuring import matmul_peaks

    where = loading.resolve(source)
    threads = torch.get_num_threads()
    cpu, peaks, bandwidth = cpu_info()[0], matmul_peaks(512), memory_bandwidth()
    say(f"CPU: {cpu}; {threads} threads; torch {torch.__version__}")
    say(
        f"matmul peak fp32 {peaks['float32']:.0f} GFLOP/s, bf16 {peaks['bfloat16']:.0f} GFLOP/s; "
        f"measured read bandwidth {bandwidth:.1f} GB/s"
    )
    steps = ["multihead", "transformers", "llama.cpp"]
    with stages("bench decode --model", steps, unit="contender", say=say) as (bar, tell):
        bar.begin("multihead")
        models = _own_models(where.path)
        bar.begin("transformers")
        hf_models, ids = _transformers(source)
        bar.begin("llama.cpp")
        cpp, cpp_note = _llama_cpp(where, threads, tell)
    config = models[_ours("float32")].config
    cache_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * _head_dim(config)
    # the linear layers' weights as held (the tied output product reads the embedding whole);
    # transformers' models hold multihead float32's weights
    weight_bytes = {name: linear_bytes(m) for name, m in models.items()}
    weight_bytes.update(dict.fromkeys(hf_models, weight_bytes[_ours("float32")]))
    weight_bytes.update({name: path.stat().st_size for name, (_, path) in cpp.items()})
    contenders = _contenders(models, hf_models, {n: llm for n, (llm, _) in cpp.items()}, ids)
    say(
        f"{source}: {config.num_hidden_layers} layers, width {config.hidden_size}, prompt "
        f"{ids.shape[1]} tokens, {NEW_TOKENS} new, B=1, greedy, {repeats} interleaved repeats"
        + ("" if cpp else f"; llama.cpp left out: {cpp_note}")
    )
    outputs = {name: fn(Stamps()) for name, fn in contenders.items()}  # warm-up, the tokens
    _, first, spans, readings = timed(contenders, repeats)
    beside = statistics.median(readings)
    row = _row(outputs, first, spans, readings, weight_bytes, cache_bytes, ids.shape[1], beside)
    report = {
        "command": f"multihead bench decode --model {source}"
        + (f" --repeats {repeats}" if repeats != 3 else ""),
        "cpu": cpu,
        "threads": threads,
        "torch": torch.__version__,
        "matmul_peak_gflops": peaks,
        "bandwidth_gb_s": bandwidth,
        "bandwidth_readings_gb_s": readings,
        "model": {
            "source": source,
            "path": str(where.path),
            "layers": config.num_hidden_layers,
            "width": config.hidden_size,
        },
        "workload": {"batch": 1, "prompt_tokens": int(ids.shape[1]), "new_tokens": NEW_TOKENS},
        "llama_cpp": cpp_note,
        "real_model": row,
    }
    _say(row, say)
    if text is not None:
        report["quality"] = quality(models, hf_models[SDPA].config, text, say)
    return report


def quality(
    models: dict[str, Any],
    config: Any,
    text: Path,
    say: Callable[[str], None],
    max_tokens: int = 512,
) -> dict[str, Any]:
    """Each of multihead's weight kinds' perplexity over the first ``max_tokens`` tokens of
    ``text``, teacher-forced through one-row decoding steps (the products decoding runs:
    "w8a16" rounds its activations only there; a whole-sequence forward runs F.linear), and the
    share of positions whose most likely next token is float32's."""
    first = models[_ours("float32")]
    ids = torch.tensor(first.tokenizer.encode(Path(text).read_text(encoding="utf-8")).ids)
    ids = ids[: min(max_tokens, config.max_position_embeddings)][None]
    if ids.shape[1] < 2:
        raise ValueError(f"{text} holds fewer than 2 tokens. Received: {ids.shape[1]} tokens")
    found: dict[str, Any] = {"tokens": int(ids.shape[1] - 1), "text": str(text)}
    tops = {}
    for name, model in models.items():
        cache, nll, top = model.new_cache(1), 0.0, []
        with torch.inference_mode():
            for i in range(ids.shape[1] - 1):
                hidden = model.extend(ids[:, i : i + 1], 1, cache)
                logits = model.lm_head(hidden)[0, -1].double()
                nll -= float(torch.log_softmax(logits, -1)[ids[0, i + 1]])
                top.append(int(logits.argmax()))
        tops[name] = torch.tensor(top)
        found[name] = {"perplexity": math.exp(nll / (ids.shape[1] - 1))}
    base = found[_ours("float32")]["perplexity"]
    say(f"\nperplexity over {ids.shape[1] - 1} tokens of {text}, one-row steps:")
    for name in models:
        entry = found[name]
        entry["vs_float32"] = entry["perplexity"] / base
        entry["top1_agreement"] = float((tops[name] == tops[_ours("float32")]).double().mean())
        say(
            f"  {name:<20} {entry['perplexity']:8.3f} ({entry['vs_float32'] - 1:+.2%}), "
            f"top-1 agreement with float32 {entry['top1_agreement']:.1%}"
        )
    return found


def _own_models(path: Path) -> dict[str, Any]:
    from ..models import llama

    return {_ours(kind): llama.load(path, weights=w) for kind, w, _ in KINDS}


def _transformers(source: str) -> tuple[dict[str, Any], torch.Tensor]:
    """transformers' model on sdpa and on multihead's attention with its decoding steps in one
    C++ call (``multihead.hf.fast_decoding``), each from its own load (its own config), and
    the prompt."""
    from ..hf import fast_decoding, loading

    sdpa, tokenizer = loading.load_with_tokenizer(source, attn_implementation="sdpa")
    ours, _ = loading.load_with_tokenizer(source)
    fast_decoding(ours)
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"][:, :PROMPT_TOKENS]
    return {SDPA: sdpa, HF_MULTIHEAD: ours}, ids


def _llama_cpp(
    where: Any, threads: int, say: Callable[[str], None]
) -> tuple[dict[str, tuple[Any, Path]], str]:
    """llama.cpp's models per precision ({name: (Llama, file)}) and a note: what ran, what was
    left out and why (not installed, a source without a GGUF file, a file its build cannot
    run on this machine). Each file is first run in a child process, so a build that dies on
    an instruction this machine refuses costs one row, not the benchmark."""
    if not _installed():
        return {}, f"llama_cpp is not importable (install it with {LLAMA_CPP_INSTALL})"
    if where.gguf_file is None:
        return {}, "the source is a folder; llama.cpp reads GGUF files"
    import llama_cpp

    files = {_theirs(kind): _quantized(where, kind, threads, say) for _, _, kind in KINDS}
    # (Q8_0 serves as int8's and w8a16's contender alike: one row)
    files[_theirs("Q4_1")] = where.path
    left_out = {name: why for name, path in files.items() if (why := _fails(path, threads))}
    for name, why in left_out.items():
        say(f"{name} left out: {why}")
    made = {
        name: (
            llama_cpp.Llama(model_path=str(path), n_ctx=256, n_threads=threads,
                            n_threads_batch=threads, verbose=False, seed=0),
            path,
        )
        for name, path in files.items()
        if name not in left_out
    }  # fmt: skip
    note = f"llama-cpp-python {llama_cpp.__version__}"
    if left_out:
        note += "; left out: " + "; ".join(f"{n} ({why})" for n, why in left_out.items())
    return made, note


def _installed() -> bool:
    """Whether llama-cpp-python is importable (found, not imported)."""
    return importlib.util.find_spec("llama_cpp") is not None


# run in a child process: llama.cpp's quantizer (it logs every tensor to stderr) and a first
# evaluation of each file
_QUANTIZE = """
import ctypes, sys, llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype, params.allow_requantize, params.nthread = int(sys.argv[3]), True, int(sys.argv[4])
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(),
                                        ctypes.byref(params)))
"""
_PROBE = """
import sys, llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=64, n_threads=int(sys.argv[2]), verbose=False)
llm.eval([1, 2, 3, 4])
"""


def _child(code: str, *args: object) -> str | None:
    """Run ``code`` in a child Python; None when it succeeded, else why it failed."""
    done = subprocess.run(
        [sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
        timeout=900, check=False,
    )  # fmt: skip
    if done.returncode == 0:
        return None
    if done.returncode < 0:
        return f"llama.cpp died of {signal.Signals(-done.returncode).name} on this machine"
    last = (done.stderr.strip().splitlines() or ["no message"])[-1]
    return f"exit status {done.returncode}: {last[:160]}"


def _fails(path: Path, threads: int) -> str | None:
    """Why llama.cpp cannot evaluate ``path`` here, or None."""
    return _child(_PROBE, path, threads)


def _quantized(where: Any, kind: str, threads: int, say: Callable[[str], None]) -> Path:
    """The model's GGUF file stored as ``kind`` (F32, BF16, Q8_0) by llama.cpp's own
    quantizer, made once into the user's cache."""
    import llama_cpp

    from ..hf import loading

    folder = loading.converted_folder(where)
    name = f"{Path(where.gguf_file).stem}.{kind}.gguf"
    target = folder.parent / f"{folder.name}-llama.cpp" / name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    ftype = {
        "F32": llama_cpp.LLAMA_FTYPE_ALL_F32,
        "BF16": llama_cpp.LLAMA_FTYPE_MOSTLY_BF16,
        "Q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0,
    }[kind]
    partial = target.with_suffix(f".partial-{os.getpid()}")
    say(f"llama.cpp: storing {where.path.name} as {kind}, once (kept in {target.parent})")
    failed = _child(_QUANTIZE, where.path, partial, ftype, threads)
    if failed:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"llama.cpp could not store {where.path} as {kind}: {failed}")
    partial.replace(target)
    return target


def _contenders(
    models: dict[str, Any], hf_models: dict[str, Any], cpp: dict[str, Any], ids: torch.Tensor
) -> dict[str, Callable[[Stamps], torch.Tensor]]:
    """Each contender as a function of a streamer that returns the new tokens (NEW_TOKENS)."""

    def own(model):
        return lambda stamps: model.generate(ids, NEW_TOKENS, streamer=stamps)[0, -NEW_TOKENS:]

    def hf(model):
        def call(stamps: Stamps) -> torch.Tensor:
            with torch.inference_mode(), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # notes about generation settings
                out = model.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                    min_new_tokens=NEW_TOKENS, do_sample=False, streamer=stamps,
                )  # fmt: skip
            return out[0, -NEW_TOKENS:]

        return call

    def cpp_call(llm):
        prompt = ids[0].tolist()

        def call(stamps: Stamps) -> torch.Tensor:
            llm.reset()  # the prompt is evaluated anew, as for the others
            stamps.put(prompt)
            tokens: list[int] = []
            greedy = {"temp": 0.0, "top_k": 1, "top_p": 1.0, "min_p": 0.0, "repeat_penalty": 1.0}
            for token in llm.generate(prompt, **greedy):
                stamps.put(token)
                tokens.append(token)
                if len(tokens) == NEW_TOKENS:
                    break
            return torch.tensor(tokens)

        return call

    return {
        **{name: own(m) for name, m in models.items()},
        **{name: hf(m) for name, m in hf_models.items()},
        **{name: cpp_call(llm) for name, llm in cpp.items()},
    }


def _head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _row(outputs, first, spans, readings, weight_bytes, cache_bytes, prompt, beside) -> dict:
    names = list(outputs)
    med_span = {n: statistics.median(spans[n]) for n in names}
    step_ms = {n: 1e3 * med_span[n] / (NEW_TOKENS - 1) for n in names}
    mean_keys = prompt + (NEW_TOKENS - 1) / 2
    # the KV cache in float32 for every contender (llama.cpp keeps f16): under 1% of a step's
    # bytes here, so the shares do not depend on it
    step_bytes = {n: weight_bytes[n] + mean_keys * cache_bytes * 4 for n in names}
    share = {n: step_bytes[n] / (step_ms[n] / 1e3) / 1e9 / beside for n in names}
    fp32 = outputs[_ours("float32")]
    row = {
        "step_ms": step_ms,
        "tokens_per_s": {n: 1e3 / step_ms[n] for n in names},
        "prompt_s": {n: statistics.median(first[n]) for n in names},
        "step_bytes": step_bytes,
        "bandwidth_beside_gb_s": readings,
        "step_fraction_of_bandwidth": share,
        "tokens_equal_to_multihead_float32": {
            n: float((outputs[n] == fp32).float().mean()) for n in names
        },
    }
    row["goals"] = _goals(row, outputs)
    return row


def _goals(row: dict, outputs: dict) -> list[dict]:
    step, share = row["step_ms"], row["step_fraction_of_bandwidth"]
    goals = []
    for kind, _, cpp_kind in KINDS:
        ours, theirs = _ours(kind), _theirs(cpp_kind)
        if theirs in step:
            ratio = step[theirs] / step[ours]
            goals.append({"text": f"{ours} at least as fast as {theirs}", "figure": ratio,
                          "met": ratio >= GOALS["vs_llama_cpp"]})  # fmt: skip
        want = GOALS["bandwidth"][kind]
        goals.append({"text": f"{ours} steps >= {want:.0%} of the read bandwidth beside them",
                      "figure": share[ours], "met": share[ours] >= want})  # fmt: skip
    ratio = step[SDPA] / step[HF_MULTIHEAD]
    goals.append({"text": f"{HF_MULTIHEAD} >= {GOALS['hf_vs_sdpa']:.0f}x {SDPA} per step",
                  "figure": ratio, "met": ratio >= GOALS["hf_vs_sdpa"]})  # fmt: skip
    same = bool(torch.equal(outputs[SDPA], outputs[HF_MULTIHEAD]))
    goals.append({"text": f"{HF_MULTIHEAD}'s tokens identical to {SDPA}'s in float32",
                  "figure": float(same), "met": same})  # fmt: skip
    return goals


def _say(row: dict, say: Callable[[str], None]) -> None:
    say(f"\n{'contender':<45} {'ms/step':>8} {'tok/s':>7} {'bandwidth':>9} {'same tokens':>11}")
    for name, ms in row["step_ms"].items():
        say(
            f"{name:<45} {ms:8.2f} {row['tokens_per_s'][name]:7.1f} "
            f"{row['step_fraction_of_bandwidth'][name]:9.0%} "
            f"{row['tokens_equal_to_multihead_float32'][name]:11.0%}"
        )
    for goal in row["goals"]:
        say(f"{'met' if goal['met'] else 'MISSED':>6}  {goal['text']}: {goal['figure']:.2f}")
