"""Folders saved in one process open in the next: every class ``multihead.save`` writes is
loaded in a fresh interpreter that ran only ``import multihead`` (a class recorded under its
public name, ``multihead.TransformerEncoderLayer``, was unknown there before the fix)."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fresh_cases import CASES, run

import multihead
import multihead as mh

HERE = Path(__file__).parent


def _import_everything() -> None:
    for info in pkgutil.walk_packages(multihead.__path__, "multihead."):
        importlib.import_module(info.name)


def _fresh(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True, text=True, timeout=300, cwd=HERE,
    )  # fmt: skip


LOAD_ALL = """
import json, sys
import torch
import multihead as mh
from fresh_cases import run
names = json.load(open(sys.argv[1]))
loaded = {}
for i, name in enumerate(names):
    obj = mh.load(f"{sys.argv[2]}/{i}")
    got = mh.io.describe(obj)["class"]
    assert got == name, (got, name)
    torch.manual_seed(0)
    loaded[name] = run(obj, name)
torch.save(loaded, sys.argv[3])
"""


REGISTERED = """
import importlib, json, pkgutil
import multihead
for info in pkgutil.walk_packages(multihead.__path__, "multihead."):
    importlib.import_module(info.name)
print(json.dumps(multihead.io.registered()))
"""


@pytest.mark.slow
def test_every_registered_class_loads_in_a_fresh_process(tmp_path):
    _import_everything()
    # what the library registers, read in a process of its own: this one also holds the
    # classes other test files registered (tests/test_io.py's), whichever ran before
    listed = _fresh(REGISTERED)
    assert listed.returncode == 0, listed.stderr[-3000:]
    names = __import__("json").loads(listed.stdout)
    assert sorted(CASES) == names  # a newly registered class needs a case here
    expected = {}
    for i, name in enumerate(names):
        torch.manual_seed(i)
        obj = CASES[name][0]()
        assert mh.io.describe(obj)["class"] == name
        mh.save(obj, tmp_path / str(i))
        torch.manual_seed(0)
        expected[name] = run(obj, name)
    (tmp_path / "names.json").write_text(__import__("json").dumps(names))
    done = _fresh(LOAD_ALL, str(tmp_path / "names.json"), str(tmp_path), str(tmp_path / "out.pt"))
    assert done.returncode == 0, done.stderr[-3000:]
    got = torch.load(tmp_path / "out.pt")
    for name in names:
        # the same weights; a loaded decoder runs its decoding layout (fused projections), so
        # fp32 sums may round in another order: observed 2e-6 on logits of order 1 to 10
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-5, msg=name)


def test_public_names_load_in_a_fresh_process(tmp_path):
    """The issue's own example, kept quick: a layer and a stack saved here, loaded there."""
    code = "import multihead as mh\nmh.save(mh.TransformerEncoderLayer(32, 4, 64), 'layer')\n"
    code += "layers = [mh.TransformerEncoderLayer(32, 4, 64) for _ in range(2)]\n"
    code += "mh.save(mh.TransformerEncoder(layers), 'stack')"
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    check = "import multihead as mh\nfor f in ('layer', 'stack'): print(type(mh.load(f)).__name__)"
    done = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["TransformerEncoderLayer", "TransformerEncoder"]


def test_an_unknown_class_still_names_the_known_ones(tmp_path):
    mh.save(mh.RMSNorm(8), tmp_path)
    config = tmp_path / "config.json"
    config.write_text(config.read_text().replace("multihead.RMSNorm", "multihead.NoSuchLayer"))
    done = _fresh("import sys, multihead as mh\nmh.load(sys.argv[1])", str(tmp_path))
    assert done.returncode != 0
    assert "names a class that is not registered" in done.stderr
    assert "multihead.TransformerEncoderLayer" in done.stderr  # the known names, imported
    assert "Received: model.class='multihead.NoSuchLayer'" in done.stderr


@pytest.mark.slow
def test_a_saved_stack_exports_from_a_fresh_process(tmp_path):
    """The commands that open a saved folder run in processes of their own: export here."""
    layers = [mh.TransformerEncoderLayer(16, 4, 32) for _ in range(2)]
    mh.save(mh.TransformerEncoder(layers), tmp_path / "stack")
    cli = [
        str(Path(sys.executable).with_name("multihead")),
        "export",
        "onnx",
        "--model",
        str(tmp_path / "stack"),
    ]
    done = subprocess.run([*cli, "--out", str(tmp_path / "stack.onnx")], capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "stack.onnx").stat().st_size > 0
