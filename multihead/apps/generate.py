"""``multihead generate``: continue a prompt with a trained decoder, printing the text as it is
produced.

Greedy by default (``temperature`` 0); a temperature above 0, or ``top_k`` / ``top_p``, samples
(at temperature 1 unless given), reproducibly under ``seed``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

__all__ = ["check_options", "run"]


def check_options(
    max_new_tokens: int, temperature: float, top_k: int | None, top_p: float | None
) -> None:
    """Refuse bad sampling settings before any model is loaded."""
    if (
        isinstance(max_new_tokens, bool)
        or not isinstance(max_new_tokens, int)
        or max_new_tokens < 1
    ):
        raise ValueError(f"--max-new-tokens must be >= 1. Received: {max_new_tokens!r}")
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(
            f"--temperature must be a finite number >= 0 (0: greedy). Received: {temperature!r}"
        )
    if top_k is not None and top_k < 1:
        raise ValueError(f"--top-k must be >= 1. Received: {top_k!r}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1]. Received: {top_p!r}")


def run(
    model: str | Path,
    prompt: str,
    *,
    max_new_tokens: int = 50,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    write: Callable[[str], object] = print,
) -> str:
    """Stream the continuation of ``prompt`` through ``write`` (each piece as its tokens
    arrive) and return it whole."""
    import torch

    from .. import models

    check_options(max_new_tokens, temperature, top_k, top_p)
    path = Path(model)
    if not path.is_dir():
        raise FileNotFoundError(
            f"--model must be a model folder (config.json, weights, tokenizer.json). "
            f"Received: {str(path)!r}, which is not a folder"
        )
    lm = models.load(path)
    if not hasattr(lm, "stream_text"):
        raise ValueError(
            f"multihead generate needs a decoder (GPT-2 or Llama); {path} holds a "
            f"{type(lm).__name__}. Received: --model {path}"
        )
    sample = temperature > 0 or top_k is not None or top_p is not None
    pieces = []
    for piece in lm.stream_text(
        prompt,
        max_new_tokens,
        do_sample=sample,
        temperature=temperature if temperature > 0 else 1.0,
        top_k=top_k,
        top_p=top_p,
        generator=torch.Generator().manual_seed(seed),
    ):
        pieces.append(piece)
        write(piece)
    return "".join(pieces)
