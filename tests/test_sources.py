"""The C++ sources' comments say what the code does and why, never what a past run measured
or what the code used to be: those go stale the day they are written (the benchmarks and the
CHANGELOG keep them)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "multihead"
# every C++ file of the kernels: the two sources and the headers they include
SOURCES = sorted(
    p.relative_to(ROOT).as_posix()
    for p in (ROOT / "kernels" / "csrc").rglob("*")
    if p.suffix in (".cpp", ".h")
)

# a measurement, a machine, a past run or a past version of the code
HISTORY = re.compile(
    r"""\bmeasured\b | \bmeasurements?\b | \d+(\.\d+)?\s?% | \d+(\.\d+)?x\s(faster|slower)
    | \d+(\.\d+)?\s?GFLOP/s | \b(Xeon|EPYC|Ryzen|Threadripper|Graviton)\b | \bused\sto\b
    | \bbefore\sthe\s\w+\s\w+ed\b | \bran\s(\d|the|at)\b | \bwas\b | \bwere\b
    | \b(previously|formerly|no\slonger)\b | \bon\s(one|two|\d+)\scores?\b""",
    re.IGNORECASE | re.VERBOSE,
)


def comments(text: str) -> list[tuple[int, str]]:
    """(line number, text) of every // and /* */ comment, string literals left out."""
    text = re.sub(r'"(\\.|[^"\\\n])*"', lambda m: " " * len(m.group()), text)
    found = []
    for match in re.finditer(r"//[^\n]*|/\*.*?\*/", text, re.DOTALL):
        line = text.count("\n", 0, match.start()) + 1
        found.append((line, match.group()))
    return found


def history(text: str) -> list[str]:
    return [
        f"line {line}: {hit.group()!r} in {body.strip()[:100]!r}"
        for line, body in comments(text)
        for hit in HISTORY.finditer(body)
    ]


@pytest.mark.parametrize("path", SOURCES)
def test_comments_carry_no_measurements_or_history(path):
    assert history((ROOT / path).read_text()) == []


def test_the_check_finds_what_it_looks_for():
    text = (
        "int a = 1;  // measured on a 2-core Xeon: ran 6% faster\n"
        '/* before the backward gathered dK, this used to be 3x slower */ const char* s = "was";\n'
        "int b = a % 16;  // the K % 16 tail, before the next task overwrites it\n"
    )
    found = " ".join(history(text))
    for word in ("measured", "Xeon", "6%", "before the backward gathered", "used to", "3x slower"):
        assert word in found
    assert "line 3" not in found and "'was'" not in found


# the whole C++ frontend: its headers take about half of a kernel's compile (the install, a
# user's first-use build in the cache, and this suite's clean-cache build all pay it)
FRONTEND = re.compile(r"#include\s*<torch/(extension|torch|all)\.h>")


@pytest.mark.parametrize("path", SOURCES)
def test_kernels_include_only_the_headers_they_use(path):
    text = (ROOT / path).read_text(encoding="utf-8")
    assert not FRONTEND.search(text), f"{path} includes torch's whole C++ frontend"
    assert FRONTEND.search("#include <torch/extension.h>")
