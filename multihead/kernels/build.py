"""The builder of the package's C++ kernels: one description of each, one set of compiler
flags, and the two places a compiled kernel comes from (``loader.py`` takes it from there).

* **The package build.** ``setup.py`` compiles every kernel in ``KERNELS`` with torch's C++
  extension tooling when the package is installed into an environment that already holds
  torch and a C++ compiler (``pip install --no-build-isolation``, as the README's commands
  do). The module lands inside the installed package (``multihead/kernels/_fused_kernel*.so``,
  ``multihead/kernels/_rows_kernel*.so``) beside a small record of what it was built from
  (``<module>.json``: the digest of its source and the headers that includes, the flags,
  torch's version, the CPU). Any user of the installation loads it, with an empty cache. A
  record that does not match this process (another torch, another CPU, edited sources)
  leaves it unused.
* **The per-user cache.** Otherwise ``torch.utils.cpp_extension.load`` compiles the kernel on
  demand (``multihead doctor``, ``backend="fused"``) into ``$MULTIHEAD_EXTENSION_DIR``, else
  ``$XDG_CACHE_HOME/multihead/extensions``, else ``~/.cache/multihead/extensions``, in a folder
  named by a digest of the same things, so a change of any of them builds afresh and nothing
  else ever rebuilds.

Both use ``cflags()`` / ``ldflags()``: ``-O3``, ``-g0`` (the package build would otherwise take
Python's ``-g``: debug information that makes the compile slower and the module 13 times
larger), ``-march=native`` on x86 (the kernels' exp and row loops are written for the compiler
to vectorize with every instruction set of the machine they are built on; the CPU is part of
every record and digest), and ``-fopenmp`` where torch runs on OpenMP (at::parallel_for is a
header template: built without OpenMP it runs every task on the calling thread; the kernel
then shares the libgomp torch has loaded).

``torch.utils.cpp_extension.load`` guards a build folder with a plain ``lock`` file that a
process killed while building or loading leaves behind; every later load in that folder then
waits for it forever. Here a build also holds an ``flock`` on ``build.flock`` in the folder,
which the operating system releases when its holder dies: whoever holds it knows that a
``lock`` file it finds is left over, and removes it before calling torch.

This module imports nothing of multihead (``setup.py`` loads it by path) and torch only inside
its functions.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import platform
import re
import shutil
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

__all__ = [
    "FUSED",
    "KERNELS",
    "PACKAGE",
    "ROWS",
    "Kernel",
    "build_name",
    "cache_dir",
    "cflags",
    "compile_in_cache",
    "compiler_missing",
    "first_error",
    "ldflags",
    "load",
    "packaged",
    "record",
]

PACKAGE = Path(__file__).resolve().parent.parent  # the multihead package folder
_QUOTED_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)


@dataclass(frozen=True)
class Kernel:
    """One C++ kernel of the package."""

    label: str  # for messages: "the fused attention kernel"
    prefix: str  # the cache folder's and cached module's name prefix
    module: str  # the packaged module's dotted name
    source: str  # its source, relative to the package folder
    switch: str  # the environment variable that turns it off with "0"

    @property
    def source_path(self) -> Path:
        return PACKAGE / self.source

    @property
    def files(self) -> list[Path]:
        """The source and every header it includes with quotes (``#include "fused/plan.h"``),
        followed through the headers, in the order first met: all that a build reads from the
        package, so all that its digest and record cover (a header left out would let an
        edited header reuse the build of the old one)."""
        found: list[Path] = []
        pending = [self.source_path.resolve()]
        while pending:
            path = pending.pop(0)
            if path not in found:
                found.append(path)
                names = _QUOTED_INCLUDE.findall(path.read_text(encoding="utf-8"))
                pending += [(path.parent / name).resolve() for name in names]
        return found

    @property
    def folder(self) -> Path:
        """Where the package build puts the module (``multihead/kernels``)."""
        return PACKAGE.joinpath(*self.module.split(".")[1:-1])

    @property
    def record_path(self) -> Path:
        return self.folder / f"{self.module.rsplit('.', 1)[-1]}.json"


FUSED = Kernel(
    label="the fused attention kernel",
    prefix="multihead_fused",
    module="multihead.kernels._fused_kernel",
    source="kernels/csrc/fused_attention.cpp",
    switch="MULTIHEAD_FUSED",
)
ROWS = Kernel(
    label="the decoding kernel",
    prefix="multihead_rows",
    module="multihead.kernels._rows_kernel",
    source="kernels/csrc/rows_linear.cpp",
    switch="MULTIHEAD_ROWS_KERNEL",
)
KERNELS = (FUSED, ROWS)


def _on_openmp() -> bool:
    import torch

    return torch.backends.openmp.is_available() and sys.platform.startswith("linux")


def cflags() -> list[str]:
    """The compiler flags of every kernel, in the package build and in the cache alike."""
    native = ["-march=native"] if platform.machine().lower() in ("x86_64", "amd64") else []
    return ["-O3", "-g0", *native, *(["-fopenmp"] if _on_openmp() else [])]


def ldflags() -> list[str]:
    return ["-fopenmp"] if _on_openmp() else []


def cpu_signature() -> str:
    """What the compiled code depends on besides the sources: -march=native bakes in the CPU."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def _settings() -> list[str]:
    import torch

    return [*cflags(), torch.__version__, cpu_signature()]


def record(kernel: Kernel) -> dict[str, str]:
    """What a build of ``kernel`` here and now is made from (the package build's record)."""
    import torch

    return {
        "source_sha256": _digest(kernel.files),
        "flags": " ".join(cflags()),
        "torch": torch.__version__,
        "cpu_sha256": hashlib.sha256(cpu_signature().encode()).hexdigest(),
    }


def _digest(files: Sequence[Path]) -> str:
    """sha256 of the files' contents, each after its path inside the package."""
    h = hashlib.sha256()
    for path in files:
        h.update(path.relative_to(PACKAGE).as_posix().encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def packaged(kernel: Kernel) -> tuple[ModuleType | None, str]:
    """(the module the package build compiled, "") when there is one and its record matches
    this process, else (None, why not: one line)."""
    if not any(kernel.folder.glob(f"{kernel.module.rsplit('.', 1)[-1]}*.so")):
        return None, "the package was installed without it"
    try:
        found = json.loads(kernel.record_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None, f"its build record {kernel.record_path.name} is missing"
    wanted = record(kernel)
    changed = [name for name, value in wanted.items() if found.get(name) != value]
    if changed:
        return None, f"it was built for another {', '.join(changed)} than this process has"
    try:
        return importlib.import_module(kernel.module), ""
    except ImportError as e:
        return None, f"it does not load: {first_error(e)}"


def cache_dir() -> Path:
    """The per-user folder kernels are compiled into on demand (created when used)."""
    root = os.environ.get("MULTIHEAD_EXTENSION_DIR")
    if root:
        return Path(root)
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "multihead" / "extensions"


def build_name(prefix: str, sources: Sequence[Path], settings: Sequence[str]) -> str:
    """The build folder's and module's name: ``prefix`` and a digest of the sources' contents,
    their absolute paths and the build settings. The paths count because torch's build file
    records them: two checkouts of the same code sharing one folder would each find the
    other's build file and rebuild, in turn, at every first use."""
    h = hashlib.sha256()
    for source in sources:
        h.update(str(Path(source).resolve()).encode() + b"\0")
        h.update(Path(source).read_bytes())
    h.update(" ".join(settings).encode())
    return f"{prefix}_{h.hexdigest()[:16]}"


def cached_name(kernel: Kernel) -> str:
    """The cache folder's and module's name for ``kernel`` here."""
    return build_name(kernel.prefix, kernel.files, _settings())


def in_cache(kernel: Kernel) -> bool:
    """Whether the cache holds a build of ``kernel`` for this process (nothing compiles)."""
    name = cached_name(kernel)
    return any((cache_dir() / name).glob(f"{name}*.so"))


def compiler_missing() -> str | None:
    """None when the C++ compiler torch's tooling runs ($CXX, else c++) is found, else why."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler {compiler!r} found (install g++ or clang++, or set CXX to one)"
    return None


def compile_in_cache(kernel: Kernel) -> ModuleType:
    """Compile ``kernel`` into the per-user cache, or load the build already there."""
    name = cached_name(kernel)
    folder = cache_dir() / name
    folder.mkdir(parents=True, exist_ok=True)
    if not any(folder.glob(f"{name}*.so")):  # a compile, not a load from the cache
        print(
            f"multihead: building {kernel.label} for this machine into {folder} (once, under "
            f"a minute; {kernel.switch}=0 turns it off)",
            file=sys.stderr,
            flush=True,
        )
    return load(name, [str(kernel.source_path)], folder, cflags=cflags(), ldflags=ldflags())


def first_error(e: Exception) -> str:
    """The line of a build failure a person can act on: the compiler's first error if there
    is one (a build log starts with the command line), else the first line."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    for line in lines:
        if any(word in line for word in ("error:", "not found", "No such file", "fatal")):
            return line[:300]
    return (lines[0] if lines else type(e).__name__)[:300]


@contextmanager
def _exclusive(folder: Path) -> Iterator[None]:
    """Hold the folder's build lock (one builder per folder across processes)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: torch's own lock file is all there is
        yield
        return
    with open(folder / "build.flock", "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def load(
    name: str,
    sources: Sequence[str],
    folder: Path,
    *,
    cflags: Sequence[str],
    ldflags: Sequence[str],
) -> ModuleType:
    """Compile (or load the cached build of) ``sources`` as module ``name`` in ``folder``."""
    from torch.utils import cpp_extension

    folder.mkdir(parents=True, exist_ok=True)
    with _exclusive(folder):
        (folder / "lock").unlink(missing_ok=True)  # torch's, left by a process that died
        return cpp_extension.load(
            name,
            list(sources),
            extra_cflags=list(cflags),
            extra_ldflags=list(ldflags),  # load() appends to the list it is given
            build_directory=str(folder),
            verbose=False,
        )
