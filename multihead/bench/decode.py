"""Greedy decoding throughput: ``multihead.models.gpt2`` against transformers' ``generate()`` on
the same random GPT-2-small-shaped weights, in the same process.

Decoding one token per row reads every weight once per step (and each row's cache), so the
machine's memory bandwidth bounds both sides; the report states the bytes read per generated
token and the bandwidth measured in the same run beside the tokens/s. Repeats alternate the
order of the contenders; medians are reported, and the generated tokens must be identical.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import _validation as V
from .._progress import stages

__all__ = ["DecodeShape", "memory_bandwidth", "run_decode_bench"]


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


def _contenders(ours, theirs, ids: torch.Tensor, new: int) -> dict[str, Callable]:
    mask = torch.ones_like(ids)

    def hf(**kw):
        def call():
            with torch.inference_mode():
                return theirs.generate(
                    ids, attention_mask=mask, max_new_tokens=new, do_sample=False, **kw
                )

        return call

    return {
        "multihead generate": lambda: ours.generate(ids, new),
        "transformers generate (dynamic cache)": hf(),
        "transformers generate (static cache)": hf(cache_implementation="static"),
    }


def run_decode_bench(
    *,
    repeats: int = 3,
    batch_sizes: tuple[int, ...] = (1, 8),
    shape: DecodeShape = DecodeShape(),
    out_dir: Path | str = "bench-results",
    say: Callable[[str], None] = print,
) -> dict:
    """Time greedy generation for every batch size; write decode.json and decode.png."""
    from ..models import gpt2

    out = V.check_out_dir("--out", out_dir)  # before the work
    bandwidth = memory_bandwidth()
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' notes about generation settings
        theirs = _build(shape, Path(tmp))
        ours = gpt2.load(tmp)
    weight_bytes = sum(p.numel() * p.element_size() for p in ours.parameters())
    cache_bytes = ours.new_cache(1).bytes_per_token
    say(
        f"GPT-2-shaped random model: {shape.layers} layers, E={shape.embed_dim}, "
        f"{shape.heads} heads, vocab {shape.vocab} ({weight_bytes / 1e6:.0f} MB of fp32 weights); "
        f"prompt {shape.prompt}, {shape.new_tokens} new tokens, {repeats} interleaved repeats, "
        f"{torch.get_num_threads()} threads"
    )
    say(f"measured read bandwidth {bandwidth:.1f} GB/s; KV cache {cache_bytes} bytes per token")
    g = torch.Generator().manual_seed(1)
    results = []
    steps = [f"B={b}" for b in batch_sizes]
    with stages("bench decode", steps, unit="batch size", say=say) as (bar, tell):
        for b, step in zip(batch_sizes, steps):
            bar.begin(step)
            results.append(_batch_row(ours, theirs, b, shape, g, repeats, weight_bytes,
                                      cache_bytes, bandwidth, tell))  # fmt: skip
    report = {
        "command": "multihead bench decode" + (f" --repeats {repeats}" if repeats != 3 else ""),
        "shape": shape.__dict__,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "bandwidth_gb_s": bandwidth,
        "weight_bytes": weight_bytes,
        "kv_cache_bytes_per_token": cache_bytes,
        "results": results,
    }
    out.mkdir(exist_ok=True)
    (out / "decode.json").write_text(json.dumps(report, indent=2))
    chart = _chart(report, out / "decode.png")
    say(f"\nwrote {out / 'decode.json'}" + (f" and {chart}" if chart else ""))
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


def _batch_row(ours, theirs, b: int, shape: DecodeShape, g: torch.Generator, repeats: int,
               weight_bytes: int, cache_bytes: int, bandwidth: float,
               say: Callable[[str], None]) -> dict:  # fmt: skip
    """Time both contenders at batch size ``b`` (interleaved repeats) and print the row."""
    ids = torch.randint(0, shape.vocab, (b, shape.prompt), generator=g)
    contenders = _contenders(ours, theirs, ids, shape.new_tokens)
    names = list(contenders)
    outputs = {name: fn() for name, fn in contenders.items()}  # warm-up, and the tokens
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = time.perf_counter()
            contenders[name]()
            times[name].append(time.perf_counter() - start)
    med = {name: statistics.median(t) for name, t in times.items()}
    tokens = b * shape.new_tokens
    # a step reads every weight once for the whole batch, plus each row's cache
    mean_keys = shape.prompt + (shape.new_tokens - 1) / 2
    per_step = weight_bytes + b * mean_keys * cache_bytes
    row = {
        "batch": b,
        "median_s": med,
        "times_s": times,
        "tokens_per_s": {name: tokens / t for name, t in med.items()},
        "speedup_vs": {name: med[name] / med[names[0]] for name in names[1:]},
        "identical_tokens": {
            name: bool(torch.equal(outputs[name], outputs[names[0]])) for name in names[1:]
        },
        "bytes_read_per_token": per_step / b,
        "bandwidth_bound_tokens_per_s": bandwidth * 1e9 / (per_step / b),
    }
    say(
        f"\nB={b}: {per_step / b / 1e6:.1f} MB read per generated token; the bandwidth "
        f"allows at most {row['bandwidth_bound_tokens_per_s']:.0f} tokens/s"
    )
    for name in names:
        extra = ""
        if name != names[0]:
            same = "identical tokens" if row["identical_tokens"][name] else "TOKENS DIFFER"
            extra = f"  multihead at {row['speedup_vs'][name]:.2f}x its tokens/s, {same}"
        say(f"  {name:40} {row['tokens_per_s'][name]:7.1f} tokens/s{extra}")
    return row
