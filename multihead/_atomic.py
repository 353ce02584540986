"""Writing a folder or a file so that a crash at any point leaves the old one or the new one,
whole, never a mix of both (checkpoints, training runs, exported graphs).

A folder is written into a temporary sibling and swapped into place with one rename: on Linux
``renameat2(RENAME_EXCHANGE)`` swaps two folders atomically; elsewhere the old folder is moved
aside first (a kill between the two renames then leaves the old folder under its temporary name,
and the next write to the same place removes it). Temporaries left by a killed process are
removed by the next write to the same destination.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["replace_file", "replace_folder", "stale_temporaries"]

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _prefix(dest: Path) -> str:
    return f".{dest.name}.tmp-{os.getpid()}-"


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def stale_temporaries(dest: str | Path) -> list[Path]:
    """Temporaries beside ``dest`` left by processes that no longer run."""
    dest = Path(dest)
    if not dest.parent.is_dir():
        return []
    found = []
    for entry in dest.parent.glob(f".{dest.name}.tmp-*"):
        pid = entry.name[len(f".{dest.name}.tmp-") :].split("-", 1)[0]
        if pid.isdigit() and not _pid_alive(int(pid)):
            found.append(entry)
    return sorted(found)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _fsync(path: Path) -> None:
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) if path.is_dir() else os.O_RDONLY
    try:
        fd = os.open(path, flags)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on folders
        pass
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*"), reverse=True):
        if path.is_file() and not path.is_symlink():
            _fsync(path)
    _fsync(root)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2); False where the system cannot."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def replace_folder(dest: str | Path) -> Iterator[Path]:
    """Yield an empty temporary folder beside ``dest``; when the block ends without an error,
    the temporary folder becomes ``dest`` (replacing a previous one whole). On an error it is
    removed and ``dest`` is untouched. The parent folder must exist."""
    dest = Path(dest)
    if not dest.parent.is_dir():
        raise FileNotFoundError(
            f"the folder {dest.parent} does not exist; create it first. Received: {dest}"
        )
    if dest.exists() and not dest.is_dir():
        raise NotADirectoryError(f"{dest} exists and is not a folder. Received: {dest}")
    for stale in stale_temporaries(dest):
        _remove(stale)
    tmp = Path(tempfile.mkdtemp(prefix=_prefix(dest), dir=dest.parent))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp's 0700 would outlive the swap
    try:
        yield tmp
        _fsync_tree(tmp)
        if not dest.exists():
            os.rename(tmp, dest)
        elif _exchange(tmp, dest):
            shutil.rmtree(tmp, ignore_errors=True)  # tmp now holds the old folder
        else:
            aside = Path(tempfile.mkdtemp(prefix=_prefix(dest), dir=dest.parent))
            os.rmdir(aside)
            os.rename(dest, aside)
            os.rename(tmp, dest)
            shutil.rmtree(aside, ignore_errors=True)
        _fsync(dest.parent)
    except BaseException:
        _remove(tmp)
        raise


@contextlib.contextmanager
def replace_file(dest: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``dest``; when the block ends without an error the file
    written there replaces ``dest`` with one atomic rename. On an error it is removed."""
    dest = Path(dest)
    if not dest.parent.is_dir():
        raise FileNotFoundError(
            f"the folder {dest.parent} does not exist; create it first. Received: {dest}"
        )
    if dest.is_dir():
        raise IsADirectoryError(f"{dest} is a folder, not a file. Received: {dest}")
    for stale in stale_temporaries(dest):
        _remove(stale)
    fd, name = tempfile.mkstemp(prefix=_prefix(dest), dir=dest.parent)
    os.close(fd)
    tmp = Path(name)
    os.chmod(tmp, (stat.S_IRUSR | stat.S_IWUSR | stat.S_IRGRP | stat.S_IROTH) & ~_umask())
    try:
        yield tmp
        _fsync(tmp)
        os.replace(tmp, dest)
        _fsync(dest.parent)
    except BaseException:
        _remove(tmp)
        raise
