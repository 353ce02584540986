"""`multihead bench serve` end to end, small: both servers as processes on 127.0.0.1."""

from __future__ import annotations

import json

import pytest

from multihead import cli


@pytest.mark.slow
def test_serve_bench_runs_both_servers_and_agrees(tmp_path, capsys):
    args = ["bench", "serve", "--requests", "16", "--clients", "1", "8", "32"]
    args += ["--threads", "1", "--out", str(tmp_path)]
    assert cli.main(args) == 0
    report = json.loads((tmp_path / "serve.json").read_text())
    assert report["ok"] and report["errors"] == 0
    # both servers run all-MiniLM-L6-v2 in fp32: each text's vector within 1e-5
    assert report["max_abs_diff"] <= 1e-5
    for rows in report["results"].values():
        assert [r["clients"] for r in rows] == [1, 8, 32]
        assert all(r["answered"] == 16 and r["errors"] == 0 for r in rows)
        assert all(0 < r["p50_ms"] <= r["p99_ms"] for r in rows)
        assert all(r["requests_per_s"] > 0 for r in rows)
        assert all(r["server_cpu_ms_per_request"] > 0 for r in rows)  # read from /proc
    ours, theirs = (
        report["results"][k] for k in ("multihead serve", "FastAPI + sentence-transformers encode")
    )
    for level, (a, b) in zip(["1", "8", "32"], zip(ours, theirs)):
        assert abs(report["speedup"][level] - a["requests_per_s"] / b["requests_per_s"]) < 1e-9
    assert (tmp_path / "serve.png").stat().st_size > 10_000
    assert "the baseline's throughput" in capsys.readouterr().out


def test_serve_bench_bad_arguments(capsys):
    assert cli.main(["bench", "serve", "--clients", "0"]) == 2
    assert "clients must be positive ints. Received: clients=[0]" in capsys.readouterr().err
    assert cli.main(["bench", "serve", "--threads", "0"]) == 2
    assert "threads must be a positive int. Received: threads=0" in capsys.readouterr().err
    assert cli.main(["bench", "serve", "--requests", "0"]) == 2
    assert "requests must be a positive int" in capsys.readouterr().err
