"""Looking inside a model: per-head statistics, top attended tokens, attention rollout, the
attention sinks set aside (``multihead.inspect.sinks``), and token attributions
(``attribute``: what a target depends on, ``multihead.inspect.attribution``).

Everything here takes the weights of ONE sequence without padding, stacked over layers:
``(layers, H, L, L)``. ``for_text`` cuts them out of a model's padded batch output.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import NamedTuple

import torch
from torch import Tensor

from ._shapes import _check, _check_tokens
from .attribution import (
    METHODS,
    Attribution,
    ClassLogit,
    NextToken,
    Representation,
    attribute,
    estimate_bytes,
)
from .sinks import SINK_SHARE, Sinks, find_sinks, without_sinks

__all__ = [
    "METHODS",
    "SINK_SHARE",
    "Attribution",
    "ClassLogit",
    "HeadStats",
    "NextToken",
    "Representation",
    "Sinks",
    "Top",
    "attribute",
    "estimate_bytes",
    "find_sinks",
    "for_text",
    "head_stats",
    "rollout",
    "top_tokens",
    "without_sinks",
]


def for_text(weights: Sequence[Tensor], index: int, length: int) -> Tensor:
    """Stack per-layer batch weights [(B, H, L, L), ...] into (layers, H, n, n) for text
    ``index`` of the batch, keeping its first ``length`` (real) tokens."""
    if not weights:
        raise ValueError("weights must hold at least one layer. Received: an empty sequence")
    return torch.stack([w[index, :, :length, :length] for w in weights]).float()


@dataclass(frozen=True)
class HeadStats:
    """One value per (layer, head), each a (layers, H) tensor averaged over query tokens.

    entropy: of each query's weight distribution, in nats (0 = all weight on one token; log(L)
        = spread evenly).
    distance: expected |query position - key position| under the weights.
    special: share of weight on special tokens ([CLS], [SEP], ...).
    itself: share of weight on the query token itself.
    previous: share on the token just before (queries with one before it).
    next: share on the token just after (queries with one after it).
    """

    entropy: Tensor
    distance: Tensor
    special: Tensor
    itself: Tensor
    previous: Tensor
    next: Tensor

    def as_dict(self) -> dict[str, list[list[float]]]:
        """Plain nested lists, for JSON."""
        return {f.name: getattr(self, f.name).tolist() for f in fields(self)}


def head_stats(weights: Tensor, special: Sequence[bool] | Tensor | None = None) -> HeadStats:
    """Statistics of every head, from weights (layers, H, L, L) or (H, L, L) of one sequence.

    Args:
        weights: each query row sums to 1 (or is all 0 for a query that saw nothing).
        special: (L,) True for special tokens; default none.
    """
    w = _check(weights).double()
    n = w.shape[-1]
    pos = torch.arange(n, dtype=torch.float64)
    logs = torch.where(w > 0, w.log(), torch.zeros_like(w))
    entropy = -(w * logs).sum(-1).mean(-1)
    distance = (w * (pos[:, None] - pos[None, :]).abs()).sum(-1).mean(-1)
    if special is None:
        special_t = torch.zeros(n, dtype=torch.bool)
    else:
        special_t = torch.as_tensor(special, dtype=torch.bool)
        if special_t.shape != (n,):
            raise ValueError(
                f"special must have one flag per token, shape ({n},). "
                f"Received: special of shape {tuple(special_t.shape)}"
            )
    diag = w.diagonal(dim1=-2, dim2=-1)
    empty = torch.zeros(w.shape[:2], dtype=torch.float64)
    return HeadStats(
        entropy=entropy.float(),
        distance=distance.float(),
        special=w[..., special_t].sum(-1).mean(-1).float(),
        itself=diag.mean(-1).float(),
        previous=(w.diagonal(-1, -2, -1).mean(-1) if n > 1 else empty).float(),
        next=(w.diagonal(1, -2, -1).mean(-1) if n > 1 else empty).float(),
    )


class Top(NamedTuple):
    """One attended token: its position, text and weight."""

    index: int  # type: ignore[assignment]  # shadows tuple.index, as it always has
    token: str
    weight: float


def top_tokens(
    weights: Tensor, tokens: Sequence[str], query: int, k: int = 3
) -> list[list[list[Top]]]:
    """For query position ``query``: the ``k`` most attended tokens of every layer and head,
    as ``result[layer][head] = [Top, ...]`` (heaviest first)."""
    w = _check(weights)
    n = w.shape[-1]
    _check_tokens(tokens, n)
    if not 0 <= query < n:
        raise ValueError(f"query must be a position in [0, {n}). Received: query={query}")
    values, indices = w[:, :, query].topk(min(k, n), dim=-1)
    return [
        [
            [Top(int(i), tokens[int(i)], float(v)) for v, i in zip(vs, ix)]
            for vs, ix in zip(layer_v, layer_i)
        ]
        for layer_v, layer_i in zip(values, indices)
    ]


def rollout(
    weights: Tensor, *, residual: float = 0.5, sinks: Sequence[int] | None = None
) -> Tensor:
    """Attention rollout (Abnar & Zuidema, 2020, "Quantifying Attention Flow in Transformers").

    Each layer's heads are averaged, the residual connection is modelled as
    ``A' = residual * I + (1 - residual) * A`` (the paper uses 0.5), rows are renormalized, and
    the layers are multiplied from the first up: ``R = A'_last ... A'_2 A'_1``.

    With ``sinks`` (key positions, as ``find_sinks(...).positions``), each layer's head mean is
    first passed through ``without_sinks``: the sink columns set to 0 and the rows renormalized,
    so the weight a layer parks on a sink flows to the words instead of swallowing the product.
    A row whose weight was all on sinks (a causal model's first query) stays where it is: its
    row of the layer becomes the identity's.

    Returns:
        (L, L): row i says how much each input token flows into position i at the last layer;
        every row sums to 1. With ``sinks``, a sink column is 0 outside its own row.
    """
    w = _check(weights).double()
    if not 0.0 <= residual <= 1.0:
        raise ValueError(f"residual must be in [0, 1]. Received: residual={residual}")
    n = w.shape[-1]
    eye = torch.eye(n, dtype=torch.float64)
    result = eye
    for layer in w:
        mean = layer.mean(0)
        if sinks is not None:
            mean = without_sinks(mean, sinks)
            mean = mean + eye * (mean.sum(-1, keepdim=True) == 0)  # all on sinks: stays put
        a = residual * eye + (1.0 - residual) * mean
        a = a / a.sum(-1, keepdim=True).clamp_min(torch.finfo(a.dtype).tiny)
        result = a @ result
    return result.float()
