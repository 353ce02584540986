"""`multihead walkthrough` walks through every stage and checks it."""

from __future__ import annotations

from multihead import cli
from multihead.apps import walkthrough


def test_walkthrough_prints_every_stage_and_agrees_with_module():
    lines: list[str] = []
    diff = walkthrough.run(lines.append)
    text = "\n".join(lines)
    assert diff <= 1e-6
    for stage in (
        "projections",
        "split into heads",
        "scores",
        "softmax",
        "concatenate",
        "output projection",
    ):
        assert stage in text, stage
    # the 1..12 toy tensor before and after the view + transpose
    assert "(1, 3, 4) (B, L, E)" in text and "(1, 2, 3, 2) (B, H, L, D)" in text
    assert "[  1.000    2.000]\n    [  5.000    6.000]\n    [  9.000   10.000]" in text


def test_walkthrough_is_deterministic_and_runs_from_the_cli(capsys):
    first: list[str] = []
    walkthrough.run(first.append)
    assert cli.main(["walkthrough"]) == 0
    assert capsys.readouterr().out.splitlines() == "\n".join(first).splitlines()
