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
    for row in report["results"]:
        ours = row["median_s"]["multihead generate"]
        for name, same in row["identical_tokens"].items():
            assert same, name  # the same weights give the same greedy tokens
            assert abs(row["speedup_vs"][name] - row["median_s"][name] / ours) < 1e-9
        tokens = row["batch"] * report["shape"]["new_tokens"]
        assert abs(row["tokens_per_s"]["multihead generate"] - tokens / ours) < 1e-6
        # every weight once per step for the whole batch, plus each row's cache
        assert row["bytes_read_per_token"] > report["weight_bytes"] / row["batch"]
    assert (tmp_path / "decode.png").stat().st_size > 5_000
    assert "tokens/s" in capsys.readouterr().out
