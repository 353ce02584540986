"""The command line tells the user what it does: its version, help with every default, a
sub-command's own usage for a mistyped option, output paths refused before any work, and the
walk-through under its new name."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import walk_parsers

from multihead import _version, cli
from multihead.models import bert

ROOT = Path(__file__).resolve().parents[1]


def _run(*argv: str) -> subprocess.CompletedProcess:
    """The console script's code path in a fresh process, as a user runs it."""
    code = "import sys; from multihead.cli import main; sys.exit(main())"
    return subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120
    )


def _main(capsys, *argv: str) -> tuple[int, str, str]:
    """``cli.main`` in this process: (exit status, stdout, stderr), argparse's exits included."""
    try:
        code = cli.main(list(argv))
    except SystemExit as stop:
        code = stop.code
    out, err = capsys.readouterr()
    return code, out, err


def test_version_is_the_one_in_version_py():
    text = (ROOT / "multihead" / "_version.py").read_text()
    expected = re.search(r'__version__ = "([^"]+)"', text).group(1)
    done = _run("--version")
    assert done.returncode == 0
    assert done.stdout == f"multihead {expected}\n" == f"multihead {_version.__version__}\n"


def test_top_level_help_is_written_for_users(capsys):
    code, out, _ = _main(capsys, "--help")
    assert code == 0
    assert "argument parsing only" not in out
    assert out.splitlines()[2].startswith("multihead: multi-head attention for PyTorch")
    for command in ("explain", "embed", "train", "export", "serve", "bench", "walkthrough"):
        assert re.search(rf"^    {command}\b", out, re.M), command


def test_every_option_with_a_default_shows_it_in_help(capsys):
    checked = 0
    for name, parser in walk_parsers(cli.build_parser()):
        text = " ".join(parser.format_help().split())
        for action in parser._actions:
            default = action.default
            # a switch is off unless given: there is no default value to show
            if not action.option_strings or default is None or action.nargs == 0:
                continue
            if default == argparse.SUPPRESS:
                continue
            shown = " ".join(map(str, default)) if isinstance(default, list) else str(default)
            flag = action.option_strings[-1]
            help_text = " ".join(parser._get_formatter()._get_help_string(action).split())
            assert f"(default: {shown})" in help_text or "(default" in (action.help or ""), (
                name,
                flag,
            )
            assert " ".join(help_text.replace("%%", "%").split()) in text, (name, flag)
            checked += 1
    assert checked >= 25
    serve = _main(capsys, "serve", "--help")[1]
    assert "(default: 8080)" in serve and "(default: 127.0.0.1)" in serve


@pytest.mark.parametrize(
    ("argv", "usage", "hint"),
    [
        (["train", "forecast", "--quik"], "usage: multihead train forecast ", "--quick"),
        (
            ["train", "forecast", "--out", "x", "--sead", "1"],
            "usage: multihead train forecast ",
            "--seed",
        ),
        (["bench", "kernels", "--quik"], "usage: multihead bench kernels ", "--quick"),
        (["explain", "a text", "--layr", "2"], "usage: multihead explain ", "--layer"),
        (
            ["export", "onnx", "--out", "m.onnx", "--opst", "18"],
            "usage: multihead export onnx ",
            "--opset",
        ),
    ],
)
def test_a_mistyped_option_gets_its_commands_usage_and_the_close_match(capsys, argv, usage, hint):
    code, _, err = _main(capsys, *argv)
    assert code == 2
    assert err.startswith(usage), err
    command = usage.removeprefix("usage: ").strip()
    bad = next(a for a in argv if a.startswith("--") and a not in ("--out",))
    assert f"{command}: error: unrecognized arguments: {bad}" in err
    assert f"(did you mean {hint}?)" in err


def test_an_abbreviated_option_still_works(capsys):
    # argparse's unique prefixes are not typos: --qui is --quick, --no-m is --no-measure
    parsed = cli.build_parser().parse_args(["doctor", "--no-m"])
    assert parsed.measure is False


def test_the_walkthrough_has_one_name(capsys):
    code, out, err = _main(capsys, "walkthrough")
    assert code == 0 and err == ""
    assert "the hand computation and the module agree." in out
    code, _, err = _main(capsys, "demo")  # its name before 0.2.0, never released
    assert code == 2 and "invalid choice: 'demo'" in err


@pytest.mark.parametrize("argv", [["--version"], ["--help"], []], ids=["version", "help", "none"])
def test_version_and_help_answer_without_importing_torch(argv):
    """The command's own code path in a fresh process; what it imported is printed last."""
    code = (
        "import sys\n"
        "from multihead.cli import main\n"
        "try:\n    main(sys.argv[1:])\n"
        "except SystemExit:\n    pass\n"
        "print('torch imported:', 'torch' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120
    )
    assert done.stdout.splitlines()[-1] == "torch imported: False", done.stdout + done.stderr
    if argv == ["--help"]:
        assert "walkthrough" in done.stdout and "explain" in done.stdout


def test_a_command_imports_only_its_own_job(capsys):
    """Building the parser for one command reads no other command's job (a missing extra of
    another command never stops this one)."""
    parser = cli.build_parser(["doctor", "--no-measure"])
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert [a.dest for a in commands.choices["doctor"]._actions] == ["help", "measure"]
    assert [a.dest for a in commands.choices["explain"]._actions] == ["help"]


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if a command reaches its work (model loading, export, training)."""

    def refuse(*args, **kwargs):
        raise AssertionError("the work started before the output path was checked")

    import multihead.apps.loop
    import multihead.export.onnx

    monkeypatch.setattr(bert, "load", refuse)
    monkeypatch.setattr(multihead.export.onnx, "load_for_export", refuse)
    monkeypatch.setattr(multihead.apps.loop, "setup", refuse)


def _commands(tmp_path: Path, out: str) -> dict[str, list[str]]:
    source = tmp_path / "in.txt"
    source.write_text("one line\n", encoding="utf-8")
    return {
        "explain": ["explain", "a sentence", "--out", out],
        "embed": ["embed", str(source), "--out", out + ".npy"],
        "export": ["export", "onnx", "--out", out + ".onnx"],
        "train": ["train", "crossmodal", "--quick", "--out", out],
    }


@pytest.mark.parametrize("command", ["explain", "embed", "export", "train"])
def test_a_missing_parent_folder_is_an_error_naming_it(tmp_path, capsys, no_work, command):
    missing = tmp_path / "no" / "such"
    argv = _commands(tmp_path, str(missing / "out"))[command]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"multihead {command}: error: ")
    assert f"the folder {missing} does not exist" in err and "not created" in err
    assert not (tmp_path / "no").exists()  # nothing was created


@pytest.mark.parametrize("where", ["/proc", "/sys"])
@pytest.mark.parametrize("command", ["explain", "embed", "export", "train"])
def test_an_unwritable_location_fails_before_the_work(tmp_path, capsys, no_work, command, where):
    # /proc and /sys refuse new files to every user, root included (mode bits do not stop root)
    argv = _commands(tmp_path, f"{where}/multihead-out")[command]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert re.search(rf"(cannot write in the folder|creating a file in the folder) {where}\b", err)


@pytest.mark.parametrize("command", ["explain", "embed", "export", "train"])
def test_a_read_only_folder_is_judged_by_trying(tmp_path, capsys, no_work, command):
    """A folder without write permission: refused unless this user can write there anyway
    (root can), which the test finds out by creating a file the same way."""
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        try:
            (locked / "probe").write_text("")
        except PermissionError:
            writable = False
        else:
            (locked / "probe").unlink()
            writable = True
        argv = _commands(tmp_path, str(locked / "out"))[command]
        if writable:  # the check passes and the work starts, which no_work reports
            with pytest.raises(AssertionError, match="the work started"):
                cli.main(argv)
        else:
            assert cli.main(argv) == 2
            assert "in the folder" in capsys.readouterr().err
    finally:
        locked.chmod(0o755)
    assert sorted(p.name for p in locked.iterdir()) == []  # no probe left behind


def test_an_existing_empty_folder_is_used_and_nothing_is_left_behind(tmp_path, capsys, no_work):
    out = tmp_path / "figs"
    out.mkdir()
    with pytest.raises(AssertionError, match="the work started"):
        cli.main(["explain", "a sentence", "--out", str(out)])
    assert list(out.iterdir()) == []
    assert os.listdir(tmp_path) == ["figs"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["kv", "--keep", "2.0"],
            r"argument --keep: --keep takes fractions in (0, 1]. "
            r"Received: --keep 2.0",
        ),
        (["kv", "--policies", "foo"], "argument --policies: --policies takes names from snapkv"),
        (["kv", "--budget", "0"], "argument --budget: --budget takes token counts >= 1"),
        (["kv", "--lengths", "10"], "argument --lengths: --lengths must be token counts >= 64"),
    ],
)
def test_a_parsers_own_message_reaches_the_user(capsys, argv, message):
    # argparse turns a type= function's ValueError into "invalid <name> value"
    code, _, err = _main(capsys, *argv)
    assert code == 2
    assert message in err, err
    assert "invalid" not in err


_FRESH = (
    "import sys\n"
    "from multihead.cli import main\n"
    "code = main(sys.argv[1:])\n"
    "print('exit', code, 'torch imported:', 'torch' in sys.modules)"
)


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--model", "{gguf}", "hi"],
        ["kv", "--model", "{gguf}"],
        ["heads", "--model", "{gguf}", "hi"],
        ["explain", "--model={gguf}", "hi"],
        ["bench", "decode", "--model", "{gguf}"],
        ["cache", "list"],
    ],
    ids=["generate", "kv", "heads", "explain", "bench-decode", "cache"],
)
def test_a_missing_gguf_is_named_before_torch_is_imported(argv, tmp_path):
    gguf = tmp_path / "absent.gguf"
    argv = [a.format(gguf=gguf) for a in argv]
    env = {**os.environ, "MULTIHEAD_MODELS_DIR": str(tmp_path / "models")}
    done = subprocess.run([sys.executable, "-c", _FRESH, *argv], capture_output=True,
                          text=True, timeout=120, env=env)  # fmt: skip
    last = done.stdout.splitlines()[-1]
    if argv[0] == "cache":
        assert last == "exit 0 torch imported: False", done.stdout + done.stderr
        assert f"no converted models in {tmp_path / 'models'}" in done.stdout
        return
    assert last == "exit 2 torch imported: False", done.stdout + done.stderr
    assert f"error: the GGUF file {gguf} does not exist" in done.stderr


def test_generate_help_and_the_examples_follow_the_commands(capsys):
    _, out, _ = _main(capsys, "generate", "--help")
    assert "GPT-2/Llama model folder" not in out and "'smollm2'" in out and "'-'" in out
    _, out, _ = _main(capsys, "--help")
    for command in ("generate --model smollm2", "multihead heads", "multihead kv --model"):
        assert command in out, command
