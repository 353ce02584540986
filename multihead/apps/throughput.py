"""Training throughput of each application's model on its real data, without the evaluation
and baselines of a full run: ``python -m multihead.apps.throughput TASK [--precision bf16]
[--compile] [--steps N]``, also under ``torchrun --nproc-per-node N``. Prints one JSON line
(rank 0) with samples/s measured after the first two steps (which pay for compilation).

``compare`` (``multihead bench train``) runs every task under several variants in one process
(eager fp32, compiled, bf16 autocast, both) and tabulates samples/s against eager fp32, with
the compiled step's graph breaks and the machine's measured matmul peaks."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import precision as _precision
from .common import Options
from .loop import setup, teardown

__all__ = ["VARIANTS", "compare", "main"]

# variant -> (--precision, torch.compile the step); auto resolves by timing the task's step
VARIANTS = {
    "eager": ("fp32", False),
    "compiled": ("fp32", True),
    "bf16": ("bf16", False),
    "compiled-bf16": ("bf16", True),
    "auto": ("auto", False),
}


def _sentiment(options: Options, info: Any, steps: int) -> dict[str, Any]:
    from ..models import bert
    from . import sentiment as s

    corpora = s.read_corpora(options.data)
    pretrained = bert.load()
    texts = [c.texts[i] for c in corpora for i in s.split(c, options.seed)[0]]
    ratings = np.concatenate([c.ratings[s.split(c, options.seed)[0]] for c in corpora])
    count = min(len(texts), 32 * (steps + 2) * 4)  # enough texts for the batches, few to encode
    ids = s.encode(pretrained.tokenizer, texts[:count], 128)
    model = s.SentimentRegressor(pretrained.model, alphas=s.STRETCHES)
    config = options.train_config(epochs=1, batch_size=32, lr=5e-5)
    targets = np.stack([s.stretch(ratings[:count], a) for a in s.STRETCHES], axis=1)
    result = s._train(model, ids, targets, config, info, "MiniLM")
    return result.summary()


def _forecast(options: Options, info: Any, steps: int) -> dict[str, Any]:
    from . import forecast as f

    return f._train_one(f.load_series("co2"), options, info)[1].summary()


def _crossmodal(options: Options, info: Any, steps: int) -> dict[str, Any]:
    from sklearn.datasets import load_digits

    from . import crossmodal as c
    from .loop import fit

    digits = load_digits()
    qs = c.make_questions(digits.target, 8, options.seed)
    ids, lengths = c.tokenize(qs.words)
    image = c.patches(digits.images)[qs.image]
    answers = torch.as_tensor(qs.answer, dtype=torch.float32)

    def collate(idx):
        return tuple(t[idx].to(info.device) for t in (ids, lengths, image, answers))

    def loss_fn(m, batch):
        x, n, img, y = batch
        logits = m(x, n, img).float()
        return torch.nn.functional.binary_cross_entropy_with_logits(logits, y, reduction="none")

    config = options.train_config(epochs=1, batch_size=64, lr=2e-3)
    return fit(c.CrossModalQA(), len(answers), collate, loss_fn, config, info).summary()


_TASKS = {"sentiment": _sentiment, "forecast": _forecast, "crossmodal": _crossmodal}
TASKS = tuple(_TASKS)


def compare(
    tasks: list[str],
    variants: list[str],
    *,
    steps: int = 20,
    data: str | None = None,
    cpu: str = "",
    say=print,
) -> dict[str, Any]:
    """samples/s of each task's training step under each variant (``VARIANTS``), in this
    process, with the matmul peaks measured first and what ``--precision auto`` picks from
    them. Rows keep the compiled step's graph-break count; ``vs_eager`` is the ratio to the
    same task's eager fp32 row when it ran."""
    for name, value, allowed in (("tasks", tasks, TASKS), ("variants", variants, VARIANTS)):
        unknown = [v for v in value if v not in allowed]
        if unknown or not value:
            raise ValueError(
                f"{name} must be one or more of {', '.join(allowed)}. Received: {name}={value}"
            )
    info = setup()
    auto = _precision.choose("auto", info.device)
    report: dict[str, Any] = {
        "cpu": cpu,
        "threads": torch.get_num_threads(),
        "steps": steps,
        "peaks": auto.as_json(),
        "rows": [],
    }
    say(f"cpu: {cpu or 'unknown'}, torch threads {torch.get_num_threads()}")
    say(f"matmul peaks: {auto.reason.split(': ', 1)[1]}; --precision auto (variant auto) "
        "also times each task's own step in fp32 and bf16")  # fmt: skip
    say(f"{'task':<11} {'variant':<14} {'ran as':<6} {'samples/s':>10} {'vs eager':>9} "
        f"{'first step s':>13} {'graph breaks':>13}")  # fmt: skip
    try:
        for task in tasks:
            base = None
            for variant in variants:
                row = _variant_row(task, variant, steps, data, info)
                if variant == "eager":
                    base = row["samples_per_s"]
                row["vs_eager"] = round(row["samples_per_s"] / base, 3) if base else None
                report["rows"].append(row)
                ratio = "" if row["vs_eager"] is None else f"{row['vs_eager']:.2f}x"
                breaks = "" if row["graph_breaks"] is None else str(row["graph_breaks"])
                say(f"{task:<11} {variant:<14} {row['precision']:<6} "
                    f"{row['samples_per_s']:>10.1f} {ratio:>9} {row['first_step_s']:>13.2f} "
                    f"{breaks:>13}")  # fmt: skip
    finally:
        teardown(info)
    return report


def _variant_row(task: str, variant: str, steps: int, data: str | None, info) -> dict[str, Any]:
    dtype, compiled = VARIANTS[variant]
    options = Options(out=Path("."), data=data, precision=dtype, compile=compiled,
                      max_steps=steps, progress=False)  # fmt: skip
    import torch._dynamo

    torch._dynamo.reset()  # every compiled variant pays for its own compilation
    summary = _TASKS[task](options, info, steps)
    report = summary.get("compile")
    return {
        "task": task,
        "variant": variant,
        "precision": summary["precision"],  # auto: what it resolved to
        "compile": compiled,
        "samples_per_s": summary["samples_per_s"],
        "first_step_s": summary["first_step_s"],
        "steps": summary["steps"],
        "graph_breaks": None if report is None else report["graph_breaks"],
        "compiled_graphs": None if report is None else report["compiled_graphs"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m multihead.apps.throughput")
    parser.add_argument("task", choices=sorted(_TASKS))
    parser.add_argument("--precision", default="fp32", choices=_precision.REQUESTS)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps (default 20)")
    parser.add_argument("--data", help="sentiment data folder (as for multihead train)")
    args = parser.parse_args(argv)
    options = Options(
        out=Path("."),
        data=args.data,
        precision=args.precision,
        compile=args.compile,
        max_steps=args.steps,
        progress=False,
    )
    info = setup()
    try:
        summary = _TASKS[args.task](options, info, args.steps)
    finally:
        teardown(info)
    if info.main:
        keep = ("steps", "samples", "samples_per_s", "first_step_s", "train_seconds")
        row = {"task": args.task, "precision": args.precision, "compile": args.compile,
               "processes": info.world, "threads": torch.get_num_threads(),
               **{k: summary[k] for k in keep}}  # fmt: skip
        if "compile" in summary:
            row["graph_breaks"] = summary["compile"]
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
