"""An application is one module and one entry in ``multihead.apps.TASKS``: a toy app added
from here is listed by ``multihead train --help``, takes its own flags, trains through the
run folder's rules, and is timed by ``bench train`` and the throughput script."""

from __future__ import annotations

import json
import types
from dataclasses import dataclass
from pathlib import Path

import pytest

from multihead import apps, cli
from multihead._flags import option, positive_int
from multihead.apps import throughput
from multihead.apps.common import Options
from multihead.apps.loop import Dist


@dataclass
class ToyOptions(Options):
    width: int = option(3, "the toy's width", parse=positive_int)


def _run(options: ToyOptions, info: Dist, out: Path | None) -> dict:
    """A model that predicts ``width`` against a baseline that predicts 0."""
    metrics = {
        "task": "toy",
        "metrics": {"model": {"mae": 1 / options.width}, "zero": {"mae": 1.0}},
        "seed": options.seed,
    }
    if out is not None:
        (out / "metrics.json").write_text(json.dumps(metrics))
    return metrics


def _throughput(options: ToyOptions, info: Dist, steps: int) -> dict:
    return {"precision": "fp32", "samples_per_s": 100.0 * options.width, "first_step_s": 0.5,
            "steps": steps}  # fmt: skip


@pytest.fixture
def toy(monkeypatch):
    module = types.ModuleType("toy_app")
    module.SUMMARY = "predict the toy's width"
    module.run = _run
    module.throughput = _throughput
    monkeypatch.setitem(apps.TASKS, "toy", module)
    return module


def test_a_toy_app_trains_from_its_entry_alone(toy, tmp_path, capsys):
    out = tmp_path / "run"
    assert cli.main(["train", "toy", "--width", "4", "--seed", "7", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert json.loads((out / "metrics.json").read_text())["metrics"]["model"]["mae"] == 0.25
    assert "toy: test metrics of the model and its baselines" in printed
    assert "0.250*" in printed and f"wrote {out}" in printed
    # the run folder's rules hold for it too: a previous run is refused
    assert cli.main(["train", "toy", "--out", str(out)]) == 2
    assert "is not empty (a previous run?)" in capsys.readouterr().err


def test_a_toy_app_is_listed_and_has_its_own_flags(toy, capsys):
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    assert "predict the toy's width" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["train", "forecast", "--width", "4", "--out", "x"])
    assert "unrecognized arguments: --width 4" in capsys.readouterr().err
    assert apps.options_of("toy") is ToyOptions


def test_a_toy_app_with_a_timed_step_is_timed(toy, monkeypatch, tmp_path, capsys):
    assert "toy" in apps.timed_tasks()
    seen = []
    monkeypatch.setattr(throughput, "setup", lambda: types.SimpleNamespace(device="cpu"))
    monkeypatch.setattr(throughput, "teardown", lambda info: seen.append("teardown"))
    argv = ["bench", "train", "--tasks", "toy", "--variants", "eager", "--steps", "3"]
    assert cli.main([*argv, "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "train.json").read_text())
    assert [(r["task"], r["samples_per_s"], r["steps"]) for r in report["rows"]] == [
        ("toy", 300.0, 3)
    ]
    assert seen == ["teardown"]
