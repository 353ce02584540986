"""What every application shares: its options, the run folder, metrics.json and the training
curve figure. Needs the ``train`` extra (matplotlib for figures)."""

from __future__ import annotations

import json
import math
import platform
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .._flags import option, positive_int, required
from .loop import Dist, FitResult, TrainConfig
from .precision import REQUESTS, PrecisionChoice, choose

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["Options", "figure", "need", "save_figure", "seed_everything", "training_curve"]


@dataclass
class Options:
    """The options of ``multihead train TASK`` (``multihead train TASK --help``); an
    application with options of its own subclasses it."""

    out: Path = required(
        "folder for model and metrics: new or empty, in a folder that exists; written whole "
        "when the run ends",
        metavar="DIR",
    )
    overwrite: bool = option(False, "replace a previous run in DIR when this one ends")
    quick: bool = option(
        False,
        "a small version, for a first look and the tests: under half a minute (forecast, "
        "crossmodal) to about 2 minutes (sentiment, lm) on 2 CPU cores",
    )
    data: Path | None = option(
        None,
        "sentiment: a folder of *_GroundTruth.txt files or one such file; lm: any UTF-8 text "
        "file or folder (default: the VADER ground truth in the cache, which 'multihead data "
        "download vader' fetches)",
        metavar="PATH",
    )
    seed: int = option(0, "seed for data, init and order")
    precision: str = option(
        "auto",
        "autocast dtype; auto: bf16 where the model's own training step measures faster in bf16 "
        "on this machine (timed once, on the first batch), else fp32 (fp16 on CUDA only)",
        choices=REQUESTS,
    )
    compile: bool = option(False, "torch.compile the train step")
    epochs: int | None = option(None, "override the task's number of epochs", parse=positive_int)
    max_steps: int | None = option(None, "stop after this many optimizer steps", parse=positive_int)
    baselines: bool = option(True, "skip the baselines", flag="--no-baselines")
    progress: bool = option(True, "no progress bars", flag="--no-progress")
    # set by ``resolve_precision``: what ``precision`` was resolved from, and why
    precision_choice: PrecisionChoice | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        if self.data is not None:
            self.data = Path(self.data)
        if self.precision not in REQUESTS:
            raise ValueError(
                f"precision must be one of {', '.join(REQUESTS)}. "
                f"Received: precision={self.precision!r}"
            )
        for name in ("epochs", "max_steps"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive int. Received: {name}={value!r}")

    def resolve_precision(self, info: Dist, say=None) -> None:
        """Record an explicit ``--precision`` (``precision.choose``, which warns through
        ``say`` about bf16 on a machine where it is slower; the choice and the measured peaks
        are kept in ``precision_choice`` for metrics.json). ``auto`` stays ``auto`` here: the
        run's first training (``loop.fit``) times its model's step under both precisions and
        ``adopt`` takes its choice for the rest of the run."""
        if self.precision_choice is None and self.precision != "auto":
            self.precision_choice = choose(self.precision, info.device, say=say)
            self.precision = self.precision_choice.precision

    def adopt(self, result: FitResult) -> None:
        """After a training: if the run's precision was still ``auto``, take the one that
        training resolved (so later trainings and the evaluation run under it)."""
        if self.precision == "auto" and result.precision_choice is not None:
            self.precision_choice = result.precision_choice
            self.precision = result.precision

    def train_config(self, *, epochs: int, **kwargs: Any) -> TrainConfig:
        """The task's training settings with the command line's overrides applied."""
        return TrainConfig(
            epochs=self.epochs or epochs,
            precision=self.precision,
            compile=self.compile,
            seed=self.seed,
            max_steps=self.max_steps,
            progress=self.progress,
            **kwargs,
        )

    def as_json(self) -> dict[str, Any]:
        out = asdict(self)
        del out["precision_choice"]  # metrics.json has it whole under "precision"
        out["out"] = str(self.out)
        out["data"] = None if self.data is None else str(self.data)
        return out


def need(module: str, feature: str) -> Any:
    """Import an optional dependency, or say which extra installs it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ModuleNotFoundError(
            f"{feature} needs the package that provides {module}; install it with "
            f"pip install 'multihead[train]'. Received: ImportError({err})"
        ) from err


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (baselines and data generation use the same seed)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def figure(**kwargs: Any) -> Figure:
    """A matplotlib Figure without pyplot state (Agg canvas on save)."""
    need("matplotlib", "figures")
    from matplotlib.figure import Figure

    kwargs.setdefault("layout", "constrained")  # titles and axis labels never overlap
    return Figure(**kwargs)


def save_figure(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


def training_curve(curves: dict[str, FitResult], path: Path, title: str) -> Path:
    """Loss after every step for each trained model, one panel each (log scale)."""
    fig = figure(figsize=(4.2 * len(curves), 3.2))
    axes = fig.subplots(1, len(curves), squeeze=False)[0]
    for ax, (name, result) in zip(axes, curves.items()):
        steps = np.arange(1, len(result.losses) + 1)
        ax.plot(steps, result.losses, lw=0.8, color="tab:blue", alpha=0.5, label="step")
        window = max(1, len(steps) // 25)
        if window > 1:
            smooth = np.convolve(result.losses, np.ones(window) / window, mode="valid")
            ax.plot(steps[window - 1 :], smooth, color="tab:blue", label=f"mean of {window}")
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        ax.set_title(name, fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    return save_figure(fig, path)


def finish(
    metrics: dict[str, Any], options: Options, info: Dist, started: float, out: Path
) -> dict[str, Any]:
    """Add what every metrics.json holds (seed, options, wall time, machine) and write it
    into ``out``, the folder the run is written to (it becomes ``options.out`` at the end)."""
    metrics = {
        **metrics,
        "seed": options.seed,
        "options": options.as_json(),
        "precision": (
            options.precision_choice.as_json()
            if options.precision_choice is not None
            else {"requested": options.precision, "chosen": options.precision}
        ),
        "processes": info.world,
        "wall_seconds": round(time.perf_counter() - started, 2),
        "machine": {
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "device": str(info.device),
            "python": platform.python_version(),
        },
    }
    path = out / "metrics.json"
    path.write_text(json.dumps(_clean(metrics), indent=2) + "\n")
    return metrics


def _clean(value: Any) -> Any:
    """JSON without NaN (written as null) and with NumPy scalars as Python numbers."""
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
