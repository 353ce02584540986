"""The run folder of ``multihead train``: a previous run is refused unless --overwrite, the
run is written beside DIR and moved into place whole at the end, and Ctrl-C leaves DIR as it
was with one line on stderr and exit status 130."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from multihead.cli import main

ROOT = Path(__file__).resolve().parents[2]
QUICK = ["train", "crossmodal", "--quick", "--max-steps", "2", "--no-baselines", "--no-progress"]


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def previous(tmp_path_factory):
    """A complete quick run in DIR, as a later run finds it."""
    out = tmp_path_factory.mktemp("runs") / "run"
    assert main([*QUICK, "--out", str(out)]) == 0
    return out


def test_a_previous_run_is_refused_before_any_work(previous, capsys):
    before = _snapshot(previous)
    started = time.perf_counter()
    assert main([*QUICK, "--out", str(previous)]) == 2
    assert time.perf_counter() - started < 5  # refused before data and training
    err = capsys.readouterr().err
    assert "is not empty (a previous run?); pass --overwrite to replace it" in err
    assert "Received: --out" in err and "'metrics.json'" in err
    assert _snapshot(previous) == before


def test_out_that_is_a_file_is_refused(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    assert main([*QUICK, "--out", str(tmp_path / "file" / "run")]) == 2
    assert "--out must be a folder, but" in capsys.readouterr().err


def test_overwrite_replaces_the_run_whole(previous, tmp_path, capsys):
    """A stray file of the previous run does not survive: the new run replaces DIR whole, its
    metrics record DIR (not the temporary folder it was written in), and no temporary is left
    beside it. The run being replaced is said first (before, nothing said it)."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "stray.txt").write_text("from an older run")
    (out / "model").mkdir()
    assert main([*QUICK, "--out", str(out), "--overwrite"]) == 0
    assert capsys.readouterr().err.splitlines()[0] == (
        f"--out {out} holds a previous run (model, stray.txt); --overwrite replaces it whole "
        "when this run ends"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    assert not (out / "stray.txt").exists()
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["options"]["out"] == str(out) and metrics["options"]["overwrite"] is True
    assert (out / "model" / "config.json").is_file() and (out / "attention.png").is_file()


def _signal_after_the_model_is_saved(out: Path, sig: int) -> tuple[int, str]:
    """Start a run over ``out`` in a child process; send ``sig`` once this run's model/ is
    written in its temporary folder (polled every 2 ms, at most 120 s). Returns the exit
    status and stderr."""
    args = [sys.executable, "-m", "multihead.cli", *QUICK, "--out", str(out), "--overwrite"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    # a shell that starts jobs in the background (nohup make test &) has SIGINT ignored, and a
    # Python started with it ignored never installs its Ctrl-C handler: the child starts with
    # the default disposition, as under a terminal
    default = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731
    child = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, preexec_fn=default)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        saved = None
        while saved is None and child.poll() is None and time.monotonic() < deadline:
            found = list(out.parent.glob(f".{out.name}.tmp-*/model/model.safetensors"))
            saved = found[0] if found else None
            time.sleep(0.002)
        assert saved is not None, "the run never saved its model"
        child.send_signal(sig)
        _, err = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    return child.returncode, err


def test_ctrl_c_after_the_model_is_saved_leaves_the_previous_run(previous):
    """SIGINT once this run's model/ is written (the moment that left one run's model beside
    another's metrics.json): exit 130, one line on stderr after the one naming the run
    --overwrite would have replaced, DIR byte for byte the previous run, and the temporary
    folder gone."""
    before = _snapshot(previous)
    code, err = _signal_after_the_model_is_saved(previous, signal.SIGINT)
    assert code == 130, err
    assert err.splitlines() == [
        f"--out {previous} holds a previous run (attention.png, confusion.png, metrics.json, "
        "model, training_curve.png); --overwrite replaces it whole when this run ends",
        "multihead train: interrupted",
    ], err
    assert _snapshot(previous) == before
    assert sorted(p.name for p in previous.parent.iterdir()) == [previous.name]


def test_a_killed_run_leaves_the_previous_one_and_its_temporary_is_removed_next(previous, tmp_path):
    """SIGKILL gives no chance to clean up: DIR is still the previous run, whole, and the
    temporary folder the killed run left is removed by the next run into DIR."""
    out = tmp_path / "run"
    shutil.copytree(previous, out)
    before = _snapshot(out)
    code, _ = _signal_after_the_model_is_saved(out, signal.SIGKILL)
    assert code == -signal.SIGKILL
    assert _snapshot(out) == before
    (left,) = tmp_path.glob(".run.tmp-*")
    assert (left / "model").is_dir()
    assert main([*QUICK, "--out", str(out), "--overwrite", "--seed", "1"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    assert json.loads((out / "metrics.json").read_text())["seed"] == 1
