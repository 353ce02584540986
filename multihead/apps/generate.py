"""``multihead generate``: continue a prompt with a trained decoder, printing the text as it is
produced.

Greedy by default (``temperature`` 0); a temperature above 0, or ``top_k`` / ``top_p``, samples
(at temperature 1 unless given), reproducibly under ``seed``.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .._flags import argument, option, positive_int, required

__all__ = ["GenerateOptions", "check_options", "run"]


@dataclass(frozen=True, kw_only=True)
class GenerateOptions:
    """What ``multihead generate`` takes (``multihead generate --help``)."""

    prompt: str = argument("the text to continue", metavar="PROMPT")
    model: Path = required(
        "a decoder folder (e.g. one written by multihead train lm)", metavar="DIR"
    )
    max_new_tokens: int = option(50, "tokens to add", parse=positive_int)
    temperature: float = option(0.0, "0: greedy; above 0: sample at this temperature")
    top_k: int | None = option(None, "sample among the k most likely tokens", parse=positive_int)
    top_p: float | None = option(None, "sample from the fewest tokens reaching p")
    seed: int = option(0, "seed of the sampling")

    def __post_init__(self) -> None:
        check_options(self.max_new_tokens, self.temperature, self.top_k, self.top_p)
        if not isinstance(self.prompt, str) or not self.prompt.strip():
            raise ValueError(
                f"the prompt is empty; give some text to continue. Received: PROMPT {self.prompt!r}"
            )


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


def _write(piece: str) -> None:
    sys.stdout.write(piece)
    sys.stdout.flush()  # each piece as soon as its tokens are produced


def run(options: GenerateOptions, *, write: Callable[[str], object] = _write) -> str:
    """Stream the continuation of ``options.prompt`` through ``write`` (each piece as its
    tokens arrive, then a line break) and return it whole."""
    import torch

    from .. import models

    path = Path(options.model)
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
    temperature, top_k, top_p = options.temperature, options.top_k, options.top_p
    sample = temperature > 0 or top_k is not None or top_p is not None
    pieces = []
    for piece in lm.stream_text(
        options.prompt,
        options.max_new_tokens,
        do_sample=sample,
        temperature=temperature if temperature > 0 else 1.0,
        top_k=top_k,
        top_p=top_p,
        generator=torch.Generator().manual_seed(options.seed),
    ):
        pieces.append(piece)
        write(piece)
    write("\n")
    return "".join(pieces)
