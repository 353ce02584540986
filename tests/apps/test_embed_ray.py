"""`multihead embed --ray` on a local Ray instance with two workers against the single-process
`multihead embed` on the same file."""

from __future__ import annotations

import numpy as np
import pytest

from multihead import cli
from multihead.apps import embed
from multihead.bench.texts import sentences

# the same texts go through the same packed path; only which texts share a packed row (and
# so the sizes of the fp32 matmuls) changes with Ray's batches, which may move the last bits.
# Measured here: identical bits (difference 0).
PACKING = 1e-6


@pytest.mark.slow
def test_ray_embed_equals_single_process_in_input_order(tmp_path, capsys):
    lines = sentences(9, min_words=3, max_words=60, seed=5)
    lines[4] = ""  # an empty line still gets its row
    lines.append(" ".join(["long"] * 300))  # truncated to 256 tokens on both paths
    source = tmp_path / "lines.txt"
    source.write_text("\n".join(lines), encoding="utf-8")
    with pytest.warns(UserWarning, match="truncated"):
        assert cli.main(["embed", str(source), "--out", str(tmp_path / "one.npy")]) == 0
    args = ["embed", str(source), "--out", str(tmp_path / "ray.npy"), "--ray"]
    args += ["--workers", "2", "--ray-batch-size", "3"]  # four batches over two actors
    assert cli.main(args) == 0
    assert "wrote 10 embeddings of size 384" in capsys.readouterr().out
    single, ray = np.load(tmp_path / "one.npy"), np.load(tmp_path / "ray.npy")
    assert ray.shape == single.shape == (10, 384) and ray.dtype == np.float32
    assert np.abs(ray - single).max() <= PACKING
    # input order: every row is nearest to its own line's row, among all rows
    similarity = ray @ single.T
    assert (similarity.argmax(axis=1) == np.arange(10)).all()


def test_ray_arguments_are_checked():
    with pytest.raises(ValueError, match=r"workers must be a positive int. Received: workers=0"):
        embed.embed_on_ray(["a"], workers=0)
    with pytest.raises(ValueError, match=r"batch_size must be a positive int"):
        embed.embed_on_ray(["a"], batch_size=-1)
