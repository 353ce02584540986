"""Training throughput of each application's model on its real data, without the evaluation
and baselines of a full run: ``python -m multihead.apps.throughput TASK [--precision bf16]
[--compile] [--steps N]``, also under ``torchrun --nproc-per-node N``. Prints one JSON line
(rank 0) with samples/s measured after the first two steps (which pay for compilation). The
tasks are the applications of ``multihead.apps.TASKS`` that have a ``throughput`` function.

``compare`` (``multihead bench train``) runs every task under several variants in one process
(eager fp32, compiled, bf16 autocast, both) and tabulates samples/s against eager fp32, with
the compiled step's graph breaks and the machine's measured matmul peaks."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import _machine
from .. import _validation as V
from .._flags import option, positive_int
from . import options_of, task, timed_tasks
from . import precision as _precision
from .loop import setup, teardown

__all__ = ["VARIANTS", "TrainBenchOptions", "compare", "main"]

# variant -> (--precision, torch.compile the step); auto resolves by timing the task's step
VARIANTS = {
    "eager": ("fp32", False),
    "compiled": ("fp32", True),
    "bf16": ("bf16", False),
    "compiled-bf16": ("bf16", True),
    "auto": ("auto", False),
}


@dataclass(frozen=True, kw_only=True)
class TrainBenchOptions:
    """What ``multihead bench train`` takes (``multihead bench train --help``)."""

    out: Path = option(Path("bench-results"), "folder for the results", metavar="DIR")
    tasks: tuple[str, ...] | None = option(
        None, "apps to time (default: every app with a timed step)", choices=timed_tasks
    )
    variants: tuple[str, ...] = option(
        tuple(VARIANTS),
        "step variants; auto is --precision auto, which times the task's step in fp32 and "
        "bf16 first",
        choices=tuple(VARIANTS),
    )
    steps: int = option(20, "steps per variant (2 untimed)", parse=positive_int)
    data: Path | None = option(None, "sentiment data (as for train)", metavar="PATH")

    def __post_init__(self) -> None:
        for name, value, allowed in (
            ("tasks", timed_tasks() if self.tasks is None else self.tasks, timed_tasks()),
            ("variants", self.variants, VARIANTS),
        ):
            unknown = [v for v in value if v not in allowed]
            if unknown or not value:
                raise ValueError(
                    f"{name} must be one or more of {', '.join(allowed)}. "
                    f"Received: {name}={list(value)}"
                )


def compare(options: TrainBenchOptions, *, say=print) -> dict[str, Any]:
    """samples/s of each task's training step under each variant (``VARIANTS``), in this
    process, with the matmul peaks measured first and what ``--precision auto`` picks from
    them; written to ``options.out``/train.json. Rows keep the compiled step's graph-break
    count; ``vs_eager`` is the ratio to the same task's eager fp32 row when it ran."""
    out = V.check_out_dir("--out", options.out)  # before the work
    cpu = _machine.cpu_info()[0]
    info = setup()
    auto = _precision.choose("auto", info.device)
    report: dict[str, Any] = {
        "cpu": cpu,
        "threads": torch.get_num_threads(),
        "steps": options.steps,
        "peaks": auto.as_json(),
        "rows": [],
    }
    say(f"cpu: {cpu or 'unknown'}, torch threads {torch.get_num_threads()}")
    say(f"matmul peaks: {auto.reason.split(': ', 1)[1]}; --precision auto (variant auto) "
        "also times each task's own step in fp32 and bf16")  # fmt: skip
    say(f"{'task':<11} {'variant':<14} {'ran as':<6} {'samples/s':>10} {'vs eager':>9} "
        f"{'first step s':>13} {'graph breaks':>13}")  # fmt: skip
    try:
        for name in options.tasks or timed_tasks():
            base = None
            for variant in options.variants:
                row = _variant_row(name, variant, options.steps, options.data, info)
                if variant == "eager":
                    base = row["samples_per_s"]
                row["vs_eager"] = round(row["samples_per_s"] / base, 3) if base else None
                report["rows"].append(row)
                ratio = "" if row["vs_eager"] is None else f"{row['vs_eager']:.2f}x"
                breaks = "" if row["graph_breaks"] is None else str(row["graph_breaks"])
                say(f"{name:<11} {variant:<14} {row['precision']:<6} "
                    f"{row['samples_per_s']:>10.1f} {ratio:>9} {row['first_step_s']:>13.2f} "
                    f"{breaks:>13}")  # fmt: skip
    finally:
        teardown(info)
    out.mkdir(exist_ok=True)
    (out / "train.json").write_text(json.dumps(report, indent=2) + "\n")
    say(f"written: {out / 'train.json'}")
    return report


def _variant_row(name: str, variant: str, steps: int, data: Path | None, info) -> dict[str, Any]:
    dtype, compiled = VARIANTS[variant]
    options = options_of(name)(out=Path("."), data=data, precision=dtype, compile=compiled,
                               max_steps=steps, progress=False)  # fmt: skip
    import torch._dynamo

    torch._dynamo.reset()  # every compiled variant pays for its own compilation
    summary = task(name).throughput(options, info, steps)
    report = summary.get("compile")
    return {
        "task": name,
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
    parser.add_argument("task", choices=timed_tasks())
    parser.add_argument("--precision", default="fp32", choices=_precision.REQUESTS)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps (default 20)")
    parser.add_argument("--data", help="sentiment data folder (as for multihead train)")
    args = parser.parse_args(argv)
    options = options_of(args.task)(
        out=Path("."),
        data=args.data,
        precision=args.precision,
        compile=args.compile,
        max_steps=args.steps,
        progress=False,
    )
    info = setup()
    try:
        summary = task(args.task).throughput(options, info, args.steps)
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
