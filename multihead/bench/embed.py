"""Sentence-embedding throughput: ``multihead embed``'s packed path against
sentence-transformers' ``encode`` on the same generated sentences, in the same process.

Repeats alternate which contender runs first; medians are reported, and the embeddings of the
two are compared (they must agree to 1e-5).
"""

from __future__ import annotations

import json
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from .texts import sentences

__all__ = ["run_embed_bench"]


def run_embed_bench(
    *,
    count: int = 2000,
    repeats: int = 3,
    out_dir: Path | str = "bench-results",
    model_path: str | Path | None = None,
    say: Callable[[str], None] = print,
) -> dict:
    """Time both contenders on ``count`` sentences of 3 to 200 words; write embed.json."""
    from sentence_transformers import SentenceTransformer

    from .. import _validation as V
    from ..models import bert

    V.check_out_dir("--out", out_dir)
    V.check_positive_int("count", count)
    V.check_positive_int("repeats", repeats)

    texts = sentences(count, min_words=3, max_words=200, seed=0)
    ours = bert.load(model_path)
    theirs = SentenceTransformer(str(ours.path), device="cpu")
    tokens = sum(len(e.ids) for e in ours._encode(texts, ours.embed_length))

    def run_ours():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the truncation warning, once per run
            return ours.embed(texts)

    def run_theirs():
        return theirs.encode(texts, convert_to_tensor=True)

    contenders = {"multihead embed": run_ours, "sentence-transformers encode": run_theirs}
    warm = texts[:32]  # first-call costs (allocator, thread pools) out of the timings
    ours.embed(warm)
    theirs.encode(warm)
    times: dict[str, list[float]] = {name: [] for name in contenders}
    results = {}
    names = list(contenders)
    for r in range(repeats):
        for name in names[r % 2 :] + names[: r % 2]:  # alternate who goes first
            start = time.perf_counter()
            results[name] = contenders[name]()
            times[name].append(time.perf_counter() - start)
    diff = float((results[names[0]] - results[names[1]].cpu()).abs().max())
    med = {name: statistics.median(t) for name, t in times.items()}
    report = {
        "command": f"multihead bench --embed --sentences {count} --repeats {repeats}",
        "sentences": count,
        "tokens": tokens,
        "threads": torch.get_num_threads(),
        "median_s": med,
        "times_s": times,
        "sentences_per_s": {name: count / t for name, t in med.items()},
        "speedup": med[names[1]] / med[names[0]],
        "max_abs_diff": diff,
    }
    say(f"{count} sentences of 3-200 words ({tokens} tokens), {repeats} interleaved repeats")
    for name in names:
        say(f"  {name:30} median {med[name]:7.2f} s  {count / med[name]:7.1f} sentences/s")
    say(f"  speedup {report['speedup']:.2f}x, max |difference| of embeddings {diff:.1e}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "embed.json").write_text(json.dumps(report, indent=2))
    return report
