"""`multihead bench kernels --quick` runs end to end and writes a full JSON report and a chart."""

from __future__ import annotations

import json

import pytest
import torch

from multihead import cli, masks
from multihead.bench import WORKLOADS
from multihead.bench.suite import visible_entries


def test_quick_bench_writes_json_for_every_contender(tmp_path, capsys):
    assert cli.main(["bench", "kernels", "--quick", "--repeats", "1", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "results.json").read_text())
    assert report["peak_gflops"]["float32"] > 0 and report["peak_gflops"]["bfloat16"] > 0
    assert [w["name"] for w in report["workloads"]] == list(WORKLOADS)
    for w in report["workloads"]:
        base = w["baseline"]
        expected = {"multihead", base}
        if w["bias"] != "none":  # the same call without bias; SDPA given the dense bias
            expected.add("multihead, no bias")
            assert w["bias_overhead"] > 0
            assert w["notes"]["naive"].startswith("skipped")
        elif not w["module"]:
            expected |= {"naive"}
        if not w["module"]:
            assert w["notes"]["flex"].startswith("skipped in --quick")
        if w["weights"]:
            expected.add("multihead+weights")
            assert w["weights_overhead"] > 0
        if not w["module"]:  # the fused kernel by name, with the same companions
            expected.add("multihead, fused")
            if w["bias"] != "none":
                expected.add("multihead, fused, no bias")
                assert w["fused_bias_overhead"] > 0
            if w["weights"]:
                expected.add("multihead, fused+weights")
                assert w["fused_weights_overhead"] > 0
        assert set(w["contenders"]) == expected, w["name"]
        for name, row in w["contenders"].items():
            assert row["median_s"] > 0 and len(row["times_s"]) == 1, (w["name"], name)
            assert row["speedup_vs_" + base] == pytest.approx(
                w["contenders"][base]["median_s"] / row["median_s"]
            )
            if not w["module"]:
                assert (
                    0
                    < row["fraction_of_peak"]
                    == pytest.approx(row["gflops"] / report["peak_gflops"][w["dtype"]])
                )
    assert report["memory"]["peak_rss_mib"] > 0
    png = (tmp_path / "results.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    out = capsys.readouterr().out
    assert "matmul peak" in out and "x vs sdpa" in out
    assert report["bf16_case"] in out and report["bf16_case"].startswith("bf16 matmul peak")


def test_visible_entries_counts_exactly():
    assert visible_entries(None, 2, 3, 4, 5) == 2 * 3 * 4 * 5
    assert visible_entries(masks.causal(), 1, 2, 1000, 1000) == 2 * 1000 * 1001 // 2
    lens = torch.tensor([10, 700])
    assert visible_entries(masks.lengths(lens, query_lens=lens), 2, 1, 1000, 1000) == 100 + 700**2


def test_unknown_workload_is_an_error(tmp_path, capsys):
    assert cli.main(["bench", "kernels", "--only", "nope", "--out", str(tmp_path)]) == 2
    assert "unknown workloads ['nope']" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "use"),
    [
        (["bench", "--embed", "--sentences", "12"], "'multihead bench embed --sentences 12'"),
        (["bench", "--decode", "--quick"], "'multihead bench decode --quick'"),
        (["bench", "--serve"], "'multihead bench serve'"),
        (["bench", "--context-parallel"], "'multihead bench context-parallel'"),
        (["bench", "--quick"], "'multihead bench kernels --quick'"),
    ],
)
def test_old_bench_flags_name_the_sub_command(capsys, argv, use):
    """The pre-0.2.0 flags are refused with the sub-command that replaced them."""
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"use {use}" in err
    assert f"Received: {' '.join(argv)}" in err


def test_two_old_bench_flags_are_refused_not_half_run(capsys):
    """`--decode --serve` once silently ran only the decode benchmark."""
    assert cli.main(["bench", "--decode", "--serve"]) == 2
    err = capsys.readouterr().err
    assert "'multihead bench decode' and 'multihead bench serve' as separate runs" in err


def test_bench_options_belong_to_their_sub_command(capsys):
    """Each benchmark's options exist only on its sub-command."""
    with pytest.raises(SystemExit) as stop:
        cli.main(["bench", "kernels", "--sentences", "12"])
    assert stop.value.code == 2
    assert "unrecognized arguments: --sentences 12" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["bench"])
    assert "BENCHMARK" in capsys.readouterr().err
