"""Memory under load (issue 17, item 7): the heap's free pages go back to the OS whenever the
model is idle. The long measurement is ``tests/serve/soak.py`` (minutes); these take seconds."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

import multihead.serve.state
from multihead.serve import Background, Limits, create_app

glibc = pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc" or not Path("/proc/self/status").exists(),
    reason="malloc_trim and /proc are glibc / Linux",
)


_HOLES = """
from pathlib import Path

from multihead.serve.memory import release_free_memory

def rss_mb():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

keep, large = [], []
for _ in range(1500):  # 150 MB
    large.append(bytearray(100_000))
    keep.append(bytearray(1000))
large.clear()
freed = rss_mb()
assert release_free_memory() is True
print(freed, rss_mb())
"""


@glibc
def test_free_heap_pages_between_live_blocks_go_back_to_the_os():
    """100 kB blocks (below glibc's mmap threshold, so on the heap), each followed by a 1 kB
    block that stays (over Python's 512-byte small-object limit, so on the same heap):
    freeing the large ones leaves holes that free() keeps (measured: the RSS does not move),
    and trimming returns them. This is the pattern varying batch shapes leave behind. A fresh
    process: in one whose heap already has free chunks, the small blocks fill those instead
    of separating the large ones, which then go back at free() already."""
    out = subprocess.run([sys.executable, "-c", _HOLES], capture_output=True, text=True,
                         timeout=120, check=True).stdout  # fmt: skip
    freed, trimmed = map(float, out.split())
    assert freed - trimmed > 75, (freed, trimmed)  # at least half of the 150 MB came back


def test_the_app_releases_memory_when_the_model_is_idle(engine, monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr(multihead.serve.state, "release_free_memory", lambda: calls.append(1))
    monkeypatch.setattr(multihead.serve.state, "_RELEASE_EVERY_S", 0.0)  # else once a second
    with Background(create_app(engine, Limits())) as running:
        assert httpx.post(running.url + "/embed", json={"inputs": "hello"}).status_code == 200
        assert len(calls) == 1  # after the batch, with nothing queued
        body = {"inputs": "hello", "layers": [0], "heads": [0]}
        assert httpx.post(running.url + "/attention", json=body).status_code == 200
        assert len(calls) == 2
