"""Folders and files replaced whole: a crash (here: an exception or a killed child) leaves the
old or the new content, and temporaries of dead processes are removed by the next write."""

import os
import subprocess
import sys
import textwrap

import pytest

from multihead._atomic import replace_file, replace_folder, stale_temporaries


def _read(folder):
    return {p.name: p.read_text() for p in folder.iterdir()}


def test_folder_is_replaced_whole(tmp_path):
    dest = tmp_path / "model"
    with replace_folder(dest) as tmp:
        (tmp / "a").write_text("old a")
        (tmp / "b").write_text("old b")
    with replace_folder(dest) as tmp:
        (tmp / "a").write_text("new a")
    assert _read(dest) == {"a": "new a"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_an_error_leaves_the_old_folder(tmp_path):
    dest = tmp_path / "model"
    with replace_folder(dest) as tmp:
        (tmp / "a").write_text("old")
    with pytest.raises(RuntimeError, match="boom"), replace_folder(dest) as tmp:
        (tmp / "a").write_text("half")
        raise RuntimeError("boom")
    assert _read(dest) == {"a": "old"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_file_replaced_and_error_keeps_old(tmp_path):
    dest = tmp_path / "x.onnx"
    with replace_file(dest) as tmp:
        tmp.write_text("one")
    with pytest.raises(KeyError), replace_file(dest) as tmp:
        tmp.write_text("two")
        raise KeyError("x")
    assert dest.read_text() == "one"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.onnx"]


def test_missing_parent_and_wrong_kind_are_errors(tmp_path):
    with (
        pytest.raises(FileNotFoundError, match="does not exist"),
        replace_folder(tmp_path / "no" / "model"),
    ):
        pass
    (tmp_path / "f").write_text("")
    with pytest.raises(NotADirectoryError, match="is not a folder"), replace_folder(tmp_path / "f"):
        pass
    with pytest.raises(IsADirectoryError, match="is a folder"), replace_file(tmp_path):
        pass


def test_killed_writer_leaves_old_folder_and_its_temporary_is_cleaned(tmp_path):
    dest = tmp_path / "model"
    with replace_folder(dest) as tmp:
        (tmp / "a").write_text("old")
    child = textwrap.dedent(
        f"""
        import os, signal
        from multihead._atomic import replace_folder
        with replace_folder({str(dest)!r}) as tmp:
            (tmp / "a").write_text("new, half written")
            os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-c", child], env=env, timeout=60)
    assert proc.returncode == -9
    assert _read(dest) == {"a": "old"}
    stale = stale_temporaries(dest)
    assert len(stale) == 1
    with replace_folder(dest) as tmp:
        (tmp / "a").write_text("new")
    assert _read(dest) == {"a": "new"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
