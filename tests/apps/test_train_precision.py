"""``--precision auto|fp32|bf16``: the choice from measured matmul peaks (injected here, both
ways), the one-line warning for bf16 where it is slower, autocast really on in a bf16 step, and
the choice recorded in metrics.json."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from multihead.apps import precision
from multihead.apps.loop import Dist, TrainConfig, fit
from multihead.cli import main

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
    # faster, but not by enough to pay for autocast's casts
    peaks(100.0, 100.0 * precision.PAYS * 0.99)
    assert precision.choose("auto").precision == "fp32"
    peaks(100.0, 100.0 * precision.PAYS)
    assert precision.choose("auto").precision == "bf16"


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
    peaks(*FAST)
    result, seen = _fit_probe("auto")
    assert seen == [torch.bfloat16] * 3 and result.precision == "bf16"
    peaks(*SLOW)
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
    # the default is auto: here it resolves to fp32, silently, and metrics.json says so
    from multihead.apps import Options
    from multihead.apps.common import finish

    options = Options(out=tmp_path / "auto")
    said = []
    options.resolve_precision(Dist(), say=said.append)
    assert (options.precision, said) == ("fp32", [])
    (tmp_path / "auto").mkdir()
    metrics = finish({}, options, Dist(), 0.0, tmp_path / "auto")
    assert metrics["precision"]["requested"] == "auto"
    assert metrics["precision"]["chosen"] == metrics["options"]["precision"] == "fp32"
