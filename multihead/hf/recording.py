"""What a running ``capture`` records, read by the attention function: the captures active in
this context, which layer a calling module belongs to, and the weights kept for it.
``capture.py`` opens and closes a capture; ``attention.py`` asks ``heads_for`` and calls
``record`` (neither needs the other).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Literal

from torch import Tensor, nn

__all__ = ["Capture", "heads_for", "record", "recording"]


@dataclass
class Capture:
    """What ``capture`` records.

    Attributes:
        layers: the chosen layer indices (None: all), counted from 0 as in the model's config.
        heads: the chosen query heads in the order given (None: all).
        num_layers: how many self-attention layers the model has.
        weights: ``{layer: Tensor (B, len(heads), L, S)}``, the softmax weights of the last
            forward that ran the layer (before dropout, detached from autograd).
    """

    layers: list[int] | None
    heads: list[int] | None
    num_layers: int
    weights: dict[int, Tensor] = field(default_factory=dict)
    _owner: dict[nn.Module, int] = field(default_factory=dict, repr=False)


_ACTIVE: ContextVar[tuple[Capture, ...]] = ContextVar("multihead_hf_captures", default=())


def _match(module: nn.Module) -> tuple[Capture, int] | None:
    for cap in reversed(_ACTIVE.get()):
        layer = cap._owner.get(module)
        if layer is not None and (cap.layers is None or layer in cap.layers):
            return cap, layer
    return None


def heads_for(module: nn.Module) -> list[int] | Literal["all"] | None:
    """The heads to record for a call from ``module``: a list, "all", or None (no capture)."""
    hit = _match(module)
    if hit is None:
        return None
    return "all" if hit[0].heads is None else hit[0].heads


def record(module: nn.Module, weights: Tensor) -> None:
    """Keep ``weights`` (B, len(heads), L, S) for the layer ``module`` belongs to."""
    hit = _match(module)
    if hit is not None:
        hit[0].weights[hit[1]] = weights.detach()


@contextlib.contextmanager
def recording(cap: Capture) -> Iterator[None]:
    """``cap`` records while the block runs (inside any capture already active)."""
    token = _ACTIVE.set((*_ACTIVE.get(), cap))
    try:
        yield
    finally:
        _ACTIVE.reset(token)
