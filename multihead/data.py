"""Data sets the applications train on, downloaded once into the user's cache: every file is
checked against a SHA-256 digest recorded here before it is written, and written atomically.

``multihead data download vader`` (``download("vader")``) fills
``~/.cache/multihead/data/vader-sentiment`` with the VADER ground truth; ``MULTIHEAD_DATA_DIR``
moves the cache root (else ``$XDG_CACHE_HOME/multihead/data``). ``--from URL`` (``source=``)
reads the same files by name from a mirror: a base URL or a local folder.
"""

from __future__ import annotations

import hashlib
import http.client
import io
import os
import sys
import tarfile
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ._atomic import replace_file
from ._flags import argument, option

__all__ = [
    "DATASETS",
    "ENV",
    "DataFile",
    "Dataset",
    "DownloadError",
    "DownloadOptions",
    "cache_root",
    "download",
    "download_command",
    "find",
    "folder",
    "missing",
]

ENV = "MULTIHEAD_DATA_DIR"  # the cache root, when set
_TIMEOUT_S = 60.0  # per connection and per read: a stalled server fails instead of hanging
_CHUNK = 1 << 16
_SCHEMES = ("http", "https", "file")


@dataclass(frozen=True)
class DataFile:
    """One file of a data set.

    Attributes:
        name: its name in the cache folder, and under a mirror's base URL.
        sha256: the digest of its bytes (hex).
        size: its length in bytes.
        url: where the public source keeps it: the file itself, or the archive holding it.
        member: its path inside the ``.tar.gz`` archive at ``url``; None when ``url`` is the
            file itself.
    """

    name: str
    sha256: str
    size: int
    url: str
    member: str | None = None


@dataclass(frozen=True)
class Dataset:
    """A data set the cache can hold: ``folder`` under the cache root, its ``files``, and the
    digest and size of each archive the public source packs some of them in (checked before
    anything is read from the archive)."""

    name: str
    folder: str
    about: str
    files: tuple[DataFile, ...]
    archives: Mapping[str, tuple[str, int]] = field(default_factory=dict)


# The VADER repository at a fixed commit, so the recorded digests stay valid: the licence is a
# file of its own there, the ground truth is packed in the ICWSM 2014 archive.
_VADER = (
    "https://raw.githubusercontent.com/cjhutto/vaderSentiment/"
    "44fc044cd877310ee8278a0eadf34bcd50d41d06"
)
_VADER_ARCHIVE = f"{_VADER}/additional_resources/hutto_ICWSM_2014.tar.gz"


def _vader_text(name: str, sha256: str, size: int) -> DataFile:
    return DataFile(name, sha256, size, _VADER_ARCHIVE, f"hutto_ICWSM_2014/{name}")


DATASETS: dict[str, Dataset] = {
    "vader": Dataset(
        name="vader",
        folder="vader-sentiment",
        about="VADER's ground truth (Hutto & Gilbert 2014): 23,703 short texts in four "
        "domains, each rated by about 20 people from -4 to +4; MIT licence",
        files=(
            _vader_text(
                "tweets_GroundTruth.txt",
                "dfbe7102e2f92579ed8b19df9a3822491880697c67adf712fb66e520cc05102f",
                389_886,
            ),
            _vader_text(
                "movieReviewSnippets_GroundTruth.txt",
                "c8293b0d942e90e223ea2c0955d969040d1a1be514a978b9af0698940bd13350",
                1_383_098,
            ),
            _vader_text(
                "amazonReviewSnippets_GroundTruth.txt",
                "11a9807a0974a2506a2d3b4851eaf69b3d6d20688ce4923adda2312a4f6dd6c2",
                373_157,
            ),
            _vader_text(
                "nytEditorialSnippets_GroundTruth.txt",
                "7d8fbcce7dde5d716da53e78f4ef4be6b706e9ef1e1d51887e6d0ad4b69cc27e",
                607_629,
            ),
            DataFile(
                "LICENSE.txt",
                "b78925304c567623f14677bad66b8e305e7ddcaf7982c8d8411ce51c55a8bf51",
                1_076,
                f"{_VADER}/LICENSE.txt",
            ),
        ),
        archives={
            _VADER_ARCHIVE: (
                "d5bb07d87474b3eb8d30b4deccbc23f19d742a6c5718fbacc65485b70b95c5fa",
                2_338_514,
            )
        },
    )
}


class DownloadError(OSError):
    """A file could not be fetched whole, or its bytes are not the ones recorded here."""


def cache_root() -> Path:
    """Where data sets are kept: ``$MULTIHEAD_DATA_DIR``, else
    ``$XDG_CACHE_HOME/multihead/data``, else ``~/.cache/multihead/data``."""
    chosen = os.environ.get(ENV)
    if chosen:
        return Path(chosen).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "multihead" / "data"


def _dataset(name: str) -> Dataset:
    if name not in DATASETS:
        raise ValueError(
            f"no data set named {name!r}; the ones multihead can download: "
            f"{', '.join(sorted(DATASETS))}. Received: {name!r}"
        )
    return DATASETS[name]


def folder(name: str) -> Path:
    """The cache folder of data set ``name`` (it may not exist yet)."""
    return cache_root() / _dataset(name).folder


def missing(name: str) -> list[str]:
    """The files of data set ``name`` not in its cache folder yet (by name; ``download``
    checked the digests of those there)."""
    where = folder(name)
    return [f.name for f in _dataset(name).files if not (where / f.name).is_file()]


def find(name: str) -> Path:
    """The cache folder of data set ``name`` with every file in it.

    Raises:
        FileNotFoundError: some files are missing; the message gives the one command that
            downloads them.
    """
    where, absent = folder(name), missing(name)
    if absent:
        if not where.is_dir():
            have = "does not exist"
        elif len(absent) == len(_dataset(name).files):
            have = "is empty"
        else:
            have = "is incomplete"
        raise FileNotFoundError(
            f"the {name} data set is not downloaded yet: {where} {have}. Run once: "
            f"multihead data download {name} (or pass --data with a folder of your own). "
            f"Received: missing {', '.join(absent)}"
        )
    return where


def download(
    name: str,
    *,
    source: str | None = None,
    say: Callable[[str], None] = print,
) -> Path:
    """Fetch data set ``name`` into its cache folder; files already there with the recorded
    digest are kept, any other is fetched again. Each file is checked against its SHA-256
    digest before it is written, and written whole (a temporary file renamed into place), so
    the cache never holds a partial or corrupt file.

    Args:
        name: a key of ``DATASETS`` ("vader").
        source: a mirror: a base URL (http, https or file) or a local folder holding the files
            by name. None (default): the public source (``DataFile.url``).
        say: where the progress lines go.

    Returns:
        The cache folder, complete.

    Raises:
        ValueError: an unknown data set, or a ``source`` that is neither a URL nor a folder.
        DownloadError: a file could not be fetched (unreachable, an HTTP error, a connection
            that closed early) or its digest is not the recorded one; the files fetched and
            checked before it are kept.
    """
    dataset = _dataset(name)
    base = None if source is None else _base_url(source)
    where = folder(name)
    where.mkdir(parents=True, exist_ok=True)
    todo = [f for f in dataset.files if not _holds(where / f.name, f)]
    for kept in (f for f in dataset.files if f not in todo):
        say(f"{kept.name}: already there (SHA-256 checked)")
    archives: dict[str, tarfile.TarFile] = {}
    for item in todo:
        if base is not None:
            url = f"{base}/{urllib.parse.quote(item.name)}"
            data = _check(_fetch(url, item.size), item, url)
        elif item.member is None:
            data = _check(_fetch(item.url, item.size), item, item.url)
        else:
            if item.url not in archives:
                archives[item.url] = _archive(dataset, item.url)
            data = _check(_member(archives[item.url], item), item, f"{item.url} ({item.member})")
        with replace_file(where / item.name) as tmp:
            tmp.write_bytes(data)
        say(f"{item.name}: {len(data):,} bytes, SHA-256 checked")
    say(f"{dataset.name}: {len(dataset.files)} files in {where}")
    return where


def _base_url(source: str) -> str:
    """``source`` as a base URL without its trailing slash; a folder becomes a file:// URL."""
    scheme = urllib.parse.urlsplit(source).scheme
    if scheme in _SCHEMES:
        return source.rstrip("/")
    if "://" not in source and Path(source).expanduser().is_dir():
        return Path(source).expanduser().resolve().as_uri()
    raise ValueError(
        "--from must be a base URL (http://, https:// or file://) or a folder that holds the "
        f"files by name. Received: --from {source}"
    )


def _holds(path: Path, item: DataFile) -> bool:
    """Whether ``path`` is a file with ``item``'s bytes."""
    if not path.is_file() or path.stat().st_size != item.size:
        return False
    return hashlib.sha256(path.read_bytes()).hexdigest() == item.sha256


def _fetch(url: str, size: int) -> bytes:
    """The bytes at ``url``, at most one more than ``size`` (a larger answer is cut there and
    then fails its digest, so a wrong file never fills the memory)."""
    try:
        with urllib.request.urlopen(url, timeout=_TIMEOUT_S) as answer:
            chunks, got = [], 0
            while got <= size:
                chunk = answer.read(min(_CHUNK, size + 1 - got))
                if not chunk:
                    break
                chunks.append(chunk)
                got += len(chunk)
            announced = answer.headers.get("Content-Length", "")
    except urllib.error.HTTPError as err:
        raise DownloadError(
            f"could not download {url}: the server answered HTTP {err.code} ({err.reason}). "
            "Check the URL (a --from mirror must hold the files by name). "
            f"Received: HTTP {err.code}"
        ) from None
    except (urllib.error.URLError, http.client.HTTPException, OSError) as err:
        reason = getattr(err, "reason", err)
        raise DownloadError(
            f"could not download {url} ({reason}); check the network connection, or download "
            f"from a mirror with --from URL. Received: {type(err).__name__}"
        ) from None
    if announced.isdigit() and got < min(int(announced), size + 1):
        raise DownloadError(
            f"could not download {url}: the connection closed after {got:,} of the "
            f"{int(announced):,} bytes the server announced, so nothing was written. Run the "
            f"command again. Received: {got} bytes"
        )
    return b"".join(chunks)


def _check(data: bytes, item: DataFile, origin: str) -> bytes:
    """``data`` when it is ``item`` byte for byte, else a DownloadError that says whether it
    was cut short."""
    digest = hashlib.sha256(data).hexdigest()
    if digest == item.sha256:
        return data
    if len(data) < item.size:
        what = f"truncated: {len(data):,} of its {item.size:,} bytes arrived"
    elif len(data) > item.size:
        what = f"longer than the {item.size:,} bytes recorded"
    else:
        what = f"corrupt: its {item.size:,} bytes differ from the recorded ones"
    raise DownloadError(
        f"{item.name} from {origin} is {what}, so it was not written (SHA-256 "
        f"{item.sha256} expected). Run the command again, or download from another mirror "
        f"with --from URL. Received: sha256={digest}"
    )


def _archive(dataset: Dataset, url: str) -> tarfile.TarFile:
    """The archive at ``url``, checked against its recorded digest, opened in memory."""
    digest, size = dataset.archives[url]
    data = _fetch(url, size)
    got = hashlib.sha256(data).hexdigest()
    if got != digest:
        raise DownloadError(
            f"the archive {url} ({len(data):,} bytes, {size:,} recorded) does not match the "
            f"SHA-256 recorded in multihead ({digest}); nothing was read from it. Run the "
            f"command again, or download from a mirror with --from URL. Received: sha256={got}"
        )
    return tarfile.open(fileobj=io.BytesIO(data), mode="r:gz")


def _member(archive: tarfile.TarFile, item: DataFile) -> bytes:
    """The bytes of ``item.member`` in ``archive`` (read in memory, never extracted)."""
    try:
        handle = archive.extractfile(str(item.member))
    except KeyError:
        handle = None
    if handle is None:
        raise DownloadError(
            f"the archive {item.url} has no file {item.member}. Received: {archive.getnames()[:8]}"
        )
    return handle.read()


@dataclass(frozen=True, kw_only=True)
class DownloadOptions:
    """What ``multihead data download`` takes (``multihead data download --help``)."""

    dataset: Literal["vader"] = argument("the data set to fetch", metavar="NAME")
    source: str | None = option(
        None,
        "a mirror: a base URL (or a folder) holding the same files by name (default: the data "
        "set's public source)",
        flag="--from",
        metavar="URL",
    )


def download_command(options: DownloadOptions) -> int:
    """``multihead data download NAME [--from URL]``: 0 when the data set is complete in the
    cache, 1 when the network or the mirror failed (said on stderr; not a usage error)."""
    try:
        download(options.dataset, source=options.source)
    except DownloadError as err:
        print(f"multihead data download: error: {err}", file=sys.stderr)
        return 1
    return 0
