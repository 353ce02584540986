"""A package others can depend on: ``python -m build`` makes a wheel and an sdist that ``twine
check`` passes, both carrying the kernels' C++ sources and headers, ``py.typed`` and the
license; the version is written in one place."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import multihead

ROOT = Path(__file__).resolve().parents[1]
# what a checkout holds besides the sources: never copied into the build
_NOT_SOURCES = shutil.ignore_patterns(
    ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis",
    "bench-results", "explain-out", "_fused_kernel*", "_rows_kernel*",
)  # fmt: skip


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """The wheel and sdist built from a copy of the checkout (the build writes its egg-info
    beside the sources, so the checkout itself is left alone). The build uses the installed
    setuptools (--no-isolation): no download in the tests."""
    tmp = tmp_path_factory.mktemp("packaging")
    source = tmp / "src"
    shutil.copytree(ROOT, source, ignore=_NOT_SOURCES)
    out = tmp / "dist"
    command = [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(source)]
    # the wheel others depend on carries the kernels' sources, not a build for this CPU
    env = {**os.environ, "MULTIHEAD_BUILD_KERNELS": "0"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


def _kernel_sources() -> list[Path]:
    """The kernels' C++ sources and the headers they include."""
    return sorted(p for p in (ROOT / "multihead").rglob("*") if p.suffix in (".cpp", ".h"))


def _one(folder: Path, pattern: str) -> Path:
    found = sorted(folder.glob(pattern))
    assert len(found) == 1, found
    return found[0]


def test_twine_check_passes(dist):
    files = [str(p) for p in sorted(dist.iterdir())]
    assert len(files) == 2
    done = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", *files],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("PASSED") == 2


def test_the_wheel_carries_the_kernel_source_types_and_license(dist):
    version = multihead.__version__
    wheel = _one(dist, f"multihead-{version}-py3-none-any.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        for cpp in _kernel_sources():
            inside = cpp.relative_to(ROOT).as_posix()
            assert inside in names, inside
            assert zf.read(inside) == cpp.read_bytes()
        assert "multihead/py.typed" in names
        info = f"multihead-{version}.dist-info"
        assert zf.read(f"{info}/licenses/LICENSE") == (ROOT / "LICENSE").read_bytes()
        metadata = zf.read(f"{info}/METADATA").decode()
        entry_points = zf.read(f"{info}/entry_points.txt").decode()
    assert f"\nVersion: {version}\n" in metadata
    assert "\nLicense-Expression: MIT\n" in metadata
    assert "multihead = multihead.cli:main" in entry_points
    assert not any(n.startswith("tests/") for n in names)  # the tests stay out of the wheel


def test_the_sdist_holds_what_builds_and_tests_the_package(dist):
    version = multihead.__version__
    sdist = _one(dist, f"multihead-{version}.tar.gz")
    with tarfile.open(sdist) as tf:
        names = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
    for cpp in _kernel_sources():
        assert cpp.relative_to(ROOT).as_posix() in names
    for path in ("multihead/py.typed", "LICENSE", "README.md", "CHANGELOG.md", "pyproject.toml",
                 "constraints.txt", "tests/conftest.py", "tests/helpers.py", "mkdocs.yml",
                 "docs/design.md", "docs/hooks/cli_reference.py"):  # fmt: skip
        assert path in names, path


def test_the_version_is_written_once():
    """multihead/_version.py holds it; pyproject reads it from there and writes none."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^dynamic = \["version"\]$', pyproject, re.M)
    assert re.search(r'^version = \{ attr = "multihead._version.__version__" \}$', pyproject, re.M)
    assert not re.search(r"^version = \"", pyproject, re.M)
    text = (ROOT / "multihead" / "_version.py").read_text()
    assert re.findall(r'__version__ = "([^"]+)"', text) == [multihead.__version__]
    quoted = re.compile(rf"[\"']{re.escape(multihead.__version__)}[\"']")
    files = sorted((ROOT / "multihead").rglob("*.py"))
    others = [p for p in files if p.name != "_version.py" and quoted.search(p.read_text())]
    assert others == []
