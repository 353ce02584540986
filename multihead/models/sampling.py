"""How each generation step picks its token: the most likely one, or a sample from the
softmax at a temperature, after top-k and top-p (nucleus) filtering.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Sampler", "filter_top_k", "filter_top_p", "greedy"]


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
            return greedy(logits)
        return _sample(logits, self.temperature, self.top_k, self.top_p, self.generator)


def greedy(logits: Tensor) -> Tensor:
    """(B, vocab) logits -> (B,) int64: each row's most likely token, ``logits.argmax(-1)``:
    the first of tied maxima, the first NaN where a row has one.

    On the CPU numpy's argmax answers (the same index): it is vectorized, ATen's CPU argmax is
    not, and over a 49,152-token vocabulary the difference is most of the choice's time."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(logits.detach().numpy().argmax(-1))
    return logits.argmax(dim=-1)


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
    maximum share it).

    With ``top_k`` the vocabulary is read once, by ``topk``: the k candidates (sorted, so
    top-p needs no sort of its own) are all that is scaled, filtered and sampled from, the
    same distribution as ``filter_top_k`` over the whole row. Where the k-th score is tied
    with the next (``filter_top_k`` keeps every tie), the whole row is filtered instead."""
    candidates = _top_k(logits, top_k)
    values, indices = (logits, None) if candidates is None else candidates
    values = values.double()
    shifted = values - values.max(dim=-1, keepdim=True).values
    scores = shifted / temperature
    if candidates is None:
        scores = filter_top_k(scores, top_k)
    scores = filter_top_p(scores, top_p)
    choice = torch.multinomial(scores.softmax(dim=-1), 1, generator=generator)
    return (choice if indices is None else indices.gather(-1, choice))[:, 0]


def _top_k(logits: Tensor, k: int | None) -> tuple[Tensor, Tensor] | None:
    """The k highest logits of each row and their token ids, (B, k) each, sorted; None when
    k keeps the whole row or a row's k-th logit is tied with its next (one more is taken to
    see it)."""
    if k is None or k >= logits.shape[-1]:
        return None
    values, indices = torch.topk(logits, k + 1, dim=-1)
    if bool((values[:, k - 1] == values[:, k]).any()):
        return None
    return values[:, :k], indices[:, :k]
