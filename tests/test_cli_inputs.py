"""Bad command-line input fails at once, before a model loads, with a message to act on."""

from __future__ import annotations

import subprocess
import sys

import pytest

from multihead import cli
from multihead.models import bert


@pytest.fixture
def no_model(monkeypatch):
    """Fail the test if a command reaches the model: the check must come before the work."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(bert, "load", refuse)


def test_explain_out_below_an_existing_file(tmp_path, capsys, no_model):
    blocker = tmp_path / "report.txt"
    blocker.write_text("x")
    assert cli.main(["explain", "a sentence", "--out", str(blocker / "figs")]) == 2
    assert f"but {blocker} is an existing file" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("out", "message"),
    [
        ("{tmp}", "must be a file path ending in .npy, but it is an existing folder"),
        ("{tmp}/vectors", "must end in .npy (the file written is exactly this path)"),
        ("{tmp}/in.txt/e.npy", "is an existing file"),
    ],
    ids=["directory", "no_suffix", "below_file"],
)
def test_embed_out_is_checked_first(tmp_path, capsys, no_model, out, message):
    source = tmp_path / "in.txt"
    source.write_text("one line\n", encoding="utf-8")
    assert cli.main(["embed", str(source), "--out", out.format(tmp=tmp_path)]) == 2
    assert message in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt"]  # nothing written


def test_embed_names_a_file_that_is_not_utf8(tmp_path, capsys, no_model):
    source = tmp_path / "latin1.txt"
    source.write_bytes("first line\ncaf\u00e9 au lait\n".encode("latin-1"))
    assert cli.main(["embed", str(source), "--out", str(tmp_path / "e.npy")]) == 2
    err = capsys.readouterr().err
    assert f"{source} is not UTF-8 text: byte 14 (line 2)" in err
    assert "iconv" in err


def test_explain_rejects_an_argument_that_is_not_utf8(tmp_path):
    # bytes that are not UTF-8 reach Python as surrogate escapes; run a real process so argv
    # is decoded the way the shell delivers it
    code = "import sys; from multihead import cli; sys.exit(cli.main(sys.argv[1:]))"
    result = subprocess.run(
        [sys.executable, "-c", code, "explain", b"caf\xe9", "--out", str(tmp_path)],
        capture_output=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert b"TEXT is not valid UTF-8 text (byte 3 cannot be decoded)" in result.stderr


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_bench_repeats_must_be_positive(capsys, value):
    with pytest.raises(SystemExit) as stop:
        cli.main(["bench", "kernels", "--quick", "--repeats", value])
    assert stop.value.code == 2
    assert "expected a whole number >= 1" in capsys.readouterr().err


def test_bench_sentences_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "embed", "--sentences", "0"])
    assert "expected a whole number >= 1, got 0" in capsys.readouterr().err


def test_bench_out_below_a_file(tmp_path, capsys):
    blocker = tmp_path / "f"
    blocker.write_text("x")
    assert cli.main(["bench", "kernels", "--quick", "--out", str(blocker / "r")]) == 2
    assert "is an existing file" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "context-parallel", "--processes", "0"],
        ["embed", "in.txt", "--out", "e.npy", "--ray", "--workers", "0"],
        ["embed", "in.txt", "--out", "e.npy", "--ray", "--ray-batch-size", "-4"],
        ["train", "forecast", "--out", "o", "--epochs", "0"],
        ["train", "forecast", "--out", "o", "--max-steps", "0"],
    ],
    ids=lambda argv: " ".join(argv[:2] + argv[-2:-1]),
)
def test_impossible_sizes_are_refused_by_argparse(capsys, argv):
    # (bench serve and serve check their sizes themselves: tests/serve, tests/bench)
    with pytest.raises(SystemExit) as stop:
        cli.main(argv)
    assert stop.value.code == 2
    assert "expected a whole number >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("prompt", ["", "   "], ids=["empty", "spaces"])
def test_generate_refuses_an_empty_prompt_before_loading(tmp_path, capsys, prompt):
    """``generate ""`` is refused as ``explain ""`` is, before the folder is opened (an empty
    folder would otherwise be named as the problem)."""
    assert cli.main(["generate", "--model", str(tmp_path), prompt]) == 2
    err = capsys.readouterr().err
    assert err.startswith("multihead generate: error: the prompt is empty; give some text")
    assert f"Received: PROMPT {prompt!r}" in err
