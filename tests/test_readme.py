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


def test_readme_blocks_and_model_examples_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S)
    assert len(blocks) >= 3
    import torch

    # the migration block starts from a user's existing torch module and masks
    namespace: dict = {
        "torch_mha": torch.nn.MultiheadAttention(512, 8, batch_first=True),
        "am": torch.ones(100, 100, dtype=torch.bool).tril().logical_not(),
        "kpm": torch.arange(100)[None].repeat(2, 1) >= torch.tensor([[100], [60]]),
    }
    for i, block in enumerate(blocks):  # later blocks build on the first one's imports
        exec(compile(block, f"README.md block {i}", "exec"), namespace)
    assert namespace["encoded"].output.shape == (2, 50, 256)  # the encoder example
    assert len(namespace["encoded"].weights) == 4
    assert namespace["w"].shape == (6, 12, 15, 15)  # the BERT example
    assert namespace["flow"].shape == (15, 15)
    assert namespace["vectors"].shape == (2, 384)
