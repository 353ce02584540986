"""Building the package's C++ kernels into the per-user cache, safe against a killed build.

``torch.utils.cpp_extension.load`` guards a build folder with a plain ``lock`` file that a
process killed while building or loading leaves behind; every later load in that folder then
waits for it forever (even when the compiled library is already there). Here a build also
holds an ``flock`` on ``build.flock`` in the folder, which the operating system releases when
its holder dies: whoever holds it knows that a ``lock`` file it finds is left over, and removes
it before calling torch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

__all__ = ["build_name", "load"]


def build_name(prefix: str, sources: Sequence[Path], settings: Sequence[str]) -> str:
    """The build folder's and module's name: ``prefix`` and a digest of the sources' contents,
    their absolute paths and the build settings. The paths count because torch's build file
    records them: two checkouts of the same code sharing one folder would each find the
    other's build file and rebuild, in turn, at every first use."""
    import hashlib

    h = hashlib.sha256()
    for source in sources:
        h.update(str(Path(source).resolve()).encode() + b"\0")
        h.update(Path(source).read_bytes())
    h.update(" ".join(settings).encode())
    return f"{prefix}_{h.hexdigest()[:16]}"


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
