"""``multihead data download``: the files checked against the digests recorded in the package
and written whole, against a server on 127.0.0.1 (never the network) serving the VADER files,
a corrupt one, a truncated one, a connection that closes early and a 404; the cache's place;
and the one command the train applications name when the cache is empty."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import re
import tarfile

import pytest
from helpers import serve_files

from multihead import data
from multihead.cli import main

VADER = data.DATASETS["vader"]
NAMES = [f.name for f in VADER.files]


@pytest.fixture(scope="module")
def originals(vader):
    """name -> the bytes of each VADER file (from the cache or ../shared/data)."""
    return {name: (vader / name).read_bytes() for name in NAMES}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache root, through MULTIHEAD_DATA_DIR."""
    monkeypatch.setenv("MULTIHEAD_DATA_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "vader-sentiment"


def _download(*extra: str) -> int:
    return main(["data", "download", "vader", *extra])


def _leftovers(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_the_recorded_digests_and_sizes_are_the_files(originals):
    for item in VADER.files:
        body = originals[item.name]
        assert (hashlib.sha256(body).hexdigest(), len(body)) == (item.sha256, item.size)
    assert sorted(NAMES) == sorted(
        ["LICENSE.txt"]
        + [f"{d}_GroundTruth.txt" for d in ("tweets", "movieReviewSnippets",
                                             "amazonReviewSnippets", "nytEditorialSnippets")]
    )  # fmt: skip


def test_download_from_a_mirror_then_nothing_twice(originals, cache, capsys):
    with serve_files(originals) as (url, asked):
        assert _download("--from", url + "/") == 0
        assert sorted(asked) == sorted(NAMES)
        for name in NAMES:
            assert (cache / name).read_bytes() == originals[name]
        assert _leftovers(cache) == []
        printed = capsys.readouterr().out
        assert "tweets_GroundTruth.txt: 389,886 bytes, SHA-256 checked" in printed
        assert printed.rstrip().endswith(f"vader: 5 files in {cache}")
        asked.clear()
        assert _download("--from", url) == 0
        assert asked == []  # intact files are not fetched again
        assert "LICENSE.txt: already there (SHA-256 checked)" in capsys.readouterr().out


def test_a_local_folder_is_a_mirror_too(vader, cache):
    assert _download("--from", str(vader)) == 0
    assert sorted(p.name for p in cache.iterdir()) == sorted(NAMES)


def test_a_corrupt_file_is_refused_and_never_written(originals, cache, capsys):
    bad = bytearray(originals["tweets_GroundTruth.txt"])
    bad[1000] ^= 0x20  # one letter's case: same size, other bytes
    files = {**originals, "tweets_GroundTruth.txt": bytes(bad)}
    with serve_files(files) as (url, _):
        assert _download("--from", url) == 1
    err = capsys.readouterr().err
    digest = hashlib.sha256(bad).hexdigest()
    assert re.search(
        rf"^multihead data download: error: tweets_GroundTruth.txt from {url}/"
        r"tweets_GroundTruth.txt is corrupt: its 389,886 bytes differ from the recorded ones, "
        rf"so it was not written .* Received: sha256={digest}$",
        err.strip(),
    )
    assert not (cache / "tweets_GroundTruth.txt").exists()
    assert _leftovers(cache) == []


def test_a_truncated_file_is_refused(originals, cache, capsys):
    name = "movieReviewSnippets_GroundTruth.txt"
    files = {**originals, name: originals[name][:500_000]}  # cut short, said whole
    with serve_files(files) as (url, _):
        assert _download("--from", url) == 1
    assert "is truncated: 500,000 of its 1,383,098 bytes arrived" in capsys.readouterr().err
    # the file before it passed its check and stays; the rest were never fetched
    assert sorted(p.name for p in cache.iterdir()) == ["tweets_GroundTruth.txt"]


def test_a_connection_closed_early_is_refused(originals, cache, capsys):
    with serve_files(originals, cut={"LICENSE.txt": 500}) as (url, _):
        assert _download("--from", url) == 1
    err = capsys.readouterr().err
    assert re.search(
        r"LICENSE.txt: the connection closed after 500 of the 1,076 bytes the server "
        r"announced, so nothing was written\. .*Received: 500 bytes",
        err,
    )
    assert not (cache / "LICENSE.txt").exists()


def test_a_404_names_the_url_then_a_rerun_fetches_only_what_is_missing(originals, cache, capsys):
    files = {k: v for k, v in originals.items() if k != "LICENSE.txt"}
    with serve_files(files) as (url, _):
        assert _download("--from", url) == 1
    assert re.search(
        rf"could not download {url}/LICENSE.txt: the server answered HTTP 404 \(Not Found\)"
        r"\. .*Received: HTTP 404",
        capsys.readouterr().err,
    )
    with serve_files(originals) as (url, asked):
        assert _download("--from", url) == 0
    assert asked == ["LICENSE.txt"]


def test_a_damaged_file_in_the_cache_is_fetched_again(originals, cache):
    cache.mkdir(parents=True)
    (cache / "LICENSE.txt").write_bytes(b"edited")
    with serve_files(originals) as (url, asked):
        assert _download("--from", url) == 0
    assert "LICENSE.txt" in asked
    assert (cache / "LICENSE.txt").read_bytes() == originals["LICENSE.txt"]


def _archive(originals) -> bytes:
    """The four ground-truth files packed as the VADER repository packs them."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for item in VADER.files:
            if item.member is not None:
                info = tarfile.TarInfo(item.member)
                info.size = item.size
                tar.addfile(info, io.BytesIO(originals[item.name]))
    return buffer.getvalue()


def _public_source(monkeypatch, url: str, archive: bytes) -> None:
    """The VADER record with its public URLs moved to ``url`` (the archive's recorded digest
    becomes the one of ``archive``, built here from the same files)."""
    moved = {f.url: f"{url}/{f.url.rsplit('/', 1)[1]}" for f in VADER.files}
    files = tuple(dataclasses.replace(f, url=moved[f.url]) for f in VADER.files)
    (old,) = VADER.archives
    archives = {moved[old]: (hashlib.sha256(archive).hexdigest(), len(archive))}
    record = dataclasses.replace(VADER, files=files, archives=archives)
    monkeypatch.setitem(data.DATASETS, "vader", record)


def test_the_public_source_archive_is_read_in_memory_and_checked(
    originals, cache, monkeypatch, capsys
):
    archive = _archive(originals)
    served = {"hutto_ICWSM_2014.tar.gz": archive, "LICENSE.txt": originals["LICENSE.txt"]}
    with serve_files(served) as (url, asked):
        _public_source(monkeypatch, url, archive)
        assert _download() == 0
    assert sorted(asked) == ["LICENSE.txt", "hutto_ICWSM_2014.tar.gz"]  # the archive once
    for name in NAMES:
        assert (cache / name).read_bytes() == originals[name]
    assert _leftovers(cache) == [] and not (cache / "hutto_ICWSM_2014").exists()
    capsys.readouterr()

    (cache / "tweets_GroundTruth.txt").unlink()
    with serve_files({**served, "hutto_ICWSM_2014.tar.gz": archive[:-100]}) as (url, _):
        _public_source(monkeypatch, url, archive)
        assert _download() == 1
    assert re.search(
        rf"the archive {url}/hutto_ICWSM_2014.tar.gz \(\d[\d,]* bytes, [\d,]+ recorded\) does "
        r"not match the SHA-256 recorded in multihead .*nothing was read from it",
        capsys.readouterr().err,
    )
    assert not (cache / "tweets_GroundTruth.txt").exists()


def test_the_public_source_is_pinned_to_one_commit():
    pinned = re.compile(
        r"^https://raw\.githubusercontent\.com/cjhutto/vaderSentiment/[0-9a-f]{40}/"
    )
    assert all(pinned.match(f.url) for f in VADER.files)
    assert {f.url for f in VADER.files if f.member} == set(VADER.archives)


def test_unreachable_source_is_a_clear_error(cache, capsys):
    with serve_files({}) as (url, _):
        pass  # the port is closed again: nothing answers there
    assert _download("--from", url) == 1
    assert re.search(
        rf"could not download {url}/tweets_GroundTruth.txt \(.*\); check the network "
        r"connection, or download from a mirror with --from URL\. Received: URLError",
        capsys.readouterr().err,
    )


def test_bad_arguments(cache, capsys, tmp_path):
    assert _download("--from", str(tmp_path / "nowhere")) == 2
    assert re.search(
        r"--from must be a base URL \(http://, https:// or file://\) or a folder that holds "
        r"the files by name\. Received: --from .*nowhere",
        capsys.readouterr().err,
    )
    with pytest.raises(SystemExit):
        main(["data", "download", "imdb"])
    assert re.search(r"invalid choice: 'imdb' \(choose from '?vader'?\)", capsys.readouterr().err)
    with pytest.raises(ValueError, match=r"no data set named 'imdb'.*vader\. Received: 'imdb'"):
        data.download("imdb")


def test_the_cache_root(monkeypatch, tmp_path):
    monkeypatch.delenv("MULTIHEAD_DATA_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert data.folder("vader") == tmp_path / ".cache" / "multihead" / "data" / "vader-sentiment"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert data.cache_root() == tmp_path / "xdg" / "multihead" / "data"
    monkeypatch.setenv("MULTIHEAD_DATA_DIR", str(tmp_path / "mine"))
    assert data.folder("vader") == tmp_path / "mine" / "vader-sentiment"


@pytest.mark.parametrize("task", ["sentiment", "lm"])
def test_train_on_an_empty_cache_names_the_one_command(task, cache, tmp_path, capsys):
    assert main(["train", task, "--quick", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert re.search(
        rf"^multihead train: error: the vader data set is not downloaded yet: {cache} does "
        r"not exist\. Run once: multihead data download vader .*Received: missing "
        r"tweets_GroundTruth.txt, ",
        err,
    )
    assert not (tmp_path / "run").exists()
    cache.mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match=rf"{cache} is empty\. Run once: multihead data"):
        data.find("vader")
