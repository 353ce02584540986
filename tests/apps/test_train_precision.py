"""``--precision auto|fp32|bf16``: the choice from measured matmul peaks and timed training
steps (injected here, both ways), the step timer that leaves the model as it was, rank 0's
choice shared under torchrun, the one-line warning for bf16 where it is slower, autocast really
on in a bf16 step, and the choice recorded in metrics.json."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from multihead.apps import precision
from multihead.apps.loop import Dist, TrainConfig, _step_timer, fit
from multihead.cli import main

ROOT = Path(__file__).resolve().parents[2]

FAST = (100.0, 250.0)  # (fp32, bf16) GFLOP/s: a CPU with AMX, a GPU
SLOW = (250.0, 150.0)  # an AVX512-BF16 Xeon without AMX (issue 19's machine): 0.6x


@pytest.fixture
def peaks(monkeypatch):
    """Set the measured rates: ``peaks(fp32, bf16)``; counts the measurements."""
    calls = []

    def inject(fp32: float, bf16: float) -> list:
        precision._measured.clear()

        def rates(device, n):
            calls.append((str(device), n))
            return fp32, bf16

        monkeypatch.setattr(precision, "_rates", rates)
        return calls

    yield inject
    precision._measured.clear()


def test_auto_picks_bf16_only_where_it_measures_faster(peaks):
    calls = peaks(*FAST)
    choice = precision.choose("auto")
    assert (choice.requested, choice.precision) == ("auto", "bf16")
    assert choice.peaks.ratio == 2.5 and "bf16 pays" in choice.reason
    assert precision.choose("auto") == choice
    assert calls == [("cpu", 512)]  # measured once for the process
    peaks(*SLOW)
    choice = precision.choose("auto")
    assert choice.precision == "fp32" and "does not pay" in choice.reason
    # where bf16 matmuls are slower, no step is timed
    assert precision.choose("auto", time_step=lambda p: pytest.fail("timed")).precision == "fp32"
    # faster, but not by enough to pay for autocast's casts
    peaks(100.0, 100.0 * precision.PAYS * 0.99)
    assert precision.choose("auto").precision == "fp32"
    peaks(100.0, 100.0 * precision.PAYS)
    assert precision.choose("auto").precision == "bf16"


@pytest.fixture
def steps(monkeypatch):
    """Set the timed step's seconds: ``steps(fp32=..., bf16=...)``; returns the precisions
    in the order they were timed."""
    order = []

    def inject(**seconds: float) -> list[str]:
        order.clear()

        def time_step(name: str) -> float:
            order.append(name)
            return seconds[name]

        return time_step, order

    return inject


def test_auto_times_the_step_where_bf16_matmuls_are_faster(peaks, steps):
    """Faster bf16 matmuls are not enough: the model's own step decides (medians of 3 timed
    runs of each, interleaved, after one warm-up of each), and bf16 must win by STEP_PAYS."""
    peaks(*FAST)
    time_step, order = steps(fp32=0.020, bf16=0.010)
    choice = precision.choose("auto", time_step=time_step)
    assert choice.precision == "bf16" and choice.step_seconds == {"fp32": 0.020, "bf16": 0.010}
    assert order == ["fp32", "bf16"] * 4
    assert "training step 10.0 ms in bf16 against 20.0 ms in fp32 (2.00x" in choice.reason
    assert choice.as_json()["step_seconds"] == {"fp32": 0.02, "bf16": 0.01}
    # a small model whose step autocast makes slower, or faster by less than STEP_PAYS
    time_step, _ = steps(fp32=0.010, bf16=0.014)
    assert precision.choose("auto", time_step=time_step).precision == "fp32"
    time_step, _ = steps(fp32=0.010, bf16=0.010 / (precision.STEP_PAYS * 0.99))
    choice = precision.choose("auto", time_step=time_step)
    assert choice.precision == "fp32" and "does not pay" in choice.reason


class _Noisy(nn.Module):
    """Dropout (random state), batch norm (buffers) and a matmul whose dtype is recorded."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(6, 6)
        self.norm = nn.BatchNorm1d(6)
        self.drop = nn.Dropout(0.5)
        self.seen: list[torch.dtype] = []

    def forward(self, x):
        y = self.linear(x)
        self.seen.append(y.dtype)
        return self.drop(self.norm(y.float())).sum(-1)


def test_the_step_timer_leaves_no_trace():
    """Timing a step runs forward and backward under the precision's autocast, then puts back
    everything the step touched: no gradients, the same parameters, buffers and random
    state, so a run with auto trains exactly as the chosen precision would alone."""
    torch.manual_seed(0)
    model, x = _Noisy(), torch.randn(8, 6)
    params = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    once = _step_timer(model, x, lambda m, b: m(b), torch.device("cpu"))
    assert once("bf16") > 0 and once("fp32") > 0
    assert model.seen == [torch.bfloat16, torch.float32]
    assert all(p.grad is None for p in model.parameters())
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in params.items())  # running stats too
    assert torch.equal(torch.get_rng_state(), rng)


def test_auto_in_fit_times_the_first_batch_which_the_first_step_then_takes(peaks, monkeypatch):
    peaks(*FAST)
    monkeypatch.setattr(precision, "_time_steps", lambda fn: {"fp32": 0.02, "bf16": 0.01})
    torch.manual_seed(0)
    x, y = torch.randn(24, 6), torch.randn(24)
    collated = []

    def collate(i):
        collated.append(i)
        return x[i], y[i]

    cfg = TrainConfig(epochs=1, batch_size=8, precision="auto", progress=False)
    result = fit(_Probe(), 24, collate, lambda m, b: (m(b[0]).float() - b[1]).pow(2), cfg,
                 Dist())  # fmt: skip
    assert result.precision == "bf16" and result.precision_choice.step_seconds["bf16"] == 0.01
    assert len(collated) == result.steps == 3  # the probe's batch is not collated twice
    assert result.summary()["precision"] == "bf16"


def test_under_torchrun_rank_0_decides_for_every_process(tmp_path):
    """Two processes (gloo): rank 0 times its step (made up: bf16 twice as fast) and every
    process trains under its choice; the other rank never times (it would fail if it did)."""
    script = tmp_path / "auto.py"
    script.write_text(
        textwrap.dedent("""
        import json, pathlib, sys, torch
        from multihead.apps import precision
        from multihead.apps.loop import TrainConfig, fit, setup, teardown
        info = setup()
        precision._rates = lambda device, n: (100.0, 250.0)
        def timed(fn):
            assert info.rank == 0, "only rank 0 times the step"
            return {"fp32": 0.02, "bf16": 0.01}
        precision._time_steps = timed
        torch.manual_seed(0)
        x, y = torch.randn(16, 6), torch.randn(16)
        model = torch.nn.Linear(6, 1)
        cfg = TrainConfig(epochs=1, batch_size=8, precision="auto", progress=False)
        r = fit(model, 16, lambda i: (x[i], y[i]),
                lambda m, b: (m(b[0])[:, 0].float() - b[1]).pow(2), cfg, info)
        out = pathlib.Path(sys.argv[1]) / f"rank{info.rank}.json"
        out.write_text(json.dumps({"rank": info.rank, "precision": r.precision}))
        teardown(info)
    """)
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(script), str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    # one file per rank: two processes printing at once can interleave their lines
    rows = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert rows == [{"rank": 0, "precision": "bf16"}, {"rank": 1, "precision": "bf16"}]


def test_bf16_where_slower_says_by_how_much_in_one_line(peaks):
    peaks(*SLOW)
    lines = []
    choice = precision.choose("bf16", say=lines.append)
    assert choice.precision == "bf16"  # kept as asked
    assert len(lines) == 1 and "\n" not in lines[0]
    assert "bf16 matmuls are 1.67x slower than fp32" in lines[0]  # 250 / 150
    assert "bf16 matmul 150 GFLOP/s against fp32 250 GFLOP/s" in lines[0]
    peaks(*FAST)
    lines.clear()
    assert precision.choose("bf16", say=lines.append).precision == "bf16"
    assert lines == []


def test_fp32_and_fp16_are_kept_without_measuring(peaks):
    calls = peaks(*FAST)
    assert precision.choose("fp32").precision == "fp32"
    assert precision.choose("fp16", "cuda").precision == "fp16"
    assert calls == []
    with pytest.raises(ValueError, match=r"precision must be one of auto, fp32, bf16, fp16. "
                       r"Received: precision='int8'"):  # fmt: skip
        precision.choose("int8")


def test_the_measurement_is_a_real_rate():
    precision._measured.clear()
    try:
        p = precision.matmul_peaks("cpu")
        assert p.fp32_gflops > 0.1 and p.bf16_gflops > 0.01 and p.size == 512
        assert precision.matmul_peaks(torch.device("cpu")) is p
    finally:
        precision._measured.clear()


class _Probe(nn.Module):
    """A linear model that records the dtype its matmul computes in."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(6, 1) * 0.1)
        self.seen: list[torch.dtype] = []

    def forward(self, x):
        y = x @ self.weight
        self.seen.append(y.dtype)
        return y[:, 0]


def _fit_probe(precision_name: str):
    torch.manual_seed(0)
    x, y = torch.randn(24, 6), torch.randn(24)
    model = _Probe()
    cfg = TrainConfig(epochs=1, batch_size=8, precision=precision_name, progress=False)
    result = fit(model, 24, lambda i: (x[i], y[i]),
                 lambda m, b: (m(b[0]).float() - b[1]).pow(2), cfg, Dist())  # fmt: skip
    return result, model.seen


def test_a_bf16_step_runs_under_autocast(peaks):
    result, seen = _fit_probe("bf16")
    assert seen == [torch.bfloat16] * 3 and result.precision == "bf16"
    result, seen = _fit_probe("fp32")
    assert seen == [torch.float32] * 3 and result.precision == "fp32"
    assert result.summary()["precision"] == "fp32"
    peaks(*SLOW)  # auto: bf16 matmuls slower, so fp32 without timing a step
    result, seen = _fit_probe("auto")
    assert seen == [torch.float32] * 3 and result.precision == "fp32"


def test_train_records_the_choice_and_warns_once(peaks, tmp_path, capsys):
    peaks(*SLOW)
    out = tmp_path / "run"
    args = ["train", "crossmodal", "--quick", "--max-steps", "2", "--no-baselines",
            "--no-progress", "--precision", "bf16", "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    lines = [x for x in capsys.readouterr().err.splitlines() if "--precision bf16" in x]
    assert len(lines) == 1 and "1.67x slower" in lines[0]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["precision"] == {
        "requested": "bf16",
        "chosen": "bf16",
        "reason": metrics["precision"]["reason"],
        "fp32_matmul_gflops": 250.0,
        "bf16_matmul_gflops": 150.0,
        "bf16_over_fp32": 0.6,
        "matmul_size": 512,
    }
    assert metrics["training"]["model"]["precision"] == "bf16"
    # the default is auto, resolved by the run's first training: here fp32, silently (bf16
    # matmuls are slower), and metrics.json says so
    capsys.readouterr()
    args = args[:-4] + ["--out", str(tmp_path / "auto")]
    assert main(args) == 0
    assert "--precision" not in capsys.readouterr().err
    metrics = json.loads((tmp_path / "auto" / "metrics.json").read_text())
    assert metrics["precision"]["requested"] == "auto"
    assert metrics["precision"]["chosen"] == metrics["options"]["precision"] == "fp32"
    assert metrics["training"]["model"]["precision"] == "fp32"


def test_a_run_takes_the_choice_of_its_first_training(peaks, monkeypatch, tmp_path):
    """Where bf16 pays for the main model's step (timings made up), the whole run trains and
    evaluates in bf16 (later trainings reuse the choice) and metrics.json keeps the timings."""
    peaks(*FAST)
    timed = []
    monkeypatch.setattr(precision, "_time_steps",
                        lambda fn: timed.append(fn) or {"fp32": 0.02, "bf16": 0.01})  # fmt: skip
    out = tmp_path / "run"
    assert main(["train", "crossmodal", "--quick", "--max-steps", "2", "--no-progress",
                 "--out", str(out)]) == 0  # fmt: skip
    metrics = json.loads((out / "metrics.json").read_text())
    assert len(timed) == 1  # the main model's step; the baselines reuse the choice
    assert metrics["precision"]["chosen"] == "bf16"
    assert metrics["precision"]["step_seconds"] == {"fp32": 0.02, "bf16": 0.01}
    assert {row["precision"] for row in metrics["training"].values()} == {"bf16"}
