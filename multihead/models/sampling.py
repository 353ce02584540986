"""How each generation step picks its token: the most likely one, or a sample from the
softmax at a temperature, after top-k and top-p (nucleus) filtering.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Sampler", "filter_top_k", "filter_top_p"]


def filter_top_k(scores: Tensor, k: int | None) -> Tensor:
    """Keep the k highest scores of each row (and any tied with the k-th), -inf elsewhere.

    scores: (B, vocab) logits (after temperature)."""
    if k is None or k >= scores.shape[-1]:
        return scores
    kth = torch.topk(scores, k, dim=-1).values[..., -1:]
    return scores.masked_fill(scores < kth, float("-inf"))


def filter_top_p(scores: Tensor, p: float | None) -> Tensor:
    """Nucleus filtering (Holtzman et al. 2020): keep the most likely tokens until their total
    probability reaches ``p`` (the token that crosses it included, the top token always),
    -inf elsewhere. scores: (B, vocab)."""
    if p is None or p >= 1.0:
        return scores
    ordered, order = scores.sort(dim=-1, descending=True)
    probs = ordered.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # probability of the tokens ranked above
    drop = (before >= p).scatter(-1, order, before >= p)
    return scores.masked_fill(drop, float("-inf"))


def _check_sampling(
    do_sample: bool,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None,
) -> None:
    if not isinstance(do_sample, bool):
        raise TypeError(f"do_sample must be a bool. Received: do_sample={do_sample!r}")
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, (int, float))
        or not (0 < temperature < math.inf)
    ):
        raise ValueError(
            "temperature must be a finite number > 0 (use do_sample=False for the most likely "
            f"token). Received: temperature={temperature!r}"
        )
    _check_filters(top_k, top_p)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(
            f"generator must be a torch.Generator. Received: {type(generator).__name__}"
        )


@dataclass(frozen=True)
class Sampler:
    """How each step picks its token: the most likely one, or a sample."""

    do_sample: bool
    temperature: float
    top_k: int | None
    top_p: float | None
    generator: torch.Generator | None

    @classmethod
    def checked(
        cls,
        max_new_tokens: int,
        do_sample: bool,
        temperature: float,
        top_k: int | None,
        top_p: float | None,
        generator: torch.Generator | None,
    ) -> Sampler:
        """Check ``max_new_tokens`` and the sampling options (named in each message)."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
            raise TypeError(
                f"max_new_tokens must be an int. Received: max_new_tokens={max_new_tokens!r}"
            )
        if max_new_tokens < 0:
            raise ValueError(
                f"max_new_tokens must be >= 0. Received: max_new_tokens={max_new_tokens}"
            )
        _check_sampling(do_sample, temperature, top_k, top_p, generator)
        return cls(do_sample, temperature, top_k, top_p, generator)

    def __call__(self, logits: Tensor) -> Tensor:
        """(B, vocab) logits -> (B,) tokens."""
        if not self.do_sample:
            return logits.argmax(dim=-1)
        return _sample(logits, self.temperature, self.top_k, self.top_p, self.generator)


def _check_filters(top_k: int | None, top_p: float | None) -> None:
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be a positive int or None. Received: top_k={top_k!r}")
    if top_p is not None and (
        isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1
    ):
        raise ValueError(f"top_p must be in (0, 1] or None. Received: top_p={top_p!r}")


def _sample(
    logits: Tensor,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None,
) -> Tensor:
    """One token per row from softmax(logits / temperature), after top-k then top-p (the
    order transformers applies them in).

    The logits are shifted by their row maximum before the division (softmax does not change)
    and divided in float64, where every finite temperature > 0 is itself representable (in
    float32 5e-324 is 0): the scores are then <= 0, so a tiny temperature drives them to -inf
    but never makes inf or NaN, and sampling tends to the greedy choice (tokens tied at the
    maximum share it)."""
    logits = logits.double()
    shifted = logits - logits.max(dim=-1, keepdim=True).values
    scores = filter_top_p(filter_top_k(shifted / temperature, top_k), top_p)
    return torch.multinomial(scores.softmax(dim=-1), 1, generator=generator)[:, 0]
