"""`multihead bench kernels --quick` runs end to end and writes a full JSON report and a chart."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from multihead import cli, masks
from multihead.bench import WORKLOADS, kernels
from multihead.bench.chart import chart_figure
from multihead.bench.kernels import SMOKE_TEST, Report, visible_entries


@pytest.mark.slow
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
        if w["mask"] == "documents":  # the fused kernel's goal is against tiled
            expected.add("multihead, tiled")
            assert w["fused_vs_tiled"] > 0
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
                expected |= {"multihead, fused+weights", "multihead, fused+weights, heads=[0]"}
                assert w["fused_weights_overhead"] > 0 and w["fused_heads_ratio"] > 0
            if w["mask"] in ("window", "documents"):  # the same mask as a predicate
                expected.add("multihead, fused, predicate")
                assert w["fused_predicate_ratio"] > 0
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
        if not w["module"]:  # what auto ran, against the fastest way to the same call
            assert w["auto_chose"] in ("sdpa", "fused", "tiled", "flex", "half", "reference")
            same = {
                n: r["median_s"]
                for n, r in w["contenders"].items()
                if kernels.same_call(WORKLOADS[w["name"]][1], n, w["notes"])
            }
            assert w["fastest"] == min(same, key=same.__getitem__)
            assert w["auto_vs_fastest"] == pytest.approx(
                w["contenders"]["multihead"]["median_s"] / same[w["fastest"]]
            )
        else:
            assert "auto_chose" not in w
    assert report["memory"]["peak_rss_mib"] > 0
    png = (tmp_path / "results.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    captured = capsys.readouterr()
    out = captured.out
    assert "matmul peak" in out and "x vs sdpa" in out and "CPU: " in out
    assert "auto within 5% of the fastest way to the same call on " in out
    assert out.count("  auto ran ") == sum(not w["module"] for w in report["workloads"])
    assert report["machine"]["cpu"] and report["peak_gflops"]["float32 blocks"] > 0
    assert report["bf16_case"] in out and report["bf16_case"].startswith("bf16 matmul peak")
    # a smoke test, said before the numbers, in the report and at the end with the time taken
    assert out.startswith(SMOKE_TEST + ".\n") and "not for comparison" in SMOKE_TEST
    assert report["smoke_test"] is True and report["command"] == "multihead bench kernels --quick"
    assert out.rstrip().endswith(
        f"took {report['seconds']:.0f} s (a smoke test: not for comparison)"
    )
    assert (
        captured.err == ""
    )  # no progress bar when stderr is not a terminal (tests/test_progress.py)


def test_visible_entries_counts_exactly():
    assert visible_entries(None, 2, 3, 4, 5) == 2 * 3 * 4 * 5
    assert visible_entries(masks.causal(), 1, 2, 1000, 1000) == 2 * 1000 * 1001 // 2
    lens = torch.tensor([10, 700])
    assert visible_entries(masks.lengths(lens, query_lens=lens), 2, 1, 1000, 1000) == 100 + 700**2


def test_unknown_workload_is_an_error(tmp_path, capsys):
    assert cli.main(["bench", "kernels", "--only", "nope", "--out", str(tmp_path)]) == 2
    assert "unknown workloads ['nope']" in capsys.readouterr().err


def test_bench_options_belong_to_their_sub_command(capsys):
    """Each benchmark's options exist only on its sub-command."""
    with pytest.raises(SystemExit) as stop:
        cli.main(["bench", "kernels", "--sentences", "12"])
    assert stop.value.code == 2
    assert "unrecognized arguments: --sentences 12" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["bench"])
    assert "BENCHMARK" in capsys.readouterr().err


def test_the_chart_legend_covers_no_bar():
    """The legend sat inside the axes, over the first group of bars; it now sits beside them."""
    contenders = {
        name: {"speedup_vs_sdpa": speedup}
        for name, speedup in (("multihead", 3.0), ("multihead, fused", 2.5), ("naive", 0.4))
    }
    contenders["sdpa"] = {"speedup_vs_sdpa": 1.0}
    report = Report(
        machine={"threads": 2, "torch": "2.x"},
        workloads=[
            {"title": f"w{i}", "baseline": "sdpa", "contenders": contenders} for i in range(3)
        ],
        smoke_test=True,
    )
    fig = chart_figure(report)
    fig.canvas.draw()
    ax = fig.axes[0]
    legend = ax.get_legend().get_window_extent()
    bars = [patch.get_window_extent() for patch in ax.patches]
    assert len(bars) == 12
    assert not any(legend.overlaps(bar) for bar in bars)
    assert legend.x0 >= ax.get_window_extent().x1  # beside the axes, not over them
    assert "not for comparison" in ax.get_title()


def test_each_workload_compiles_its_own_flex_attention():
    """Every workload compiles flex_attention anew (its score and mask functions differ); past
    dynamo's recompile limit the later ones ran uncompiled, and the table printed that as
    FlexAttention's time (the soft-capping row: 8.8 s against 0.39 s compiled alone). A limit
    of 1 reaches the point in two compiles."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    from multihead.bench.kernels import _compile_flex

    workload = WORKLOADS["causal_softcap"][1]  # the quick sizes
    q, k, v = (torch.randn(1, 2, 128, 16) for _ in range(3))
    with torch._dynamo.config.patch(recompile_limit=1):
        for cap in (10.0, 20.0):

            def score_mod(score, b, h, i, j, cap=cap):
                return cap * torch.tanh(score / cap)

            with warnings.catch_warnings():
                # the unfused fallback says "called without torch.compile()"
                warnings.simplefilter("error", UserWarning)
                run, _, why = _compile_flex(q, k, v, None, workload, score_mod)
                assert run is not None, why
                run()
    torch._dynamo.reset()  # nothing of these compiles is left for later tests


def test_the_same_call_leaves_out_rows_that_compute_another():
    """Against auto's row only what computes the same call counts: not the rows without the
    modifier or with the weights too, and not SDPA where it ran without the modifier."""
    softcap = WORKLOADS["causal_softcap"][1]
    notes = {"sdpa": "has no softcap: timed without it"}
    assert not kernels.same_call(softcap, "sdpa", notes)
    assert not kernels.same_call(softcap, "multihead, no bias", notes)
    assert kernels.same_call(softcap, "multihead, fused", notes)
    alibi = WORKLOADS["causal_alibi"][1]  # SDPA given the bias as a dense tensor: the same call
    assert kernels.same_call(alibi, "sdpa", {"sdpa": "given the bias as a dense tensor"})
    weights = WORKLOADS["weights_dense"][1]
    assert not kernels.same_call(weights, "multihead+weights", {})
    rows = {"multihead": {"median_s": 2.0}, "sdpa": {"median_s": 1.0}, "naive": {"median_s": 4.0}}
    got = kernels._against_the_fastest(softcap, {**rows, "multihead, fused": {"median_s": 1.6}},
                                       notes, "fused")  # fmt: skip
    assert got == {"auto_chose": "fused", "fastest": "multihead, fused", "auto_vs_fastest": 1.25}


@pytest.mark.parametrize(("rate", "timed_at"), [(1000.0, 2048), (1.0, 793), (1e-6, 256)])
def test_a_slow_dtype_is_timed_at_a_size_that_takes_a_second(monkeypatch, rate, timed_at):
    """A 2048 x 2048 bf16 product takes over half a minute on a CPU with no bf16 kernel (each
    benchmark's peaks took minutes there): the size is chosen from a 256 x 256 probe so that
    one product takes about ``PRODUCT_SECONDS``, never above the size asked for nor below the
    probe's."""
    from multihead.bench import measuring

    sizes = []

    def rate_at(dtype, n, repeats):
        sizes.append((n, repeats))
        return rate

    monkeypatch.setattr(measuring, "_median_rate", rate_at)
    assert measuring.matmul_peak(torch.bfloat16, 2048) == rate
    assert sizes == [(256, 1), (timed_at, 5)]
    # the chosen size's product at the probe's rate: at most the budget (or the probe's size)
    assert 2 * timed_at**3 / (rate * 1e9) <= measuring.PRODUCT_SECONDS or timed_at == 256
