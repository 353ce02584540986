"""Sentence-embedding throughput: ``multihead embed``'s packed path, in fp32 and with bf16
linear layers (``--precision bf16``), against sentence-transformers' ``encode`` (fp32) on the
same generated sentences, in the same process, and (with the ``export`` extra) the exported
graph on onnxruntime in fp32 and with int8 weights.

Every contender uses the same number of threads. Repeats rotate which contender runs first;
medians are reported. Embeddings are compared: torch and onnxruntime fp32 against
sentence-transformers (they must agree to 1e-5), bf16 and int8 against fp32 by cosine
similarity. ``--precision auto`` is resolved as ``multihead embed`` resolves it (its
measurement timed apart); its row is the contender it chose, printed with the goal for it
beside the CPU and the bf16/fp32 matmul ratio measured in the same run.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from .._flags import option, positive_int
from .options import Timed
from .texts import sentences

if TYPE_CHECKING:
    from ..models.bert import Pretrained

__all__ = ["AUTO_GOAL", "BF16_PAYS", "EmbedBenchOptions", "run_embed_bench"]

FP32_ROW = "multihead embed"
BF16_ROW = "multihead embed --precision bf16"
ST_ROW = "sentence-transformers encode"
# the goal: --precision auto at least this much faster than sentence-transformers fp32 ...
AUTO_GOAL = 2.5
# ... on a machine whose bf16 matmuls measure at least this much faster than fp32
BF16_PAYS = 2.0


def _quiet(embed: Callable[[list[str]], object]) -> Callable[[list[str]], object]:
    """``embed`` without its truncation warning (once per run, it would repeat per repeat)."""

    def run(batch: list[str]) -> object:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return embed(batch)

    return run


def _onnx_contenders(
    ours, onnx_path: str | Path | None, folder: Path, threads: int
) -> dict[str, Callable[[list[str]], object]]:
    """onnxruntime on the fp32 graph (``onnx_path``, or exported into ``folder``) and on its
    int8 quantization."""
    from ..export import OnnxBert, quantize_int8, to_onnx

    fp32 = Path(onnx_path) if onnx_path else to_onnx(ours, folder / "f.onnx")
    int8 = quantize_int8(fp32, folder / "int8.onnx")
    return {
        "onnxruntime fp32": _quiet(OnnxBert(fp32, ours, threads=threads).embed),
        "onnxruntime int8": _quiet(OnnxBert(int8, ours, threads=threads).embed),
    }


@dataclass(frozen=True, kw_only=True)
class EmbedBenchOptions(Timed):
    """What ``multihead bench embed`` takes (``multihead bench embed --help``)."""

    sentences: int = option(2000, "sentences to embed", parse=positive_int)
    threads: int | None = option(None, "torch/onnxruntime threads (default: all)")
    model: Path | None = option(
        None, "BERT-family model folder (default: all-MiniLM-L6-v2)", metavar="PATH"
    )
    onnx: Path | None = option(
        None,
        "time this exported graph of the same model (default: export one into a temporary "
        "folder, about 20 s, not timed)",
        metavar="FILE.onnx",
    )


def run_embed_bench(options: EmbedBenchOptions, *, say: Callable[[str], None] = print) -> dict:
    """Time every contender on ``options.sentences`` sentences of 3 to 200 words; write
    embed.json."""
    from sentence_transformers import SentenceTransformer

    from .. import _validation as V
    from .._progress import Stages
    from ..models import bert

    count, repeats, threads = options.sentences, options.repeats or 3, options.threads
    out_dir, model_path, onnx_path = options.out, options.model, options.onnx
    V.check_out_dir("--out", out_dir)
    V.check_positive_int("count", count)
    V.check_positive_int("repeats", repeats)

    if threads is not None:
        torch.set_num_threads(V.check_positive_int("threads", threads))
    threads = torch.get_num_threads()
    texts = sentences(count, min_words=3, max_words=200, seed=0)
    progress = Stages("bench embed", ["loading the models", "exporting to ONNX", "timing"], "step")
    progress.begin("loading the models")
    ours = bert.load(model_path)
    theirs = SentenceTransformer(str(ours.path), device="cpu")
    tokens = sum(len(e.ids) for e in ours._encode(texts, ours.embed_length))
    bf16, auto = _precisions(ours, texts, say)

    contenders = {
        FP32_ROW: _quiet(ours.embed),
        BF16_ROW: _quiet(bf16.embed),
        ST_ROW: lambda t: theirs.encode(t, convert_to_tensor=True),
    }
    folder = tempfile.TemporaryDirectory(prefix="multihead-bench-embed-")
    try:
        int8_cosine = None
        if importlib.util.find_spec("onnxruntime") is None:
            say("onnxruntime rows skipped: install them with pip install 'multihead[export]'")
        else:
            progress.begin("exporting to ONNX")
            contenders.update(_onnx_contenders(ours, onnx_path, Path(folder.name), threads))
        progress.begin("timing")
        results, times = _timed(contenders, texts, repeats)
    finally:
        progress.close()
        folder.cleanup()
    reference = np.asarray(results[ST_ROW].cpu())
    diffs = {
        name: float(np.abs(np.asarray(results[name]) - reference).max())
        for name in (FP32_ROW, "onnxruntime fp32")
        if name in results
    }
    if "onnxruntime int8" in results:
        int8_cosine = _cosines(results["onnxruntime int8"], results["onnxruntime fp32"])
    med = {name: statistics.median(t) for name, t in times.items()}
    base = med[ST_ROW]
    report = {
        "command": f"multihead bench embed --sentences {count} --repeats {repeats} "
        f"--threads {threads}",
        "sentences": count,
        "tokens": tokens,
        "threads": threads,
        "median_s": med,
        "times_s": times,
        "sentences_per_s": {name: count / t for name, t in med.items()},
        "speedup": base / med[FP32_ROW],
        "speedup_vs_sentence_transformers": {name: base / t for name, t in med.items()},
        "max_abs_diff": diffs[FP32_ROW],
        "max_abs_diff_vs_sentence_transformers": diffs,
        "bf16_cosine_vs_fp32": _cosines(results[BF16_ROW], results[FP32_ROW]),
        "int8_cosine_vs_fp32": int8_cosine,
        "precision_auto": _auto_report(auto, base / med[auto["row"]]),
    }
    say(
        f"{count} sentences of 3-200 words ({tokens} tokens), {repeats} rotated repeats, "
        f"{threads} threads"
    )
    for name in med:
        say(
            f"  {name:32} median {med[name]:7.2f} s  {count / med[name]:7.1f} sentences/s  "
            f"{base / med[name]:5.2f}x sentence-transformers"
        )
    say(f"  speedup {report['speedup']:.2f}x (multihead embed over sentence-transformers)")
    for name, diff in diffs.items():
        say(f"  {name}: max |difference| from sentence-transformers {diff:.1e}")
    if int8_cosine is not None:
        say(
            f"  int8 vs fp32 cosine similarity: mean {int8_cosine['mean']:.5f}, "
            f"min {int8_cosine['min']:.5f}"
        )
    _say_precisions(report, say)
    out = Path(out_dir)
    out.mkdir(exist_ok=True)
    (out / "embed.json").write_text(json.dumps(report, indent=2))
    return report


def _precisions(
    ours: Pretrained, texts: list[str], say: Callable[[str], None]
) -> tuple[Pretrained, dict]:
    """The model with bf16 linear layers, and what ``--precision auto`` chose on ``texts``
    (as ``multihead embed`` chooses), with the seconds its measurement took."""
    from .._machine import cpu_info
    from ..apps.embed_precision import at_precision

    bf16, _ = at_precision(ours, "bf16", say=say)  # measures the matmul peaks, kept
    start = time.perf_counter()
    _, choice = at_precision(ours, "auto", texts=texts)
    auto = {
        "choice": choice,
        "measure_s": time.perf_counter() - start,
        "row": BF16_ROW if choice.precision == "bf16" else FP32_ROW,
        "cpu": cpu_info()[0],
    }
    return bf16, auto


def _cosines(a: object, b: object) -> dict[str, float]:
    """Mean and minimum cosine similarity of the rows of ``a`` to those of ``b``."""
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    cosine = (x * y).sum(1) / (np.linalg.norm(x, axis=1) * np.linalg.norm(y, axis=1))
    return {"mean": float(cosine.mean()), "min": float(cosine.min())}


def _auto_report(auto: dict, speedup: float) -> dict:
    """``--precision auto``'s row: its choice, the matmul peaks it measured and the goal."""
    choice = auto["choice"]
    ratio = choice.peaks.ratio
    applies = ratio >= BF16_PAYS
    return {
        **choice.as_json(),
        "cpu": auto["cpu"],
        "measure_s": auto["measure_s"],
        "row": auto["row"],
        "speedup_vs_sentence_transformers": speedup,
        "goal": (
            f"--precision auto >= {AUTO_GOAL}x sentence-transformers fp32 where bf16 matmuls "
            f"are >= {BF16_PAYS}x fp32"
        ),
        "goal_applies": applies,
        "goal_met": (speedup >= AUTO_GOAL) if applies else None,
    }


def _say_precisions(report: dict, say: Callable[[str], None]) -> None:
    auto, cosine = report["precision_auto"], report["bf16_cosine_vs_fp32"]
    say(f"  bf16 vs fp32 cosine similarity: mean {cosine['mean']:.6f}, min {cosine['min']:.6f}")
    say(
        f"  CPU {auto['cpu']}: matmul {auto['matmul_size']}^3 fp32 "
        f"{auto['fp32_matmul_gflops']:.0f} GFLOP/s, bf16 {auto['bf16_matmul_gflops']:.0f} "
        f"GFLOP/s ({auto['bf16_over_fp32']:.2f}x)"
    )
    say(
        f"  --precision auto chose {auto['chosen']} (measured in {auto['measure_s']:.1f} s: "
        f"{auto['reason']}): {auto['speedup_vs_sentence_transformers']:.2f}x "
        "sentence-transformers fp32"
    )
    verdict = "met" if auto["goal_met"] else "missed"
    if not auto["goal_applies"]:
        verdict = "does not apply"
    say(
        f"  goal {auto['goal']}: {verdict} ({auto['speedup_vs_sentence_transformers']:.2f}x; "
        f"bf16/fp32 matmul {auto['bf16_over_fp32']:.2f}x)"
    )


def _timed(
    contenders: dict[str, Callable[[list[str]], object]], texts: list[str], repeats: int
) -> tuple[dict[str, object], dict[str, list[float]]]:
    """Run every contender on ``texts`` ``repeats`` times, rotating who goes first; the last
    results and every time."""
    for run in contenders.values():  # first-call costs (allocator, thread pools) untimed
        run(texts[:32])
    times: dict[str, list[float]] = {name: [] for name in contenders}
    results: dict[str, object] = {}
    names = list(contenders)
    for r in range(repeats):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            results[name] = contenders[name](texts)
            times[name].append(time.perf_counter() - start)
    return results, times
