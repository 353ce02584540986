"""`multihead bench hf` end to end at 1/16 of its lengths (the real run is minutes long)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from multihead import cli
from multihead.bench.hf import (
    FIRST_USE_GOALS,
    GENERATE,
    LINEARS,
    WORKLOADS,
    _first_touches,
)


@pytest.mark.slow
def test_hf_bench_runs_and_reports(tmp_path, capsys):
    args = ["bench", "hf", "--quick", "--repeats", "1", "--out", str(tmp_path)]
    assert cli.main(args) == 0
    report = json.loads((tmp_path / "hf.json").read_text())
    assert report["cpu"] and report["matmul_peak_gflops"]["float32"] > 0
    assert report["bandwidth_gb_s"] > 0 and report["smoke_test"]
    assert [w["name"] for w in report["workloads"]] == [w.name for w in WORKLOADS]
    for workload, spec in zip(report["workloads"], WORKLOADS):
        rows = workload["contenders"]
        # every contender that ran computed the same model: logits within fp32 rounding
        assert "multihead" in rows and spec.baseline in rows
        for name, row in rows.items():
            assert row["max_logit_diff_vs_baseline"] < 1e-4, name
            base = rows[spec.baseline]["median_s"]
            assert abs(row["speedup_vs_" + spec.baseline] - base / row["median_s"]) < 1e-9
        assert set(rows) | set(workload["skipped"]) == set(spec.contenders)
        # --quick leaves FlexAttention's compiles out, and says so
        assert "flex_attention" not in rows
        assert "--quick leaves out" in workload["skipped"]["flex_attention"]
        assert len(workload["goals"]) == len(spec.goals)
    growth = report["capture"]["peak_growth_bytes"]
    assert set(growth) >= {"capture 2 heads of layer 1", "eager output_attentions"}
    assert (tmp_path / "hf.png").stat().st_size > 5_000
    printed = capsys.readouterr().out
    assert "goal multihead >= 5.0x faster than sdpa" in printed and "CPU:" in printed
    acting = report["acting"]
    assert len(acting["goals"]) == 5 and acting["stats_bytes"] > 0
    assert acting["stats_extra_growth_bytes"] is not None
    assert "key statistics' growth of one attention call's peak" in printed
    # generate(): both batch sizes, the same greedy tokens on every contender; the goal is
    # judged on multihead with its few-row linear layers
    generated = report["generate"]
    assert [r["batch"] for r in generated["rows"]] == list(GENERATE.batches)
    for row in generated["rows"]:
        assert set(row["median_s"]) == {"sdpa", "multihead", LINEARS}
        assert all(row["tokens_identical"].values()) and min(row["median_s"].values()) > 0
        want = row["median_s"]["sdpa"] / row["median_s"][LINEARS]
        assert abs(row["speedup_vs_sdpa"][LINEARS] - want) < 1e-12
        assert row["goal"]["figure"] == row["speedup_vs_sdpa"][LINEARS]
    assert "goal multihead >= 1.05x faster than sdpa at B=4, tokens identical" in printed
    # one decoding call of the bridge against the kernel alone, at both batch sizes
    calls = report["decoding_call"]
    assert [r["batch"] for r in calls["rows"]] == [1, 4] and len(calls["goals"]) == 2
    for row, goal in zip(calls["rows"], calls["goals"]):
        us = row["median_us"]
        assert min(us.values()) > 0 and goal["figure"] == us["bridge"] - us["kernel"]
        assert goal["met"] == (goal["figure"] <= 15.0)
    assert "goal the bridge's decoding call <= the kernel + 15 us at B=4" in printed
    # the first-use rows ran in new processes with empty caches
    first = report["first_use"]
    assert [g["text"] for g in first["goals"]] == list(FIRST_USE_GOALS.values())
    assert first["forward"]["first_s"] > 0 and first["capture"]["captured_bytes"] > 0
    assert first["capture"]["first_faults"] > 0 and first["forward"]["second_sys_s"] >= 0
    assert "forward: first call" in printed and " page faults (" in printed
    assert "first use, a new process with an empty cache" in printed


PEAK_GROWTH = """
import json, torch
from multihead.bench.hf import peak_growth
print(json.dumps(peak_growth(lambda: float(torch.ones(64 * 2**20).sum()))))
"""


def test_peak_growth_sees_an_allocation():
    """256 MiB touched, in a process of its own: in this one, whatever the test files before
    it allocated and freed can still be resident and serve the allocation (under make test's
    workers it grew the resident set by one page)."""
    done = subprocess.run(
        [sys.executable, "-c", PEAK_GROWTH], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    growth, result = json.loads(done.stdout)
    assert result == 64 * 2**20
    assert growth is None or growth >= 60 * 2**20


FIRST_TWO = """
import json, torch
from multihead.bench import first_use
touch = lambda: float(torch.ones(64 * 2**20).sum())
print(json.dumps(first_use._first_two(touch, first_use._clock)))
"""


def test_first_use_counts_what_each_call_spent_on_new_memory():
    """The first-use rows report each call's page faults and system seconds: a call that
    writes 256 MiB of new memory (above glibc's mmap threshold: fresh pages on every call)
    takes page faults, in a process of its own (under make test's workers a call in a process
    that earlier test files had run in took none); the line the bench prints divides the
    system time by them."""
    pytest.importorskip("resource")
    done = subprocess.run(
        [sys.executable, "-c", FIRST_TWO], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout)
    assert found["page_bytes"] >= 4096
    for call in ("first", "second"):
        assert found[f"{call}_s"] > 0 and found[f"{call}_sys_s"] >= 0
        assert found[f"{call}_faults"] > 0
    line = _first_touches(
        {
            "page_bytes": 4096,
            "first_faults": 51_200,
            "first_sys_s": 0.8,
            "second_faults": 0,
            "second_sys_s": 0.01,
        }
    )
    assert line == (
        "first call 51200 page faults (200 MiB), 800 ms system time, 15.6 us each; "
        "second call 0 page faults (0 MiB), 10 ms system time"
    )
    assert _first_touches({"first_faults": None, "second_faults": None}) is None
