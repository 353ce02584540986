"""Attention sinks: the positions heads park their weight on when no other token is worth it
(the first token of a causal LM, Xiao et al. 2023; [CLS] and [SEP] in BERT, Clark et al. 2019),
found in one sequence's weights and set aside so the remaining weight says what a head reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ._shapes import _check

__all__ = ["SINK_SHARE", "Sinks", "find_sinks", "without_sinks"]

SINK_SHARE = 0.5  # a key taking half of a row's weight is where that row parks it


@dataclass(frozen=True)
class Sinks:
    """The sinks of one sequence and the heads that park on them.

    positions: the sink positions, ascending.
    reasons: for each position, why it is a sink ("the first token", "a special token", "at
        least 50% of the weight of most rows in most heads of layers 3-5, 8").
    mass: (layers, H) each head's share of the weight on the sinks, averaged over query rows.
    heads: (layers, H) True for a sink head: ``mass`` above ``share``.
    share: the threshold both rules used.
    """

    positions: tuple[int, ...]
    reasons: tuple[str, ...]
    mass: Tensor
    heads: Tensor
    share: float


def _check_share(share: float) -> float:
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
        raise ValueError(f"share must be in (0, 1]. Received: share={share!r}")
    return float(share)


def _layers_parking(w: Tensor, share: float) -> list[list[int]]:
    """For each key: the layers where more than half of the heads give it at least ``share``
    of the weight in more than half of the query rows. w: (layers, H, L, L) float64."""
    rows = (w >= share).double().mean(-2)  # (layers, H, L): share of rows parking on each key
    heads = (rows > 0.5).double().mean(1)  # (layers, L): share of heads doing so
    return [[int(x) for x in (heads[:, j] > 0.5).nonzero().flatten()] for j in range(w.shape[-1])]


def _spans(numbers: list[int]) -> str:
    """Ascending numbers written short: [2, 3, 4, 7, 9, 10] -> "2-4, 7, 9-10"."""
    runs: list[list[int]] = []
    for x in numbers:
        if runs and x == runs[-1][-1] + 1:
            runs[-1].append(x)
        else:
            runs.append([x])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def find_sinks(
    weights: Tensor, special: Sequence[bool] | Tensor | None = None, *, share: float = SINK_SHARE
) -> Sinks:
    """The attention sinks of one sequence's weights.

    A position is a sink when it is the first token, a special token (``special``), or when,
    in some layer, more than half of the heads give it at least ``share`` of the weight in more
    than half of the query rows (all L rows count, so in a causal model only a key among the
    first half can qualify: later rows are the only ones that see it). A head is a sink head
    when, averaged over its query rows, more than ``share`` of its weight lies on the sinks.

    Args:
        weights: (layers, H, L, L) or (H, L, L) of one sequence; each row sums to 1 (or is 0).
        special: (L,) True for the tokenizer's special tokens; default none.
        share: in (0, 1]; the threshold of both rules (default ``SINK_SHARE``, 0.5).

    Returns:
        A ``Sinks`` record.

    Raises:
        ValueError: weights of another shape, ``special`` of another length, or ``share``
            outside (0, 1].
    """
    share = _check_share(share)
    w = _check(weights).detach().double().cpu()
    n = w.shape[-1]
    flags = [False] * n if special is None else [bool(s) for s in torch.as_tensor(special)]
    if len(flags) != n:
        raise ValueError(
            f"special must have one flag per token, shape ({n},). Received: {len(flags)} flags"
        )
    parking = _layers_parking(w, share)
    positions, reasons = [], []
    for j in range(n):
        why = ["the first token"] if j == 0 else []
        why += ["a special token"] if flags[j] else []
        if parking[j]:
            why.append(
                f"at least {100 * share:.0f}% of the weight of most rows in most heads of "
                f"layer{'s' if len(parking[j]) > 1 else ''} {_spans(parking[j])}"
            )
        if why:
            positions.append(j)
            reasons.append(", ".join(why))
    mass = w[..., positions].sum(-1).mean(-1).float()
    return Sinks(tuple(positions), tuple(reasons), mass, mass > share, share)


def without_sinks(weights: Tensor, positions: Sequence[int]) -> Tensor:
    """The weights with the keys at ``positions`` set to 0 and each query row renormalized to
    sum to 1 over the other keys: what a head reads once its parked weight is set aside.

    Equivalent to (in float64, returned in the dtype of ``weights``)::

        kept = weights.clone(); kept[..., positions] = 0
        total = kept.sum(-1, keepdim=True)
        out = torch.where(total > 0, kept / total, 0)

    A row whose whole weight lay on the sinks (the first query of a causal model, which sees
    only itself) comes back all 0, as a fully-masked row does.

    Args:
        weights: (..., L, L), any leading dimensions (a layer's head mean, one head, every
            layer and head).
        positions: key positions in [0, L), as ``Sinks.positions``.

    Raises:
        ValueError: a position outside [0, L).
    """
    n = weights.shape[-1]
    bad = [p for p in positions if isinstance(p, bool) or not 0 <= int(p) < n]
    if bad:
        raise ValueError(f"sink positions must be in [0, {n}). Received: positions={bad}")
    kept = weights.detach().double().clone()
    kept[..., list(positions)] = 0.0
    total = kept.sum(-1, keepdim=True)
    out = torch.where(total > 0, kept / total.clamp_min(torch.finfo(torch.float64).tiny), 0.0)
    return out.to(weights.dtype)
