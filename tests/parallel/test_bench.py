"""``multihead bench context-parallel``: launches its own processes, measures every mask and
process count, checks the shards against the one-process run, writes JSON and a chart."""

from __future__ import annotations

import json

import pytest

from multihead import cli
from multihead.bench import context
from multihead.bench.context import ContextBenchOptions, ContextConfig, run_context_bench


def test_bench_runs_one_and_two_processes(tmp_path, capsys):
    # a short sequence: the launch, the measurements and the report, not the speed, are tested
    options = ContextBenchOptions(processes=(2, 1), out=tmp_path)
    report = run_context_bench(options, config=ContextConfig(length=1536, heads=2))
    saved = json.loads((tmp_path / "context_parallel.json").read_text())
    assert saved == json.loads(json.dumps(report))
    assert saved["config"]["length"] == 1536 and saved["config"]["heads"] == 2
    assert [(r["mask"], r["processes"]) for r in saved["runs"]] == [
        ("causal", 1),
        ("window", 1),
        ("causal", 2),
        ("window", 2),
    ]
    for run in saved["runs"]:
        p = run["processes"]
        assert len(run["peak_rss_mib"]) == p and min(run["peak_rss_mib"]) > 0
        assert all(a >= 0 for a in run["above_baseline_mib"])
        assert run["seconds"] > 0
        assert run["threads_per_process"] == max(1, saved["machine"]["cores"] // p)
        # causal: rank 1 computes its own shard and rank 0's, rank 0 only its own; 1536
        # positions in two shards of 768 are wider than the window, so the same holds there
        assert run["computed_shards"] == ([1] if p == 1 else [1, 2])
        if p == 2:
            # the fp32 rule (docs/design.md, "Error rules") against the one-process run of the
            # same inputs
            diff = run["max_abs_diff_vs_one_process"]
            assert diff["out"] <= 1e-5 and max(diff["dq"], diff["dk"], diff["dv"]) <= 1e-4
            assert run["time_vs_one_process"] > 0
            assert run["memory_above_baseline_vs_one_process"] is not None
    png = (tmp_path / "context_parallel.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "more processes cannot make a step faster" in out and "P=2" in out


def test_cli_flag_reaches_the_bench(monkeypatch, tmp_path):
    seen = {}

    def job(options: ContextBenchOptions) -> None:
        seen.update(vars(options))

    monkeypatch.setattr(context, "run_context_bench", job)
    argv = ["bench", "context-parallel", "--processes", "1", "4", "--out", str(tmp_path)]
    assert cli.main(argv) == 0
    assert seen == {"quick": False, "processes": (1, 4), "repeats": None, "out": tmp_path}


def test_bench_input_errors(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "context-parallel", "--processes", "0"])
    assert "expected a whole number >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"at least one position.*Received: L=3"):
        options = ContextBenchOptions(processes=(4,), out=tmp_path)
        run_context_bench(options, config=ContextConfig(length=3))
