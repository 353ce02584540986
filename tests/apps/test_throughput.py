"""``multihead bench train``: the variants' table, the measured peaks and the JSON report."""

from __future__ import annotations

import json

import pytest

from multihead.apps.throughput import TrainBenchOptions
from multihead.cli import main


def test_bench_train_writes_rows_against_eager(tmp_path, capsys):
    args = ["bench", "train", "--tasks", "forecast", "--variants", "eager", "bf16", "auto",
            "--steps", "3", "--out", str(tmp_path)]  # fmt: skip
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "matmul peaks: bf16 matmul" in printed and "--precision auto (variant auto)" in printed
    report = json.loads((tmp_path / "train.json").read_text())
    assert report["steps"] == 3 and report["cpu"]
    assert report["peaks"]["fp32_matmul_gflops"] > 0 and report["peaks"]["bf16_matmul_gflops"] > 0
    rows = {r["variant"]: r for r in report["rows"]}
    assert set(rows) == {"eager", "bf16", "auto"}
    assert rows["auto"]["precision"] in ("fp32", "bf16")  # what auto resolved to, timed
    assert rows["eager"]["vs_eager"] == 1.0 and rows["eager"]["graph_breaks"] is None
    assert rows["bf16"]["precision"] == "bf16" and rows["bf16"]["steps"] == 3
    ratio = rows["bf16"]["samples_per_s"] / rows["eager"]["samples_per_s"]
    assert rows["bf16"]["vs_eager"] == pytest.approx(ratio, abs=1e-3)
    for variant in ("eager", "bf16", "auto"):
        precision = rows[variant]["precision"]
        assert f"forecast    {variant:<14} {precision:<6}" in printed


def test_bench_train_rejects_unknown_names():
    with pytest.raises(ValueError, match=r"variants must be one or more of eager, compiled, "
                       r"bf16, compiled-bf16, auto. Received: variants=\['fp8'\]"):  # fmt: skip
        TrainBenchOptions(tasks=("forecast",), variants=("fp8",))
    with pytest.raises(ValueError, match=r"tasks must be one or more of sentiment, forecast"):
        TrainBenchOptions(tasks=(), variants=("eager",))
