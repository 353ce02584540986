"""The applications behind ``multihead train``: sentiment (text regression on the VADER ground
truth), forecast (causal attention on statsmodels' CO2 and sunspots), crossmodal (questions
attending to image patches of scikit-learn's digits) and lm (a small GPT-2 or Llama decoder
with its own tokenizer, trained from scratch on text files). Each trains, measures baselines in the
same run and writes a saved model, metrics.json and figures. Needs the ``train`` extra.

An application is one module plus one entry in ``TASKS``. The module has ``SUMMARY`` (its line
in ``multihead train --help``), ``run(options, info, out) -> metrics`` (``options`` annotated
with ``Options`` or a subclass adding the task's own flags, which ``multihead train TASK`` then
takes), and optionally ``throughput(options, info, steps) -> summary``, which makes it one of
the tasks ``multihead bench train`` and ``python -m multihead.apps.throughput`` time.
"""

from __future__ import annotations

import importlib
import sys
import typing
from pathlib import Path
from types import ModuleType
from typing import Any

from .._atomic import replace_folder

if typing.TYPE_CHECKING:
    from .common import Options

__all__ = [
    "TASKS",
    "Options",
    "check_out",
    "options_of",
    "run",
    "task",
    "tasks",
    "timed_tasks",
    "train",
]

# name -> the module (or its import path) of every application
TASKS: dict[str, str | ModuleType] = {
    "sentiment": "multihead.apps.sentiment",
    "forecast": "multihead.apps.forecast",
    "crossmodal": "multihead.apps.crossmodal",
    "lm": "multihead.apps.lm",
}


def __getattr__(name: str) -> Any:
    # ``Options`` (which imports torch) on first use: ``multihead generate`` and the other
    # commands in this package check their input before anything heavy is imported
    if name == "Options":
        from .common import Options

        return Options
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def task(name: str) -> ModuleType:
    """The module of the application ``name`` (imported on first use).

    Raises:
        ValueError: no application has that name.
    """
    if name not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}. Received: task={name!r}")
    module = TASKS[name]
    return importlib.import_module(module) if isinstance(module, str) else module


def options_of(name: str) -> type[Options]:
    """The options record application ``name`` runs with: the annotation of its ``run``."""
    return typing.get_type_hints(task(name).run)["options"]


def tasks() -> dict[str, tuple[str, type[Options]]]:
    """Every application's summary and options record, for ``multihead train``."""
    return {name: (task(name).SUMMARY, options_of(name)) for name in TASKS}


def timed_tasks() -> list[str]:
    """The applications whose training step ``multihead bench train`` times."""
    return [name for name in TASKS if hasattr(task(name), "throughput")]


def run(name: str, options: Options) -> dict[str, Any]:
    """Run the application ``name`` (see ``TASKS``) with ``options``; under ``torchrun`` every
    process calls this and trains its share, and rank 0 evaluates and writes. Returns the
    metrics (empty on other ranks).

    The run is written into a temporary folder beside ``options.out`` and moved into place
    whole when it ends, so an interrupted or failed run leaves ``options.out`` as it was (a
    previous run, complete, or nothing), never parts of two runs.

    Raises:
        ValueError: an unknown task, or ``options.out`` that is a file, or a folder with files
            in it (a previous run) while ``options.overwrite`` is False; checked before any
            work.
    """
    module = task(name)
    check_out(options)
    from .loop import setup, teardown

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


def train(name: str, options: Options) -> None:
    """``multihead train NAME``: ``run``, then the table of test metrics beside the baselines
    (printed by the first process only; the others return empty metrics)."""
    metrics = run(name, options)
    if metrics:
        from .summary import summarize

        print(summarize(metrics, options.out))


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
    from .. import _validation as V

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
