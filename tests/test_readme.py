"""The README's usage example runs as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_usage_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S)
    namespace: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)
    assert namespace["out"].shape == (2, 8, 100, 64)
    assert namespace["weights"].shape == (2, 8, 100, 120)
    assert namespace["y"].shape == (2, 100, 512) and namespace["w"].shape == (2, 8, 100, 100)
