"""The applications behind ``multihead train``: sentiment (text regression on the VADER ground
truth), forecast (causal attention on statsmodels' CO2 and sunspots), crossmodal (questions
attending to image patches of scikit-learn's digits) and lm (a small GPT-2 or Llama decoder
with its own tokenizer, trained from scratch on text files). Each trains, measures baselines in the
same run and writes a saved model, metrics.json and figures. Needs the ``train`` extra.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

from .. import _validation as V
from .._atomic import replace_folder
from .common import Options

__all__ = ["TASKS", "Options", "check_out", "run"]

TASKS = ("sentiment", "forecast", "crossmodal", "lm")


def run(task: str, options: Options) -> dict[str, Any]:
    """Run one task (see ``TASKS``) with ``options``; under ``torchrun`` every process calls
    this and trains its share, and rank 0 evaluates and writes. Returns the metrics (empty on
    other ranks).

    The run is written into a temporary folder beside ``options.out`` and moved into place
    whole when it ends, so an interrupted or failed run leaves ``options.out`` as it was (a
    previous run, complete, or nothing), never parts of two runs.

    Raises:
        ValueError: an unknown task, or ``options.out`` that is a file, or a folder with files
            in it (a previous run) while ``options.overwrite`` is False; checked before any
            work.
    """
    if task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}. Received: task={task!r}")
    check_out(options)
    from .loop import setup, teardown

    module = importlib.import_module(f"{__name__}.{task}")
    info = setup()
    try:
        if info.main:
            _say_replaced(options.out)
        options.resolve_precision(info, say=_stderr if info.main else None)
        if not info.main:
            return module.run(options, info, None)
        with replace_folder(options.out) as staging:
            return module.run(options, info, staging)
    finally:
        info.barrier()
        teardown(info)


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _say_replaced(out: Path) -> None:
    """Before any work: the previous run in ``out`` that this one replaces (``--overwrite``)."""
    entries = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if entries:
        more = " ..." if len(entries) > 6 else ""
        _stderr(f"--out {out} holds a previous run ({', '.join(entries[:6])}{more}); "
                "--overwrite replaces it whole when this run ends")  # fmt: skip


def check_out(options: Options) -> Path:
    """``options.out`` must be a new or empty folder in an existing, writable folder (it is
    not created), or hold a run ``options.overwrite`` allows to replace."""
    out = options.out
    V.check_out_dir("--out", out)
    # the run is written beside DIR and moved into place: its parent must take new folders
    V.check_writable("--out", out.absolute().parent, out)
    if out.is_dir() and not options.overwrite:
        entries = sorted(p.name for p in out.iterdir())
        if entries:
            raise ValueError(
                f"--out {out} is not empty (a previous run?); pass --overwrite to replace it "
                f"whole when this run ends, or choose another folder. Received: --out {out} "
                f"holding {entries[:6]}{' ...' if len(entries) > 6 else ''}"
            )
    return out
