"""`multihead bench decode` end to end on a tiny model (the real run is GPT-2 small)."""

from __future__ import annotations

import json

from multihead import cli


def test_decode_bench_runs_and_reports(tmp_path, capsys):
    args = ["bench", "decode", "--quick", "--repeats", "1", "--out", str(tmp_path)]
    assert cli.main(args) == 0
    report = json.loads((tmp_path / "decode.json").read_text())
    assert report["shape"]["layers"] == 2 and report["bandwidth_gb_s"] > 0
    assert [r["batch"] for r in report["results"]] == [1, 8]
    assert report["cpu"] and report["matmul_peak_gflops"]["float32"] > 0
    for name in ("B=1", "B=8"):  # one layer's attention call over a 1,024-token cache
        call = report["attention_call"][name]
        assert call["sdpa_us"] > 0 and call["multihead_us"] > 0
        assert call["above_sdpa_us"] == call["multihead_us"] - call["sdpa_us"]
    fp32, hf = "multihead fp32", "transformers generate (dynamic cache)"
    for row in report["results"]:
        assert set(row["tokens_per_s"]) >= {fp32, "multihead bf16 weights",
                                            "multihead int8 weights", hf}  # fmt: skip
        for name, same in row["identical_tokens"].items():
            assert same, name  # the same weights give the same greedy tokens
        for name, rate in row["tokens_per_s"].items():
            assert abs(row["vs_transformers"][name] - rate / row["tokens_per_s"][hf]) < 1e-9
            want = row["bytes_read_per_token"][name] * rate / 1e9
            assert abs(row["gb_per_s"][name] - want) < 1e-9
        tokens = row["batch"] * report["shape"]["new_tokens"]
        assert abs(row["tokens_per_s"][fp32] - tokens / row["median_s"][fp32]) < 1e-6
        # every weight once per step for the whole batch, plus each row's cache; int8 reads
        # a quarter of fp32's weight bytes (plus one float32 scale per output channel)
        weights = report["weight_bytes"]
        assert row["bytes_read_per_token"][fp32] > weights[fp32] / row["batch"]
        assert weights["multihead int8 weights"] < 0.3 * weights[fp32]
        assert weights["multihead bf16 weights"] == weights[fp32] // 2
    assert (tmp_path / "decode.png").stat().st_size > 5_000
    assert "tokens/s" in capsys.readouterr().out
