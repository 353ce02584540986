"""Progress bars: drawn on a terminal with the stage each job is at, never in a log or a pipe,
and the job's own lines reach stdout whole either way."""

from __future__ import annotations

import io
import sys

from multihead._progress import stages


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _run(monkeypatch, stream: io.StringIO) -> tuple[str, str]:
    out = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    monkeypatch.setattr(sys, "stdout", out)
    with stages("bench kernels", ["dense_fp32", "causal_fp32"], unit="workload") as (bar, say):
        bar.begin("dense_fp32")
        say("dense fp32: 1.00x vs sdpa")
        bar.begin("causal_fp32")
        say("causal fp32: 1.00x vs sdpa")
    return out.getvalue(), stream.getvalue()


def test_a_terminal_gets_a_bar_naming_the_stage(monkeypatch):
    out, err = _run(monkeypatch, _Terminal())
    assert out == "dense fp32: 1.00x vs sdpa\ncausal fp32: 1.00x vs sdpa\n"
    assert "bench kernels:" in err
    assert "0/2" in err and "dense_fp32" in err and "1/2" in err and "causal_fp32" in err


def test_a_log_gets_no_bar(monkeypatch):
    out, err = _run(monkeypatch, io.StringIO())
    assert out == "dense fp32: 1.00x vs sdpa\ncausal fp32: 1.00x vs sdpa\n"
    assert err == ""


def test_without_tqdm_the_job_runs_and_prints(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm now raises ImportError
    out, err = _run(monkeypatch, _Terminal())
    assert out == "dense fp32: 1.00x vs sdpa\ncausal fp32: 1.00x vs sdpa\n"
    assert err == ""
