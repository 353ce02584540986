"""transformers models on ``attn_implementation="multihead"`` against the implementations
transformers ships, on the same random weights, in one process.

Three model shapes at long inputs, each forward timed whole (projections, MLPs and all) with
every contender interleaved over the repeats; medians are reported with the ratio to the
implementation a user would otherwise pick:

* Llama-like (hidden 256, 4 heads, 2 layers, L=4096): ``"sdpa"`` and ``"eager"``, with and
  without ``output_attentions`` (which only eager gives in transformers);
* Mistral-like with a sliding window of 256 (L=8192): ``"sdpa"`` receives the window as a dense
  (B, 1, L, S) mask and computes every score;
* Gemma-2-like with soft-capping (L=2048): transformers has no sdpa path for it, so ``"eager"``;

plus ``"flex_attention"`` where it runs on this machine, ``capture`` of 2 heads of one
layer of the Llama-like model at L=6144, whose peak memory growth is compared with the size
of the captured tensor, and transformers' ``generate()`` on a Qwen2-0.5B-shaped model (6
layers) at B=1 and B=4 against ``"sdpa"``, greedy tokens compared. Every contender's logits
are checked against the baseline's. The report prints the CPU model and the matmul peaks and
read bandwidth measured in the same run, and writes hf.json and hf.png.
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from .. import _validation as V
from .._flags import option
from .._progress import stages
from .options import Timed, goal_line

__all__ = [
    "GENERATE",
    "WORKLOADS",
    "GenerateWorkload",
    "HfBenchOptions",
    "HfWorkload",
    "peak_growth",
    "run_hf_bench",
]

VOCAB = 1000


@dataclass(frozen=True)
class HfWorkload:
    """One model shape and its contenders.

    ``contenders`` are attention implementations, with ``+weights`` for a forward that asks
    for ``output_attentions``; ``goals`` are (contender, reference, ">=" for a least speedup
    over the reference or "<=" for a most time relative to it, the figure).
    """

    name: str
    what: str  # the model, for the title (the length is added)
    family: str  # "llama", "mistral" or "gemma2"
    length: int
    baseline: str
    contenders: tuple[str, ...]
    goals: tuple[tuple[str, str, str, float], ...] = ()  # (contender, reference, op, figure)
    extra: dict[str, Any] = field(default_factory=dict)  # config settings

    @property
    def title(self) -> str:
        window = self.extra.get("sliding_window")
        what = self.what.replace("window 256", f"window {window}") if window else self.what
        return f"{what}, L={self.length}"


WORKLOADS = (
    HfWorkload(
        "llama",
        "Llama-like, causal",
        "llama",
        4096,
        "sdpa",
        (
            "sdpa",
            "eager",
            "eager+weights",
            "multihead",
            "multihead+weights",
            "flex_attention",
        ),
        (
            ("multihead", "sdpa", ">=", 1.0),
            ("multihead+weights", "eager+weights", ">=", 3.0),
            ("multihead+weights", "multihead", "<=", 1.3),
        ),
    ),
    HfWorkload(
        "mistral-window",
        "Mistral-like, window 256",
        "mistral",
        8192,
        "sdpa",
        ("sdpa", "multihead", "flex_attention"),
        (("multihead", "sdpa", ">=", 5.0),),
        {"sliding_window": 256},
    ),
    HfWorkload(
        "gemma2-softcap",
        "Gemma-2-like, softcap 50",
        "gemma2",
        2048,
        "eager",
        ("eager", "multihead", "flex_attention"),
        (("multihead", "eager", ">=", 3.0),),
        {"attn_logit_softcapping": 50.0, "sliding_window": 4096},
    ),
)
CAPTURE_LENGTH = 6144


def _config(family: str, length: int, extra: dict[str, Any]):
    import transformers as tf

    common: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=length,
    )
    common.update(extra)  # a workload's settings win (num_key_value_heads, windows, caps)
    if family == "llama":
        return tf.LlamaConfig(**common)
    if family == "mistral":
        return tf.MistralConfig(**common)
    return tf.Gemma2Config(**common, head_dim=64, query_pre_attn_scalar=64)


def _build(workload: HfWorkload):
    import transformers as tf

    torch.manual_seed(0)
    config = _config(workload.family, workload.length, workload.extra)
    return tf.AutoModelForCausalLM.from_config(config, attn_implementation=workload.baseline).eval()


class _Contender:
    """One implementation on a copy of the workload's model (the same weights; switching one
    model between implementations makes the next forward a cold one), ``run()`` the timed
    forward."""

    def __init__(self, model, ids: torch.Tensor, name: str) -> None:
        impl, _, weights = name.partition("+")
        self.model, self.ids, self.weights = copy.deepcopy(model), ids, bool(weights)
        self.model.set_attn_implementation(impl)

    def run(self) -> torch.Tensor:
        with torch.inference_mode():
            out = self.model(self.ids, use_cache=False, output_attentions=self.weights)
        return out.logits


def _warm(
    workload: HfWorkload, leave_out: dict[str, str]
) -> tuple[dict[str, _Contender], dict[str, torch.Tensor], dict[str, str]]:
    """The warm-up of ``workload``'s contenders (compiles, measured kernel choices): each one
    that ran and its logits, and why each other did not run."""
    import multihead.hf  # noqa: F401  registers "multihead"

    model = _build(workload)
    ids = torch.randint(0, VOCAB, (1, workload.length), generator=torch.Generator().manual_seed(1))
    runs: dict[str, _Contender] = {}
    logits: dict[str, torch.Tensor] = {}
    skipped = {n: why for n, why in leave_out.items() if n in workload.contenders}
    for name in workload.contenders:
        if name in skipped:
            continue
        try:
            run = runs[name] = _Contender(model, ids, name)
            logits[name] = run.run()
        except Exception as err:  # an implementation this machine or model cannot run
            skipped[name] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
    return runs, logits, skipped


def _time(
    workload: HfWorkload,
    repeats: int,
    say: Callable[[str], None],
    leave_out: dict[str, str] | None = None,
) -> dict:
    """``workload``'s contenders timed, except those ``leave_out`` names (with why: they are
    reported among the skipped)."""
    runs, logits, skipped = _warm(workload, leave_out or {})
    names = [n for n in workload.contenders if n in logits]
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = time.perf_counter()
            runs[name].run()
            times[name].append(time.perf_counter() - start)
    med = {n: statistics.median(t) for n, t in times.items()}
    base = logits[workload.baseline]
    scale = float(base.abs().max())
    rows = {
        n: {
            "median_s": med[n],
            "times_s": times[n],
            "speedup_vs_" + workload.baseline: med[workload.baseline] / med[n],
            "max_logit_diff_vs_baseline": float((logits[n] - base).abs().max()) / scale,
        }
        for n in names
    }
    goals = [_goal(med, *g) for g in workload.goals]
    say(f"\n{workload.title} (baseline {workload.baseline}):")
    for n, row in rows.items():
        say(
            f"  {n:20} {row['median_s'] * 1e3:9.1f} ms  "
            f"{row['speedup_vs_' + workload.baseline]:6.2f}x {workload.baseline}   "
            f"logits within {row['max_logit_diff_vs_baseline']:.1e} of it"
        )
    for n, why in skipped.items():
        say(f"  {n:20} did not run: {why}")
    for g in goals:
        say(goal_line(g))
    return {
        "name": workload.name,
        "title": workload.title,
        "baseline": workload.baseline,
        "length": workload.length,
        "contenders": rows,
        "skipped": skipped,
        "goals": goals,
    }


def _goal(med: dict[str, float], mine: str, rival: str, op: str, figure: float) -> dict:
    """A ratio goal: ">=" is a speedup (rival's time over mine), "<=" a cost (mine over
    rival's)."""
    if mine not in med or rival not in med:
        return {"text": f"{mine} vs {rival}", "figure": float("nan"), "met": False}
    if op == ">=":
        ratio = med[rival] / med[mine]
        text = f"{mine} >= {figure}x faster than {rival}"
        return {"text": text, "figure": ratio, "met": ratio >= figure}
    ratio = med[mine] / med[rival]
    return {
        "text": f"{mine} <= {figure}x the time of {rival}",
        "figure": ratio,
        "met": ratio <= figure,
    }


def _rss() -> int | None:
    """This process's resident memory in bytes (Linux), else None."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    import os

    return pages * os.sysconf("SC_PAGE_SIZE")


def peak_growth(fn: Callable[[], object], interval: float = 0.001) -> tuple[int | None, object]:
    """(the largest growth of resident memory while ``fn`` runs, sampled every ``interval``
    seconds on a thread; None where it cannot be read, ``fn``'s result)."""
    start = _rss()
    if start is None:
        return None, fn()
    peak = [start]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            now = _rss() or 0
            peak[0] = max(peak[0], now)
            time.sleep(interval)

    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    try:
        result = fn()
    finally:
        done.set()
        watcher.join()
    peak[0] = max(peak[0], _rss() or 0)
    return peak[0] - start, result


def _capture(length: int, say: Callable[[str], None]) -> dict:
    """Peak memory growth of capturing 2 heads of layer 1 against the captured tensor's size,
    beside multihead's and eager's output_attentions (every head of every layer)."""
    from ..hf import capture

    workload = replace(WORKLOADS[0], length=length)
    model = _build(workload)
    ids = torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(2))
    captured = 1 * 2 * length * length * 4  # (B, 2, L, S) float32

    def grab() -> object:
        with capture(model, layers=[1], heads=[0, 2]) as cap, torch.inference_mode():
            model(ids, use_cache=False)
        return cap.weights[1]

    def everything() -> object:
        with torch.inference_mode():
            return model(ids, use_cache=False, output_attentions=True).attentions

    def plain() -> object:
        with torch.inference_mode():
            return model(ids, use_cache=False).logits

    model.set_attn_implementation("multihead")
    plain()  # warm-up: kernel choice, page faults of the model's own buffers
    rows = {}
    for name, impl, fn in (
        ("multihead, no weights", "multihead", plain),
        ("capture 2 heads of layer 1", "sdpa", grab),
        ("multihead output_attentions", "multihead", everything),
        ("eager output_attentions", "eager", everything),
    ):
        model.set_attn_implementation(impl)
        growth, result = peak_growth(fn)
        del result
        rows[name] = growth
    met = rows["capture 2 heads of layer 1"] is not None and (
        rows["capture 2 heads of layer 1"] <= 1.5 * captured
    )
    say(f"\ncapture at L={length} (captured tensor {captured / 2**20:.0f} MiB):")
    for name, growth in rows.items():
        text = "n/a" if growth is None else f"{growth / 2**20:8.0f} MiB = {growth / captured:.2f}x"
        say(f"  {name:32} peak memory growth {text}")
    grown = rows["capture 2 heads of layer 1"]
    figure = "n/a" if grown is None else f"{grown / captured:.2f}x"
    verdict = "met" if met else "MISSED"
    say(f"  goal capture growth <= 1.5x the captured tensor: {figure} -> {verdict}")
    return {"length": length, "captured_bytes": captured, "peak_growth_bytes": rows, "met": met}


ACTING_LENGTH = 8192
# (contender, reference, op, figure): the goals of acting on attention (issue 32)
ACTING_GOALS = (
    ("ablate", "multihead", "<=", 1.05),
    ("knockout 512x512", "multihead", "<=", 1.15),
    ("key_mass+entropy", "multihead", "<=", 1.2),
    ("key_mass+entropy", "eager+weights reduced", ">=", 3.0),
    ("head_mean layer 1", "multihead", "<=", 1.5),
)


def _acting_runs(model: Any, eager: Any, ids: torch.Tensor) -> dict[str, Callable[[], Any]]:
    """The timed forwards of the acting rows, by name."""
    from ..hf import ablate, capture, knockout

    length = ids.shape[1]
    block = min(512, length // 4)
    middle = range(length // 2, length // 2 + block)
    early = range(length // 4, length // 4 + block)

    def plain() -> object:
        with torch.inference_mode():
            return model(ids, use_cache=False).logits

    def ablated() -> object:
        with ablate(model, {0: [1], 1: [2]}), torch.inference_mode():
            return model(ids, use_cache=False).logits

    def knocked() -> object:
        with knockout(model, queries=middle, keys=early), torch.inference_mode():
            return model(ids, use_cache=False).logits

    def key_stats() -> object:
        with capture(model, stats=["key_mass", "entropy"]) as cap, torch.inference_mode():
            model(ids, use_cache=False)
        return cap.stats

    def head_mean() -> object:
        with capture(model, layers=[1], stats=["head_mean"]) as cap, torch.inference_mode():
            model(ids, use_cache=False)
        return cap.stats

    def by_hand() -> object:
        with torch.inference_mode():
            out = eager(ids, use_cache=False, output_attentions=True)
            return [(w.sum(2), -torch.special.xlogy(w, w).sum(-1)) for w in out.attentions]

    return {
        "multihead": plain,
        "ablate": ablated,
        "knockout 512x512": knocked,
        "key_mass+entropy": key_stats,
        "head_mean layer 1": head_mean,
        "eager+weights reduced": by_hand,
    }


def _acting(length: int, repeats: int, say: Callable[[str], None]) -> dict:
    """Ablate, knockout and statistics on the Llama-like model (2 KV heads) against its plain
    multihead forward and against eager with output_attentions reduced by hand."""
    from .measuring import interleaved

    workload = replace(WORKLOADS[0], length=length, extra={"num_key_value_heads": 2})
    model = _build(workload)
    model.set_attn_implementation("multihead")
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    ids = torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(3))
    runs = _acting_runs(model, eager, ids)
    times = interleaved(runs, repeats)
    med = {n: statistics.median(t) for n, t in times.items()}
    memory = _stats_memory(length, repeats)
    goals = [_goal(med, *g) for g in ACTING_GOALS]
    _say_acting(length, med, goals, memory, say)
    return {"length": length, "median_s": med, "times_s": times, "goals": goals, **memory}


def _stats_memory(length: int, repeats: int, heads: int = 4, kv: int = 2, dim: int = 64) -> dict:
    """What asking for key_mass and entropy adds to one attention call's peak memory, on a
    layer's shapes: the median growth of resident memory over ``repeats`` calls of each,
    freed heap returned to the system before each (glibc's ``malloc_trim``) so that every
    call starts from the same state. A whole forward's resident memory varies by tens of MiB
    from run to run, far more than the statistics; one call's is steady to a few KiB."""
    from ..functional import attention
    from ..masks import causal
    from ..stats import attention_stats

    # the Llama-like workload's layer: 4 heads of 64 (hidden 256), 2 KV heads

    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, heads, length, dim, generator=g)
    k, v = (torch.randn(1, kv, length, dim, generator=g) for _ in range(2))
    runs = {
        "plain": lambda: attention(q, k, v, causal()),
        "stats": lambda: attention_stats(q, k, v, causal(), stats=["key_mass", "entropy"])[1],
    }
    trim = _malloc_trim()
    grown: dict[str, list[int]] = {name: [] for name in runs}
    found: Any = None
    for _ in range(max(repeats, 1) + 1):  # the first round warms up (plans, buffer pool)
        for name, run in runs.items():
            trim()
            growth, result = peak_growth(run)
            if growth is not None:
                grown[name].append(growth)
            found = result if name == "stats" else found
    size = sum(t.numel() * t.element_size() for t in found.values())
    if not grown["plain"] or not grown["stats"]:
        return {"stats_bytes": size, "stats_extra_growth_bytes": None, "memory_met": False}
    extra = statistics.median(grown["stats"][1:]) - statistics.median(grown["plain"][1:])
    return {
        "stats_bytes": size,
        "stats_extra_growth_bytes": extra,
        "memory_met": extra <= 1.1 * size,
    }


def _malloc_trim() -> Callable[[], object]:
    """glibc's ``malloc_trim(0)`` (freed heap back to the system), or nothing elsewhere."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return partial(libc.malloc_trim, 0)
    except (OSError, AttributeError):
        return lambda: None


def _say_acting(
    length: int, med: dict[str, float], goals: list[dict], memory: dict, say: Callable[[str], None]
) -> None:
    say(f"\nacting on attention, Llama-like (4 heads, 2 KV heads), L={length}:")
    for name, value in med.items():
        say(f"  {name:24} {value * 1e3:9.1f} ms  {value / med['multihead']:6.2f}x multihead")
    for g in goals:
        say(goal_line(g))
    extra, size = memory["stats_extra_growth_bytes"], memory["stats_bytes"]
    grown = "n/a" if extra is None else f"{extra / 2**20:.2f} MiB"
    say(
        f"  goal key statistics' growth of one attention call's peak <= 1.1x their own "
        f"{size / 2**20:.2f} MiB: {grown} -> {'met' if memory['memory_met'] else 'MISSED'}"
    )


@dataclass(frozen=True)
class GenerateWorkload:
    """Greedy ``generate()`` on "multihead" against "sdpa" (issue 33), one row per batch size:
    ``prompt`` tokens (where B > 1, row b left-padded by b/8 of the prompt beside a full row)
    and ``new_tokens`` more, the prompt's forward counted in the time. "multihead" runs twice:
    with transformers' linear layers, and with them on multihead's few-row kernel
    (``multihead.hf.fast_decoding``, which takes the few-row linears for this architecture),
    which the goal is judged on."""

    layers: int = 6  # of Qwen2-0.5B's 24: the attention calls per token scale with them
    prompt: int = 512
    new_tokens: int = 64
    batches: tuple[int, ...] = (1, 4)
    goal: float = 1.05  # multihead's least speedup over sdpa at every batch size


GENERATE = GenerateWorkload()
# generate()'s contender with transformers' linear layers on multihead's few-row kernel
LINEARS = "multihead, fast_decoding"
# Qwen2-0.5B's shape: 14 query heads over 2 KV heads of 64; the vocabulary is cut to VOCAB as
# in every workload here (its 151,936 rows would add 545 MB of reads per token to both sides)
QWEN2_05B: dict[str, Any] = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_attention_heads=14,
    num_key_value_heads=2,
    tie_word_embeddings=True,
)


def _generate_inputs(batch: int, prompt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids, attention mask) of a batch, row b left-padded by b/8 of the prompt."""
    ids = torch.randint(3, VOCAB, (batch, prompt), generator=torch.Generator().manual_seed(5))
    keep = torch.ones(batch, prompt, dtype=torch.long)
    for b in range(batch):
        keep[b, : b * prompt // 8] = 0
    ids[keep == 0] = 0
    return ids, keep


def _greedy(model: Any, ids: torch.Tensor, keep: torch.Tensor, new: int, kept: dict, name: str):
    with torch.inference_mode():
        kept[name] = model.generate(
            input_ids=ids, attention_mask=keep, max_new_tokens=new, min_new_tokens=new,
            do_sample=False, pad_token_id=0,
        )  # fmt: skip


def _prompt_forward(model: Any, ids: torch.Tensor, keep: torch.Tensor) -> None:
    """The forward of the prompt as ``generate()`` runs it first (the cache, the last logits)."""
    with torch.inference_mode():
        model(input_ids=ids, attention_mask=keep, use_cache=True, logits_to_keep=1)


def _generate(workload: GenerateWorkload, repeats: int, say: Callable[[str], None]) -> dict:
    """Each batch size's generate() on every contender, interleaved, with the prompt's
    forward timed beside it (what remains, per new token, is the decoding steps)."""
    import transformers as tf

    import multihead.hf  # registers "multihead"

    torch.manual_seed(0)
    length = workload.prompt + workload.new_tokens
    config = tf.Qwen2Config(
        vocab_size=VOCAB, num_hidden_layers=workload.layers, max_position_embeddings=length,
        pad_token_id=0, **QWEN2_05B,
    )  # fmt: skip
    sdpa = tf.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    models = {"sdpa": sdpa, "multihead": copy.deepcopy(sdpa), LINEARS: copy.deepcopy(sdpa)}
    models["multihead"].set_attn_implementation("multihead")
    models[LINEARS].set_attn_implementation("multihead")
    multihead.hf.fast_decoding(models[LINEARS])
    say(
        f"\ntransformers generate(), Qwen2-0.5B-shaped ({workload.layers} layers, vocabulary "
        f"{VOCAB}), prompt {workload.prompt}, {workload.new_tokens} new tokens, greedy:"
    )
    rows = [_generate_row(models, b, workload, repeats, say) for b in workload.batches]
    return {
        "layers": workload.layers,
        "prompt": workload.prompt,
        "new_tokens": workload.new_tokens,
        "vocab": VOCAB,
        "rows": rows,
        "goals": [r["goal"] for r in rows],
    }


def _generate_row(
    models: dict[str, Any],
    batch: int,
    workload: GenerateWorkload,
    repeats: int,
    say: Callable[[str], None],
) -> dict:
    from .measuring import interleaved

    ids, keep = _generate_inputs(batch, workload.prompt)
    tokens: dict[str, torch.Tensor] = {}
    runs: dict[str, Callable[[], Any]] = {}
    for name, model in models.items():
        runs[name] = partial(_greedy, model, ids, keep, workload.new_tokens, tokens, name)
        runs[name + " prompt"] = partial(_prompt_forward, model, ids, keep)
    times = interleaved(runs, repeats)  # its warm-up round leaves each one's tokens
    med = {n: statistics.median(t) for n, t in times.items()}
    same = {n: torch.equal(tokens["sdpa"], tokens[n]) for n in models if n != "sdpa"}
    ratio = {n: med["sdpa"] / med[n] for n in same}
    per_token = {n: (med[n] - med[n + " prompt"]) / workload.new_tokens for n in models}
    pads = [b * workload.prompt // 8 for b in range(batch)]
    say(f"  B={batch} (left padding {pads}):")
    for n in models:
        _say_contender(n, med, per_token[n], ratio.get(n), same.get(n), say)
    text = f"multihead >= {workload.goal}x faster than sdpa at B={batch}, tokens identical"
    goal = {
        "text": text,
        "figure": ratio[LINEARS],
        "met": same[LINEARS] and ratio[LINEARS] >= workload.goal,
    }
    say(f"  goal {text}: {ratio[LINEARS]:.3f} -> {'met' if goal['met'] else 'MISSED'}")
    return {
        "batch": batch,
        "left_padding": pads,
        "median_s": {n: med[n] for n in models},
        "prompt_forward_s": {n: med[n + " prompt"] for n in models},
        "per_new_token_s": per_token,
        "times_s": times,
        "speedup_vs_sdpa": ratio,
        "tokens_identical": same,
        "goal": goal,
    }


def _say_contender(
    name: str,
    med: dict[str, float],
    per_token: float,
    ratio: float | None,
    same: bool | None,
    say: Callable[[str], None],
) -> None:
    """One contender's generate() line (``ratio`` and ``same`` against sdpa; None for sdpa)."""
    against = "" if ratio is None else f": {ratio:.3f}x sdpa"
    identical = "" if same is None else ", tokens " + ("identical" if same else "DIFFER")
    say(
        f"    {name:<34} {med[name] * 1e3:6.0f} ms{against}; the prompt's forward "
        f"{med[name + ' prompt'] * 1e3:.0f} ms, then {per_token * 1e3:.2f} ms per new "
        f"token{identical}"
    )


# bench hf's first-use goals (issue 33): each run in a new process with an empty cache by
# ``python -m multihead.bench.first_use``
FIRST_USE_GOALS = {
    "forward": "first forward with output_attentions >= 5.0x faster than eager's",
    "capture_time": "first capture of 2 heads <= 1.3x the time of the second",
    "capture_memory": "first capture's peak memory growth <= 1.5x the captured weights",
}


def _child(what: str, length: int) -> dict[str, Any]:
    """Run one measurement in a new process with a new, empty home and cache."""
    with tempfile.TemporaryDirectory(prefix="multihead-first-use-") as home:
        env = {k: v for k, v in os.environ.items() if k != "MULTIHEAD_EXTENSION_DIR"}
        env.update(HOME=home, XDG_CACHE_HOME=os.path.join(home, ".cache"))
        env.pop("MULTIHEAD_FUSED_AUTO", None)  # auto's measured choice, as a user gets it
        done = subprocess.run(
            [sys.executable, "-m", "multihead.bench.first_use", what, str(length)],
            capture_output=True,
            text=True,
            env=env,
            timeout=1800,
        )
    if done.returncode != 0:
        raise RuntimeError(f"the first-use {what} run failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def first_use(forward_length: int, capture_length: int, say: Callable[[str], None]) -> dict:
    """Both first-use measurements, each in a new process, with their goals said."""
    forward = _child("forward", forward_length)
    capture = _child("capture", capture_length)
    speedup = forward["eager_s"] / forward["first_s"]
    time_ratio = capture["first_s"] / capture["second_s"]
    memory_ratio = capture["growth_bytes"] / capture["captured_bytes"]
    goals = [
        {"text": FIRST_USE_GOALS["forward"], "figure": speedup, "met": speedup >= 5.0},
        {"text": FIRST_USE_GOALS["capture_time"], "figure": time_ratio, "met": time_ratio <= 1.3},
        {
            "text": FIRST_USE_GOALS["capture_memory"],
            "figure": memory_ratio,
            "met": memory_ratio <= 1.5,
        },
    ]
    say(f"\nfirst use, a new process with an empty cache (Llama-like, L={forward_length}):")
    say(
        f"  first multihead forward with output_attentions {forward['first_s'] * 1e3:8.1f} ms,"
        f" second {forward['second_s'] * 1e3:8.1f} ms, eager {forward['eager_s'] * 1e3:8.1f} ms"
    )
    say(
        f"  first capture of 2 heads at L={capture_length} {capture['first_s'] * 1e3:8.1f} ms, "
        f"second {capture['second_s'] * 1e3:8.1f} ms; peak growth "
        f"{capture['growth_bytes'] / 2**20:.0f} MiB for {capture['captured_bytes'] / 2**20:.0f}"
        " MiB captured"
    )
    for name, found in (("forward", forward), ("capture", capture)):
        line = _first_touches(found)
        if line:
            say(f"  {name}: {line}")
    for g in goals:
        say(goal_line(g))
    return {"forward": forward, "capture": capture, "goals": goals}


def _first_touches(found: dict[str, Any]) -> str | None:
    """What the first and second calls spent on first touches of memory (page faults, system
    seconds), with the system time per fault; None for a report without them (one written
    before they were counted)."""
    if found.get("first_faults") is None or found.get("second_faults") is None:
        return None
    parts = []
    for call in ("first", "second"):
        faults, sys_s = found[f"{call}_faults"], found[f"{call}_sys_s"]
        per = f", {sys_s / faults * 1e6:.1f} us each" if faults else ""
        parts.append(
            f"{call} call {faults} page faults ({faults * found['page_bytes'] / 2**20:.0f} MiB),"
            f" {sys_s * 1e3:.0f} ms system time{per}"
        )
    return "; ".join(parts)


@dataclass(frozen=True, kw_only=True)
class HfBenchOptions(Timed):
    """What ``multihead bench hf`` takes (``multihead bench hf --help``)."""

    quick: bool = option(
        False, "1/16 of the lengths, without FlexAttention: a smoke test, not for comparison"
    )


def run_hf_bench(options: HfBenchOptions, *, say: Callable[[str], None] = print) -> dict:
    """Run every workload (``options.quick``: at 1/16 of the lengths, a smoke test), print the
    table with the machine, and write hf.json and hf.png into ``options.out``."""
    from .._machine import cpu_info
    from ..backends import fused
    from .decode import memory_bandwidth
    from .decode_call import decoding_calls
    from .measuring import matmul_peaks

    quick, repeats = options.quick, options.repeats or 3
    out = V.check_out_dir("--out", options.out)
    # auto leads with the fused kernel only where it is built; build it now, as bench kernels
    # does, so the table is the machine's and not the build's
    fused.build_error()
    workloads = list(WORKLOADS)
    capture_length, acting_length, generating = CAPTURE_LENGTH, ACTING_LENGTH, GENERATE
    leave_out = {}
    if quick:
        # Inductor compiles a FlexAttention kernel per workload: about 6 s each on two cores,
        # most of a smoke test's time (bench kernels and tests/backends/test_flex.py cover it)
        leave_out["flex_attention"] = "--quick leaves out FlexAttention's compile"
        acting_length //= 16
        workloads = [replace(w, length=w.length // 16, extra=_shrunk(w.extra)) for w in workloads]
        capture_length //= 16
        generating = replace(GENERATE, layers=2, prompt=GENERATE.prompt // 16, new_tokens=4)
    cpu = cpu_info()[0]
    peaks = matmul_peaks(1024)
    bandwidth = memory_bandwidth()
    say(f"CPU: {cpu}; {torch.get_num_threads()} threads; torch {torch.__version__}")
    say(
        f"matmul peak fp32 {peaks['float32']:.0f} GFLOP/s, bf16 {peaks['bfloat16']:.0f} "
        f"GFLOP/s; measured read bandwidth {bandwidth:.1f} GB/s; {repeats} interleaved repeats"
    )
    results = []
    steps = [w.name for w in workloads] + [
        "capture", "acting", "generate", "decoding call", "first use",
    ]  # fmt: skip
    with (
        warnings.catch_warnings(),
        stages("bench hf", steps, unit="workload", say=say) as (
            bar,
            tell,
        ),
    ):
        warnings.simplefilter("ignore")  # transformers' notes on flex compilation, configs
        for w in workloads:
            bar.begin(w.name)
            results.append(_time(w, repeats, tell, leave_out))
        bar.begin("capture")
        memory = _capture(capture_length, tell)
        bar.begin("acting")
        acting = _acting(acting_length, repeats, tell)
        bar.begin("generate")
        generated = _generate(generating, repeats, tell)
        bar.begin("decoding call")
        calls = decoding_calls(tell, blocks=5, calls=50) if quick else decoding_calls(tell)
        bar.begin("first use")
        first = first_use(workloads[0].length, capture_length, tell)
    report = {
        "command": "multihead bench hf"
        + (" --quick" if quick else "")
        + (f" --repeats {repeats}" if repeats != 3 else ""),
        "smoke_test": quick,
        "cpu": cpu,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "matmul_peak_gflops": peaks,
        "bandwidth_gb_s": bandwidth,
        "workloads": results,
        "capture": memory,
        "acting": acting,
        "generate": generated,
        "decoding_call": calls,
        "first_use": first,
    }
    out.mkdir(exist_ok=True)
    (out / "hf.json").write_text(json.dumps(report, indent=2))
    chart = _chart(report, out / "hf.png")
    say(f"\nwrote {out / 'hf.json'}" + (f" and {chart}" if chart else ""))
    return report


def _shrunk(extra: dict[str, Any]) -> dict[str, Any]:
    """A workload's settings for --quick: windows shrink with the lengths."""
    window = extra.get("sliding_window")
    return extra if window is None else {**extra, "sliding_window": window // 16}


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def _chart(report: dict, path: Path) -> Path | None:
    """Speedup of every contender over its workload's baseline; None without matplotlib."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    from .chart import speedup_bars

    workloads = report["workloads"]
    fig = Figure(figsize=(10, 5), layout="constrained")
    ax = fig.subplots()
    speedup_bars(ax, workloads, [f"{w['title']}\n(vs {w['baseline']})" for w in workloads])
    title = f"multihead bench hf: whole forwards, medians, {report['threads']} threads"
    if report["smoke_test"]:
        title += "\n--quick smoke test: not for comparison"
    ax.set_title(title)
    fig.savefig(path, dpi=110)
    return path
