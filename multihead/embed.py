"""``multihead embed``: sentence embeddings of every line of a text file, saved as .npy."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from . import _validation as V

__all__ = ["PROGRESS_FROM", "run"]

PROGRESS_FROM = 256  # lines; shorter inputs finish too fast for a progress bar to help


def run(
    file: str | Path,
    out: str | Path,
    *,
    model_path: str | Path | None = None,
    max_tokens: int = 1536,
    say: Callable[[str], None] = print,
) -> np.ndarray:
    """Embed each line of ``file`` (UTF-8; an empty line embeds as empty text) into ``out``.

    Returns the (lines, E) float32 array that was saved.
    """
    from .models import bert

    target = V.check_out_file("--out", out, ".npy")
    V.check_positive_int("max_tokens", max_tokens)
    source = Path(file)
    if not source.is_file():
        raise FileNotFoundError(f"no such input file. Received: {source}")
    lines = V.read_utf8_lines(source)
    if not lines:
        raise ValueError(f"the input file has no lines to embed. Received: {source}")
    model = bert.load(model_path)
    bar = None
    if len(lines) >= PROGRESS_FROM:
        from tqdm import tqdm

        bar = tqdm(total=len(lines), unit="line", desc="embedding", file=sys.stderr)
    try:
        vectors = model.embed(lines, max_tokens=max_tokens, progress=bar.update if bar else None)
    finally:
        if bar is not None:
            bar.close()
    array = vectors.numpy().astype(np.float32)
    target.parent.mkdir(parents=True, exist_ok=True)
    np.save(target, array)
    say(f"wrote {array.shape[0]} embeddings of size {array.shape[1]} to {target}")
    return array
