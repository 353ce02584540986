"""``multihead bench kernels``: the attention kernels against torch SDPA, the naive formula and
flex attention, on every workload of ``WORKLOADS``.

Every contender runs in this one process on the same inputs; repeats are interleaved (A B C,
B C A, C A B, ...) so drift in the machine's speed hits all contenders alike, and medians are
reported.
Speed is shown as time, speedup over torch SDPA, and GFLOP/s counting only visible score
entries, also as a fraction of the fp32 / bf16 matmul peak measured in the same run.
"""

from __future__ import annotations

import json
import math
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _validation as V
from .. import bias as bias_mod
from .. import masks
from .._flags import option
from .._progress import stages
from ..bias import ScoreModifier
from ..functional import attention, attention_with_weights, explain_backend
from ..masks import Mask, TileKind
from ..modules import MultiHeadAttention
from .measuring import interleaved, matmul_peaks
from .options import Timed

__all__ = ["WORKLOADS", "KernelsOptions", "Workload", "run_suite"]

_NAIVE_BUDGET_BYTES = 3 * 2**30  # the naive formula holds the full (B, H, L, S) score tensor


@dataclass(frozen=True)
class Workload:
    name: str
    title: str
    b: int
    h: int
    length: int
    d: int = 64
    dtype: str = "float32"
    mask: str = "none"  # none | causal | window | ragged | documents
    train: bool = False  # forward + backward
    weights: bool = False  # compare attention_with_weights against the plain call
    module: bool = False  # MultiHeadAttention against torch.nn.MultiheadAttention
    # none | alibi | t5 | softcap | sinks: a score modifier, also timed without it
    bias: str = "none"
    target: str = ""


WORKLOADS: dict[str, tuple[Workload, Workload]] = {}  # name -> (full, quick)


def _add(full: Workload, **quick: object) -> None:
    WORKLOADS[full.name] = (full, Workload(**{**asdict(full), **quick}))


_add(
    Workload(
        "dense_fp32",
        "dense fp32",
        4,
        8,
        2048,
        target=">= 0.95x SDPA; fused >= 85% of the fp32 peak",
    ),
    b=1,
    length=512,
)
_add(
    Workload("dense_bf16", "dense bf16", 4, 8, 2048, dtype="bfloat16", target=">= 1.7x SDPA bf16"),
    b=1,
    length=512,
)
_add(
    Workload(
        "causal_fp32", "causal fp32", 1, 8, 8192, mask="causal", target=">= 1.0x SDPA is_causal"
    ),
    length=1024,
)
_add(
    Workload(
        "causal_bf16",
        "causal bf16",
        1,
        8,
        8192,
        dtype="bfloat16",
        mask="causal",
        target=">= 1.7x SDPA bf16 is_causal",
    ),
    length=1024,
)
_add(
    Workload(
        "window_fp32",
        "sliding window 256, fp32",
        1,
        8,
        16384,
        mask="window",
        target=">= 20x SDPA with mask; fused >= 1.3x compiled FlexAttention",
    ),
    length=2048,
)
_add(
    Workload(
        "ragged",
        "ragged batch, lengths in [L/8, L]",
        16,
        8,
        1024,
        mask="ragged",
        target=">= 2.5x SDPA with padding mask",
    ),
    b=4,
    length=256,
)
_add(
    Workload(
        "documents",
        "8 packed documents",
        1,
        8,
        8192,
        mask="documents",
        target=">= 4x SDPA with block-diagonal mask; fused >= 1.0x tiled",
    ),
    length=1024,
)
_add(
    Workload(
        "train_window",
        "train step, sliding window 256",
        1,
        8,
        4096,
        mask="window",
        train=True,
        target=">= 5x SDPA with mask",
    ),
    length=1024,
)
_add(
    Workload(
        "weights_dense",
        "attention_with_weights, dense fp32",
        1,
        8,
        2048,
        weights=True,
        target="fused <= 1.3x the time without weights; heads=[0] of 8 <= 0.3x all heads'",
    ),
    length=512,
)
_add(
    Workload(
        "weights_causal",
        "attention_with_weights, causal fp32 (transformers bridge shape)",
        1,
        4,
        4096,
        mask="causal",
        weights=True,
        target="fused <= 1.3x the time without weights",
    ),
    length=512,
)
_add(
    Workload(
        "train_bf16",
        "train step, dense bf16",
        1,
        8,
        2048,
        dtype="bfloat16",
        train=True,
        target=">= 1.5x SDPA bf16 where the bf16 peak is >= 2x fp32",
    ),
    length=512,
)
for _kind, _title in (("alibi", "ALiBi"), ("t5", "T5 buckets")):
    _add(
        Workload(
            f"causal_{_kind}",
            f"causal + {_title} bias, fp32",
            1,
            8,
            8192,
            mask="causal",
            bias=_kind,
            target="fused <= 1.05x the causal call without bias",
        ),
        length=1024,
    )
for _kind, _title in (("softcap", "soft-capping 50"), ("sinks", "attention sinks")):
    _add(
        Workload(
            f"causal_{_kind}",
            f"causal + {_title}, fp32",
            1,
            8,
            8192,
            mask="causal",
            bias=_kind,
            target="fused <= 1.05x the causal call without it",
        ),
        length=1024,
    )
_add(
    Workload(
        "module_padding",
        "module, B=8 E=512 H=8, key padding",
        8,
        8,
        512,
        mask="ragged",
        module=True,
        target="faster than nn.MultiheadAttention",
    ),
    b=2,
    length=128,
)


def _mask(w: Workload, seed: int) -> tuple[Mask | None, Callable | None]:
    """Our mask and a FlexAttention mask_mod with the same meaning (None = no mask)."""
    g = torch.Generator().manual_seed(seed)
    n = w.length
    if w.mask == "none":
        return None, None
    if w.mask == "causal":
        return masks.causal(), lambda b, h, q, k: k <= q
    if w.mask == "window":
        return masks.sliding_window(256), lambda b, h, q, k: (k <= q) & (q - k <= 256)
    if w.mask == "ragged":
        lens = torch.randint(n // 8, n + 1, (w.b,), generator=g)
        if w.module:  # nn.MultiheadAttention has key padding only: queries of padding still run
            return masks.lengths(lens), lambda b, h, q, k: k < lens[b]
        return masks.lengths(
            lens, query_lens=lens
        ), lambda b, h, q, k: (k < lens[b]) & (q < lens[b])
    if w.mask == "documents":
        cuts = torch.sort(torch.randperm(n - 1, generator=g)[:7] + 1).values
        ids = torch.searchsorted(cuts, torch.arange(n), right=True)
        return masks.documents(ids), lambda b, h, q, k: ids[q] == ids[k]
    raise ValueError(f"unknown workload mask {w.mask!r}")


def visible_entries(mask: Mask | None, b: int, h: int, length_q: int, length_k: int) -> int:
    """Score entries some query may see, counted tile by tile (no L x S tensor)."""
    if mask is None:
        return b * h * length_q * length_k
    total = 0
    groups = range(b) if mask.batch_size is not None else [0]
    for bi in groups:
        for q0 in range(0, length_q, 512):
            q1 = min(q0 + 512, length_q)
            t = mask.tile(length_q, length_k, q0, q1, batch=bi)
            if t.kind == TileKind.FULL:
                total += (q1 - q0) * (t.stop - t.start) * h
            elif t.kind == TileKind.PARTIAL:
                keep = mask.block(length_q, length_k, q0, q1, t.start, t.stop, batch=bi)
                total += int(keep.expand(1, h, q1 - q0, t.stop - t.start).sum())
    return total * (1 if mask.batch_size is not None else b)


def _naive(q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None) -> Tensor:
    """The tutorial formula: softmax(Q K^T / sqrt(D)) V with a masked_fill."""
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    return torch.softmax(s, dim=-1).nan_to_num(0.0) @ v


def _contenders(
    w: Workload, quick: bool, seed: int
) -> tuple[dict[str, Callable[[], object]], dict, int, Callable[[], str] | None]:
    """The workload's contenders by name, the notes on them, the visible score entries and
    what says the backend ``auto`` (the "multihead" row) runs the call on, asked after the
    timing (auto's measured choices are made at a call's first run; None for the module
    rows)."""
    g = torch.Generator().manual_seed(seed)
    mask, mask_mod = _mask(w, seed)
    notes: dict[str, str] = {}
    entries = visible_entries(mask, w.b, w.h, w.length, w.length)
    if w.module:
        return _module_contenders(w, mask, g), notes, entries, None

    q, k, v = _inputs(w, g)
    keep = None if mask is None else mask.to_dense(w.length, w.length).expand(w.b, 1, -1, -1)
    causal = w.mask == "causal"

    def step(fn: Callable[[], Tensor]) -> Callable[[], object]:
        if not w.train:
            return lambda: fn()
        return lambda: torch.autograd.grad(fn().sum(), (q, k, v))

    out: dict[str, Callable[[], object]] = {}
    modifier = _modifier(w, g)
    out["multihead"] = step(lambda: attention(q, k, v, mask, bias=modifier))
    if modifier is not None:
        out["multihead, no bias"] = step(lambda: attention(q, k, v, mask))
    if w.bias in _ADDITIVE:
        # the user's alternative: the bias as a dense tensor, hidden entries at -inf
        dense = modifier.to_dense(w.length, w.length).expand(1, w.h, w.length, w.length)
        if keep is not None:
            dense = dense.masked_fill(~keep, float("-inf"))
        out["sdpa"] = step(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense))
        notes["sdpa"] = "given the bias as a dense (1, H, L, S) float32 tensor, built beforehand"
        causal = False
    elif modifier is not None:
        notes["sdpa"] = f"has no {w.bias}: timed without it"
    if w.weights:
        out["multihead+weights"] = step(lambda: attention_with_weights(q, k, v, mask))
    _add_fused(out, notes, w, step, q, k, v, mask, modifier)
    _add_predicate(out, w, step, q, k, v, mask_mod, modifier)
    if causal:
        out["sdpa"] = step(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    elif "sdpa" not in out:
        out["sdpa"] = step(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=keep))
    _add_naive(out, notes, w, modifier, step, q, k, v, keep)
    if w.mask in ("window", "documents") and not (w.train or w.weights):
        _add_flex_backend(out, notes, quick, q, k, v, mask, modifier)
    if w.mask == "documents":  # the fused kernel's goal is stated against tiled
        out["multihead, tiled"] = step(lambda: attention(q, k, v, mask, backend="tiled"))
    _add_flex(out, notes, w, quick, q, k, v, mask_mod, modifier)
    return out, notes, entries, lambda: explain_backend(q, k, v, mask, bias=modifier).backend


def _inputs(w: Workload, g: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
    """Q, K, V of the workload (B, H, L, D) from ``g``; they need gradients when it trains."""
    dtype = getattr(torch, w.dtype)
    q, k, v = (torch.randn(w.b, w.h, w.length, w.d, generator=g).to(dtype) for _ in range(3))
    if w.train:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    return q, k, v


def _add_naive(out, notes, w: Workload, modifier, step, q, k, v, keep) -> None:
    """The tutorial formula, unless the workload has a modifier it lacks (or the SDPA row
    already times the dense bias) or its (B, H, L, S) scores would not fit the budget."""
    score_bytes = w.b * w.h * w.length * w.length * 4
    if w.bias in _ADDITIVE:
        notes["naive"] = "skipped: the SDPA row already times a dense bias"
    elif modifier is not None:
        notes["naive"] = f"skipped: the naive formula has no {w.bias}"
    elif score_bytes <= _NAIVE_BUDGET_BYTES:
        out["naive"] = step(lambda: _naive(q, k, v, keep))
    else:
        notes["naive"] = f"skipped: its score tensor would need {score_bytes / 2**30:.0f} GiB"


def _add_flex(out, notes, w: Workload, quick: bool, q, k, v, mask_mod, modifier) -> None:
    """FlexAttention compiled (forward only, no weights, not in --quick), or why not."""
    if quick:
        notes["flex"] = "skipped in --quick (compilation takes minutes)"
    elif w.train:
        notes["flex"] = "skipped: FlexAttention has no CPU backward"
    elif w.weights:
        notes["flex"] = "skipped: FlexAttention returns no weights"
    elif w.bias == "sinks":
        notes["flex"] = "skipped: FlexAttention has no sink logits"
    else:
        score_mod = _score_mod(w, modifier)
        flex, compile_s, why = _compile_flex(q, k, v, mask_mod, w, score_mod)
        if flex is None:
            notes["flex"] = f"skipped: {why}"
        else:
            out["flex"] = flex
            notes["flex"] = f"compile + first call {compile_s:.1f} s, not included"


def _add_fused(out, notes, w: Workload, step, q, k, v, mask, modifier) -> None:
    """The fused C++ kernel by name (``backend="fused"``), with the same companions as auto's
    row (without bias, with weights), or a note saying why it is missing."""
    from ..backends import fused

    why = fused.build_error()
    if why is not None:
        notes["multihead, fused"] = f"skipped: {why}"
        return
    out["multihead, fused"] = step(lambda: attention(q, k, v, mask, bias=modifier, backend="fused"))
    if modifier is not None:
        out["multihead, fused, no bias"] = step(lambda: attention(q, k, v, mask, backend="fused"))
    if w.weights:
        out["multihead, fused+weights"] = step(
            lambda: attention_with_weights(q, k, v, mask, backend="fused")
        )
        out["multihead, fused+weights, heads=[0]"] = step(
            lambda: attention_with_weights(q, k, v, mask, heads=[0], backend="fused")
        )


def _add_predicate(out, w: Workload, step, q, k, v, mask_mod, modifier) -> None:
    """The window's and the documents' mask written as a predicate (one function) on the fused
    kernel: it should cost what the built-in kind costs. Made once, as a user makes a mask
    (its work list is kept on it)."""
    if "multihead, fused" not in out or w.mask not in ("window", "documents") or mask_mod is None:
        return
    written = masks.predicate(mask_mod)
    out["multihead, fused, predicate"] = step(
        lambda: attention(q, k, v, written, bias=modifier, backend="fused")
    )


def _add_flex_backend(out, notes, quick, q, k, v, mask, modifier) -> None:
    """Our FlexAttention backend (``backend="flex"``), its compile timed apart; and tiled by
    name when auto itself picks flex, so both stay visible."""
    name = "multihead, flex"
    if quick:
        notes[name] = "skipped in --quick (compilation takes seconds to minutes)"
        return
    from ..backends import flex

    flex.clear_cache()  # time a real compile, not one left by an earlier workload
    with torch.no_grad():
        try:
            attention(q, k, v, mask, bias=modifier, backend="flex")
        except ValueError as e:
            notes[name] = f"skipped: {e}"
            return
    log = flex.compile_log()
    if not log or log[-1].error is not None:
        notes[name] = f"skipped: {log[-1].error if log else 'no compile was logged'}"
        return
    out[name] = lambda: attention(q, k, v, mask, bias=modifier, backend="flex")
    notes[name] = f"compile + first call {log[-1].seconds:.1f} s, not included"
    if explain_backend(q, k, v, mask, bias=modifier).backend == "flex":
        out["multihead, tiled"] = lambda: attention(q, k, v, mask, bias=modifier, backend="tiled")


_ADDITIVE = ("alibi", "t5")  # modifiers SDPA can be given as a dense tensor
_SOFTCAP = 50.0  # Gemma 2's attention cap


def _modifier(w: Workload, g: torch.Generator) -> ScoreModifier | None:
    if w.bias == "none":
        return None
    if w.bias == "alibi":
        return bias_mod.alibi(w.h)
    if w.bias == "softcap":
        return bias_mod.softcap(_SOFTCAP)
    if w.bias == "sinks":
        return bias_mod.sinks(torch.randn(w.h, generator=g))
    return bias_mod.relative_buckets(torch.randn(32, w.h, generator=g), bidirectional=False)


def _score_mod(w: Workload, modifier: ScoreModifier | None) -> Callable | None:
    """The modifier as FlexAttention's score_mod (soft-capping written out, as its own
    documentation does; additive terms lower themselves)."""
    if modifier is None:
        return None
    if w.bias == "softcap":
        return lambda score, b, h, q_idx, kv_idx: _SOFTCAP * torch.tanh(score / _SOFTCAP)
    return modifier.score_mod(w.length, w.length)


def _compile_flex(q, k, v, mask_mod, w: Workload, score_mod=None):
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        t = time.perf_counter()
        block = None
        if mask_mod is not None:
            block = create_block_mask(mask_mod, w.b, None, w.length, w.length, device="cpu")
        # a fresh start for each workload's compile: every one recompiles flex_attention's own
        # code, and past dynamo's recompile limit (8) later workloads ran it uncompiled
        torch._dynamo.reset()
        compiled = torch.compile(flex_attention)
        compiled(q, k, v, block_mask=block, score_mod=score_mod)
        run = lambda: compiled(q, k, v, block_mask=block, score_mod=score_mod)  # noqa: E731
        return run, time.perf_counter() - t, ""
    except Exception as e:  # FlexAttention is optional: report why it could not run
        return None, 0.0, f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"


def _module_contenders(w: Workload, mask: Mask, g: torch.Generator) -> dict[str, Callable]:
    e = w.h * w.d
    torch.manual_seed(0)
    ours = MultiHeadAttention(e, w.h).eval()
    theirs = ours.to_torch().eval()
    x = torch.randn(w.b, w.length, e, generator=g)
    padding = ~mask.to_dense(w.length, w.length)[:, 0, 0, :]  # [B, S] True = padding
    return {
        "multihead": lambda: ours(x, mask=mask),
        "nn.MultiheadAttention": lambda: theirs(
            x, x, x, key_padding_mask=padding, need_weights=False
        ),
    }


def _peak_rss_mib() -> float:
    """This process's peak resident memory. Linux's VmHWM belongs to the current program image;
    ru_maxrss would also count the parent's peak inherited across fork and exec."""
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _memory_child(length: int) -> None:
    """Run sliding-window forward + backward at ``length`` and print peak RSS in MiB."""
    q, k, v = (torch.randn(1, 8, length, 64, requires_grad=True) for _ in range(3))
    before = _peak_rss_mib()
    t = time.perf_counter()
    out = attention(q, k, v, masks.sliding_window(256))
    out.sum().backward()
    seconds = time.perf_counter() - t
    peak = _peak_rss_mib()
    print(json.dumps({"peak_rss_mib": peak, "rss_before_mib": before, "seconds": seconds}))


def _memory(length: int) -> dict:
    code = f"from multihead.bench.kernels import _memory_child; _memory_child({length})"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr else "failed"}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    dense_gib = length * length / 2**30
    return {
        "name": "memory_window",
        "title": f"sliding window 256 fwd+bwd, B=1 H=8 L=S={length} fp32",
        "target": "< 3 GB peak resident memory",
        "dense_bool_mask_gib": dense_gib,
        **result,
    }


# what `bench kernels --quick` takes on 2 CPU cores with the fused kernel built (its --help
# states it; the run prints its own time, so a user sees where a machine differs)
QUICK_SECONDS = 40
SMOKE_TEST = (
    "--quick is a smoke test: at these small sizes warm-up and per-call overhead dominate, so "
    "its times and ratios say that every contender runs, not how fast; they are not for "
    "comparison (run without --quick for that)"
)


@dataclass
class Report:
    machine: dict = field(default_factory=dict)
    peak_gflops: dict = field(default_factory=dict)
    bf16_case: str = ""  # which bf16 goal applies: it depends on the bf16 / fp32 peak ratio
    workloads: list = field(default_factory=list)
    memory: dict = field(default_factory=dict)
    command: str = ""
    smoke_test: bool = False  # --quick: not for comparison (SMOKE_TEST)
    seconds: float = 0.0  # wall time of the whole run


@dataclass(frozen=True, kw_only=True)
class KernelsOptions(Timed):
    """What ``multihead bench kernels`` takes (``multihead bench kernels --help``)."""

    quick: bool = option(
        False,
        f"a smoke test: small sizes, about {QUICK_SECONDS} s on 2 CPU cores (the first run on a "
        "machine also builds the fused C++ kernel, once); warm-up and call overhead dominate "
        "its ratios, so they are not for comparison",
    )
    only: tuple[str, ...] | None = option(None, "run only these workloads", metavar="WORKLOAD")


def run_suite(options: KernelsOptions, *, say: Callable[[str], None] = print) -> Report:
    """Run the workloads, print a table, write ``results.json`` and ``results.png``.

    ``options.quick`` runs small sizes as a smoke test (see ``SMOKE_TEST``): the report and
    the chart say so, and the run prints its wall time (``QUICK_SECONDS`` on 2 cores)."""
    started = time.perf_counter()
    quick, repeats = options.quick, options.repeats
    out_dir = V.check_out_dir("--out", options.out)
    out_dir.mkdir(exist_ok=True)
    repeats = (3 if quick else 5) if repeats is None else V.check_positive_int("repeats", repeats)
    steps = _steps(options.only)
    report = Report(
        machine={
            "python": platform.python_version(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "processor": platform.processor() or platform.machine(),
        },
        command="multihead bench kernels" + (" --quick" if quick else ""),
        smoke_test=quick,
    )
    if quick:
        say(f"{SMOKE_TEST}.\n")
    _peaks(report, 1024 if quick else 2048, say)
    with stages("bench kernels", steps, unit="workload", say=say) as (bar, tell):
        for name in steps:
            bar.begin(name)
            if name == "memory_window":
                report.memory = _memory(4096 if quick else 65536)
            else:
                w = WORKLOADS[name][1 if quick else 0]
                report.workloads.append(_run_workload(w, quick, repeats, report.peak_gflops, tell))
    if "memory_window" in steps:
        say(_memory_line(report.memory))
    say(_auto_line(report.workloads))
    report.seconds = round(time.perf_counter() - started, 1)
    (out_dir / "results.json").write_text(json.dumps(asdict(report), indent=2))
    from .chart import write_chart

    chart = write_chart(report, out_dir / "results.png")
    say(f"\nwrote {out_dir / 'results.json'}" + (f" and {chart}" if chart else ""))
    took = f"took {report.seconds:.0f} s"
    say(f"{took} (a smoke test: not for comparison)" if quick else took)
    return report


def _steps(only: tuple[str, ...] | None) -> list[str]:
    """The workloads to run, in order, the memory one last (every one when ``only`` is None)."""
    names = only or [*WORKLOADS, "memory_window"]
    unknown = sorted(set(names) - set(WORKLOADS) - {"memory_window"})
    if unknown:
        raise ValueError(
            f"unknown workloads {unknown}; choose from {[*WORKLOADS, 'memory_window']}"
        )
    return [n for n in names if n != "memory_window"] + ["memory_window"] * (
        "memory_window" in names
    )


def _peaks(report: Report, n: int, say: Callable[[str], None]) -> None:
    """The fp32 and bf16 matmul peaks (n x n) into ``report``, and which bf16 goal applies;
    with the fused kernel built, also its block products' own peak in both precisions (what
    its time is best compared with: on some CPUs torch's fp32 matmul runs well below it)."""
    from .._machine import cpu_info
    from ..backends import fused

    report.machine["cpu"] = cpu_info()[0]
    report.peak_gflops = matmul_peaks(n)
    blocks = ""
    if fused.build_error() is None:
        kernel = fused.build()
        for dtype in ("float32", "bfloat16"):
            report.peak_gflops[f"{dtype} blocks"] = kernel.block_peak(64, 0.5, dtype == "bfloat16")
        half = report.peak_gflops["bfloat16 blocks"]
        blocks = (
            f"; the fused kernel's block products: fp32 "
            f"{report.peak_gflops['float32 blocks']:.0f} GFLOP/s, bf16 "
            + (f"{half:.0f} GFLOP/s" if half else "none (no bf16 microkernel on this CPU)")
            + ("" if kernel.half_products() else " (bf16 inputs widened to fp32 here)")
        )
    say(f"CPU: {report.machine['cpu']}; {report.machine['threads']} threads")
    say(
        f"matmul peak: fp32 {report.peak_gflops['float32']:.0f} GFLOP/s, "
        f"bf16 {report.peak_gflops['bfloat16']:.0f} GFLOP/s{blocks}"
    )
    ratio = report.peak_gflops["bfloat16"] / report.peak_gflops["float32"]
    report.bf16_case = f"bf16 matmul peak {ratio:.2f}x fp32: " + (
        "bf16 goal >= 1.7x SDPA" if ratio >= 2 else "bf16 goal >= 1.0x SDPA (peak < 2x fp32)"
    )
    say(report.bf16_case)


def _auto_line(workloads: list[dict]) -> str:
    """How many rows auto was within ``AUTO_GOAL`` of the fastest way to the same call, and
    the rows where it was not."""
    rows = [w for w in workloads if "auto_vs_fastest" in w]
    over = [w for w in rows if w["auto_vs_fastest"] > AUTO_GOAL]
    line = (
        f"\nauto within {AUTO_GOAL - 1:.0%} of the fastest way to the same call on "
        f"{len(rows) - len(over)} of {len(rows)} workloads"
    )
    if over:
        line += "; over: " + ", ".join(
            f"{w['name']} ({w['auto_vs_fastest']:.2f}x {w['fastest']}, auto ran {w['auto_chose']})"
            for w in over
        )
    return line


def _memory_line(m: dict) -> str:
    if "peak_rss_mib" in m:
        return (
            f"\n{m['title']}: peak RSS {m['peak_rss_mib']:.0f} MiB in {m['seconds']:.1f} s "
            f"(a dense bool mask alone: {m['dense_bool_mask_gib']:.2f} GiB)"
        )
    return f"\nmemory workload failed: {m.get('error')}"


def _overheads(w: Workload, rows: dict) -> dict[str, float]:
    """What a bias or the weights cost (the time with them over the time without, for
    multihead and for the fused kernel), what one head's weights cost against every head's,
    and the fused kernel's speedup over FlexAttention and tiled (the rival's time over its)."""
    fused = "multihead, fused"
    ratios = {
        "bias_overhead": ("multihead", "multihead, no bias", w.bias != "none"),
        "weights_overhead": ("multihead+weights", "multihead", w.weights),
        "fused_bias_overhead": (fused, "multihead, fused, no bias", w.bias != "none"),
        "fused_weights_overhead": ("multihead, fused+weights", fused, w.weights),
        "fused_heads_ratio": (
            "multihead, fused+weights, heads=[0]",
            "multihead, fused+weights",
            w.weights,
        ),
        "fused_vs_flex": ("flex", fused, True),
        "fused_predicate_ratio": ("multihead, fused, predicate", fused, True),
        "fused_vs_tiled": ("multihead, tiled", fused, True),
    }
    return {
        name: rows[slow]["median_s"] / rows[fast]["median_s"]
        for name, (slow, fast, applies) in ratios.items()
        if applies and slow in rows and fast in rows
    }


def _run_workload(w: Workload, quick: bool, repeats: int, peaks: dict, say) -> dict:
    contenders, notes, entries, chose = _contenders(w, quick, seed=0)
    times = interleaved(contenders, repeats)
    flops_per_entry = 4 * w.d * (3.5 if w.train else 1.0)
    peak = peaks.get(w.dtype, peaks["float32"])
    block_peak = peaks.get(f"{w.dtype} blocks")
    base = "nn.MultiheadAttention" if w.module else "sdpa"
    base_median = statistics.median(times[base])
    rows = {}
    for name, ts in times.items():
        med = statistics.median(ts)
        gflops = entries * flops_per_entry / med / 1e9
        rows[name] = {
            "median_s": med,
            "times_s": ts,
            "speedup_vs_" + base: base_median / med,
            "gflops": None if w.module else gflops,
            "fraction_of_peak": None if w.module else gflops / peak,
            "fraction_of_block_peak": None if w.module or not block_peak else gflops / block_peak,
        }
    result = {
        **asdict(w),
        "visible_entries": entries,
        "baseline": base,
        "contenders": rows,
        "notes": notes,
    }
    result.update(_overheads(w, rows))
    if chose is not None:
        result.update(_against_the_fastest(w, rows, notes, chose()))
    _say_workload(w, result, base, say)
    return result


AUTO_GOAL = 1.05  # auto at most 5% slower than the fastest way to compute the same call


def same_call(w: Workload, name: str, notes: dict) -> bool:
    """Whether contender ``name`` computes what the "multihead" row computes: not a row
    without the score modifier or with the weights too, and not SDPA where it had to run
    without the modifier (its note says so)."""
    if "no bias" in name or "+weights" in name:
        return False
    return not (name == "sdpa" and w.bias != "none" and "timed without" in notes.get("sdpa", ""))


def _against_the_fastest(w: Workload, rows: dict, notes: dict, chose: str) -> dict:
    """What auto chose, the fastest contender computing the same call, and auto's time over
    that one's (the goal: at most ``AUTO_GOAL``)."""
    same = {n: r["median_s"] for n, r in rows.items() if same_call(w, n, notes)}
    fastest = min(same, key=same.__getitem__)
    return {
        "auto_chose": chose,
        "fastest": fastest,
        "auto_vs_fastest": rows["multihead"]["median_s"] / same[fastest],
    }


def _say_workload(w: Workload, result: dict, base: str, say) -> None:
    """The printed table of one workload: every contender, the notes, the goal ratios."""
    rows, notes = result["contenders"], result["notes"]
    say(
        f"\n{w.title}: B={w.b} H={w.h} L=S={w.length} D={w.d} {w.dtype}"
        f"{' fwd+bwd' if w.train else ''}  (target {w.target})"
    )
    for name, r in rows.items():
        extra = (
            ""
            if r["gflops"] is None
            else f"  {r['gflops']:7.1f} GFLOP/s  {r['fraction_of_peak']:5.0%} of peak"
        )
        if r["fraction_of_block_peak"] is not None:
            extra += f" ({r['fraction_of_block_peak']:.0%} of the block peak)"
        speedup = r["speedup_vs_" + base]
        say(f"  {name:36s} {r['median_s'] * 1e3:9.1f} ms  {speedup:6.2f}x vs {base}{extra}")
    for name, note in notes.items():
        say(f"  {name:36s} {note}")
    if "auto_chose" in result:
        ratio = result["auto_vs_fastest"]
        verdict = "" if ratio <= AUTO_GOAL else f"  (over the goal of {AUTO_GOAL:.2f}x)"
        say(
            f"  auto ran {result['auto_chose']}: {ratio:.2f}x the fastest way to the same call"
            f" ({result['fastest']}){verdict}"
        )
    ratios = [f"{label} {result[key]:.2f}x" for key, label in _RATIOS if key in result]
    if ratios:
        say("  ratios: " + "; ".join(ratios))


# the ratios the goals are stated in, as the report names them and as the table prints them
_RATIOS = (
    ("bias_overhead", "auto with the modifier / without"),
    ("fused_bias_overhead", "fused with the modifier / without"),
    ("weights_overhead", "auto with weights / without"),
    ("fused_weights_overhead", "fused with weights / without"),
    ("fused_heads_ratio", "fused heads=[0] / all heads' weights"),
    ("fused_vs_flex", "fused speedup over compiled FlexAttention"),
    ("fused_predicate_ratio", "fused: the mask as a predicate / the built-in (goal <= 1.5x)"),
    ("fused_vs_tiled", "fused speedup over tiled"),
)
