"""The applications behind ``multihead train``: sentiment (text regression on the VADER ground
truth), forecast (causal attention on statsmodels' CO2 and sunspots) and crossmodal (questions
attending to image patches of scikit-learn's digits). Each trains, measures baselines in the
same run and writes a saved model, metrics.json and figures. Needs the ``train`` extra.
"""

from __future__ import annotations

import importlib
from typing import Any

from .common import Options

__all__ = ["TASKS", "Options", "run"]

TASKS = ("sentiment", "forecast", "crossmodal")


def run(task: str, options: Options) -> dict[str, Any]:
    """Run one task (see ``TASKS``) with ``options``; under ``torchrun`` every process calls
    this and trains its share, and rank 0 evaluates and writes. Returns the metrics (empty on
    other ranks)."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}. Received: task={task!r}")
    from .loop import setup, teardown

    module = importlib.import_module(f"{__name__}.{task}")
    info = setup()
    try:
        return module.run(options, info)
    finally:
        info.barrier()
        teardown(info)
