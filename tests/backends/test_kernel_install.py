"""The kernels from the install: the package build compiles them (setup.py) into the package,
a new process of any user loads them with an empty cache, a machine without a compiler still
installs, and both kernels are built by one builder with one set of flags."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import multihead as mh
from multihead.backends import fused, registry
from multihead.kernels import build
from multihead.modules import few_rows

ROOT = Path(__file__).resolve().parents[2]

_FIRST_USE = textwrap.dedent(
    """
    import json, sys, torch
    import multihead as mh
    from multihead import masks
    from multihead.backends import fused
    from multihead.modules import few_rows

    q, k, v = (torch.randn(1, 4, 600, 32) for _ in range(3))
    out = mh.attention(q, k, v, masks.causal(), backend="fused")
    print(json.dumps({
        "built": fused.built(),
        "origin": fused.origin(),
        "rows": few_rows.kernel_error(),
        "finite": bool(torch.isfinite(out).all()),
    }))
    """
)


def _fresh_env(tmp_path: Path) -> dict[str, str]:
    """A new user's environment: an empty home and cache, no extension folder set."""
    env = {k: v for k, v in os.environ.items() if k != "MULTIHEAD_EXTENSION_DIR"}
    home = tmp_path / "home"
    home.mkdir()
    env.update(HOME=str(home), XDG_CACHE_HOME=str(home / ".cache"), MULTIHEAD_FUSED_AUTO="1")
    return env


def test_a_new_user_runs_the_package_builds_kernels_with_an_empty_cache(tmp_path):
    """What the README's install leaves: both kernels inside the package, loaded by a new
    process whose user has never built anything (nothing is compiled, the cache stays
    empty). Fails when the installation was made without the package build (reinstall with
    `make install-test`, or after editing a kernel's source)."""
    env = _fresh_env(tmp_path)
    done = subprocess.run(
        [sys.executable, "-c", _FIRST_USE], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["built"] and found["finite"], found
    assert found["origin"].startswith("the package build"), found
    assert found["rows"] is None
    assert "building" not in done.stderr  # nothing compiled
    assert not (tmp_path / "home" / ".cache" / "multihead").exists()


def test_a_record_for_another_torch_leaves_the_packaged_kernel_unused(monkeypatch):
    wanted = build.record(build.FUSED)
    monkeypatch.setattr(build, "record", lambda kernel: {**wanted, "torch": "0.0"})
    module, why = build.packaged(build.FUSED)
    assert module is None
    assert why in (
        "it was built for another torch than this process has",
        "the package was installed without it",
    )


def test_missing_kernel_is_said_once_per_process_in_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("MULTIHEAD_EXTENSION_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("MULTIHEAD_FUSED_AUTO", "1")
    missing = "the package was installed without it"
    monkeypatch.setattr(build, "packaged", lambda kernel: (None, missing))
    monkeypatch.setattr(fused._LOADER, "module", None)
    monkeypatch.setattr(fused._LOADER, "error", None)
    monkeypatch.setattr(fused, "_looked", False)
    monkeypatch.setattr(fused, "_told", False)
    monkeypatch.setattr(registry, "_CHOICES", {})
    q, k, v = (torch.randn(1, 2, 40, 8) for _ in range(3))
    mh.attention(q, k, v)
    mh.attention(q, k, v)
    monkeypatch.setattr(fused, "_looked", False)  # asked again later in the process
    mh.attention(q, k, v)
    lines = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(lines) == 1, lines
    assert lines[0].startswith("multihead: the fused C++ kernel is not available (the package")
    assert "multihead doctor" in lines[0]


def test_both_kernels_are_built_by_one_builder_with_one_set_of_flags(monkeypatch, tmp_path):
    monkeypatch.setenv("MULTIHEAD_EXTENSION_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(build, "packaged", lambda kernel: (None, "not in this test"))
    calls = []

    def fake_load(name, sources, folder, *, cflags, ldflags):
        calls.append((name, list(cflags), list(ldflags)))
        return object()

    monkeypatch.setattr(build, "load", fake_load)
    for loader in (fused._LOADER, few_rows._LOADER):
        monkeypatch.setattr(loader, "module", None)
        monkeypatch.setattr(loader, "error", None)
    assert fused.build_error() is None and few_rows.kernel_error() is None
    assert [c[0].rsplit("_", 1)[0] for c in calls] == ["multihead_fused", "multihead_rows"]
    assert calls[0][1:] == calls[1][1:] == (build.cflags(), build.ldflags())


def test_a_build_covers_every_header_its_source_includes():
    """Every header goes into a build's digest and record (a header left out would let an
    edited header reuse an old build): the fused kernel's rooms, the SIMD header both kernels
    share, and the decoding step the rows kernel includes."""
    csrc = build.PACKAGE / "kernels" / "csrc"
    headers = set(csrc.rglob("*.h"))
    assert headers == (set(build.FUSED.files) | set(build.ROWS.files)) - {
        build.FUSED.source_path,
        build.ROWS.source_path,
    }
    assert build.FUSED.files[0] == build.FUSED.source_path
    # the rows kernel: the shared SIMD header, and the decoding step built over its products
    assert build.ROWS.files == [build.ROWS.source_path, csrc / "simd.h", csrc / "decoding_native.h"]


def test_an_edited_header_names_a_new_build(monkeypatch, tmp_path):
    """Quoted includes are followed through the headers, relative to each including file;
    editing one changes the cache's build name and the package build's record."""
    package = tmp_path.resolve()
    monkeypatch.setattr(build, "PACKAGE", package)
    (package / "rooms").mkdir()
    (package / "kernel.cpp").write_text('#include <vector>\n#include "rooms/a.h"\n')
    (package / "rooms" / "a.h").write_text('#pragma once\n#include "../b.h"\n')
    (package / "b.h").write_text("int f() { return 1; }\n")
    kernel = build.Kernel("a kernel", "multihead_x", "multihead.x", "kernel.cpp", "X")
    assert [p.relative_to(package).as_posix() for p in kernel.files] == [
        "kernel.cpp",
        "rooms/a.h",
        "b.h",
    ]
    name, digest = build.cached_name(kernel), build.record(kernel)["source_sha256"]
    (package / "b.h").write_text("int f() { return 2; }\n")
    assert build.cached_name(kernel) != name
    assert build.record(kernel)["source_sha256"] != digest


def _setup_build(
    tmp_path: Path, env: dict[str, str], prelude: str = ""
) -> subprocess.CompletedProcess:
    """setup.py's build_ext into tmp_path (the checkout is left alone)."""
    code = (
        f"{prelude}\nimport runpy, sys\n"
        f"sys.argv = ['setup.py', 'build_ext', '-b', {str(tmp_path / 'lib')!r}, "
        f"'-t', {str(tmp_path / 'tmp')!r}]\n"
        f"runpy.run_path('setup.py', run_name='__main__')\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env,
        timeout=300,
    )  # fmt: skip


@pytest.mark.parametrize(
    "case",
    ["no compiler", "no torch where the package is built", "switched off"],
)
def test_the_package_installs_without_its_kernels_and_says_why(case, tmp_path):
    env = dict(os.environ)
    prelude = ""
    if case == "no compiler":
        env["CXX"] = "/nonexistent/c++"
        said = "the C++ kernels are not compiled: no C++ compiler '/nonexistent/c++' found"
    elif case == "switched off":
        env["MULTIHEAD_BUILD_KERNELS"] = "0"
        said = "MULTIHEAD_BUILD_KERNELS=0"
    else:
        prelude = "import sys; sys.modules['torch'] = None"
        said = "torch is not importable where the package is built"
    done = _setup_build(tmp_path, env, prelude)
    assert done.returncode == 0, done.stderr[-3000:]
    assert said in done.stderr
    assert not list(tmp_path.rglob("*.so"))


def test_the_first_call_imports_neither_dynamo_nor_onnx():
    """The first attention call of a process imported torch._dynamo (more than a second, for
    a decorator) and torch.onnx (a tenth, to ask whether an export was running): a first
    call costs what a call costs."""
    code = textwrap.dedent(
        """
        import sys, torch
        import multihead as mh
        from multihead import masks
        q = torch.randn(1, 2, 64, 8)
        mh.attention(q, q, q, masks.causal())
        mh.attention_with_weights(q, q, q, masks.causal(), heads=[1])
        print(sorted(m for m in ("torch._dynamo", "torch.onnx") if m in sys.modules))
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_build_error_carries_the_mark_torch_compile_reads():
    """fused marks build_error as torch.compiler.assume_constant_result would, without the
    import that function makes: the mark must be the one torch sets."""

    def plain():
        return None

    marked = torch.compiler.assume_constant_result(plain)
    assert {k: v for k, v in vars(marked).items()} == {
        k: v for k, v in vars(fused.build_error).items() if k != "__wrapped__"
    }


_FAKE_CXX = """#!/bin/sh
# a stand-in compiler: notes when each compile starts and ends, and where its object goes
out=""
prev=""
for arg in "$@"; do
  [ "$prev" = "-o" ] && out="$arg"
  prev="$arg"
done
case " $* " in
  *" -c "*)
    echo "start $(date +%s.%N) $out" >> "$FAKE_CXX_LOG"
    sleep 2
    : > "$out"
    echo "end $(date +%s.%N) $out" >> "$FAKE_CXX_LOG"
    ;;
  *) exit 0 ;;
esac
"""


def test_the_package_build_compiles_the_kernels_at_once_each_in_its_own_folder(tmp_path):
    """Each kernel is one source file, so one compile keeps one core busy: the package build
    compiles them at the same time. torch's compile writes one build.ninja per folder, so each
    kernel's objects get a folder of their own (in one shared folder the second kernel's
    build file replaced the first's)."""
    compiler = tmp_path / "c++"
    compiler.write_text(_FAKE_CXX)
    compiler.chmod(0o755)
    log = tmp_path / "compiles.log"
    env = dict(os.environ, CXX=str(compiler), FAKE_CXX_LOG=str(log))
    done = _setup_build(tmp_path, env)
    assert done.returncode == 0, done.stderr[-3000:]
    events = [line.split() for line in log.read_text().splitlines()]
    starts = {Path(out).stem: float(t) for kind, t, out in events if kind == "start"}
    ends = {Path(out).stem: float(t) for kind, t, out in events if kind == "end"}
    sources = {Path(k.source).stem for k in build.KERNELS}
    assert set(starts) == set(ends) == sources
    if (os.cpu_count() or 1) > 1:  # every compile began before any ended
        assert max(starts.values()) < min(ends.values()), events
    # tmp/<source's stem>/<the source's path>.o, a build.ninja in each stem's folder
    folders = {Path(out).relative_to(tmp_path / "tmp").parts[0] for _, _, out in events}
    assert folders == sources
    assert all((tmp_path / "tmp" / folder / "build.ninja").exists() for folder in folders)
