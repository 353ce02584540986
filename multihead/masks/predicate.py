"""``masks.predicate(fn)``: a mask from any vectorized predicate (FlexAttention's ``mask_mod``)."""

from __future__ import annotations

import torch

from .. import _validation as V
from .base import Mask, MaskMod

__all__ = ["predicate"]


class _Predicate(Mask):
    def __init__(
        self,
        fn: MaskMod,
        batch_size: int | None,
        num_heads: int | None,
        device: torch.device | str | None,
    ) -> None:
        if not callable(fn):
            raise TypeError(
                "predicate(fn) takes a function fn(b, h, q, k) -> bool tensor. "
                f"Received: an object of type {type(fn).__name__}"
            )
        for name, value in (("batch_size", batch_size), ("num_heads", num_heads)):
            if value is not None:
                V.check_positive_int(name, value)
        self.fn, self.batch_size, self.num_heads = fn, batch_size, num_heads
        self._home = None if device is None else torch.device(device)

    def mask_mod(self, length_q, length_k, *, device=None):
        return self.fn

    def _describe(self):
        name = getattr(self.fn, "__name__", type(self.fn).__name__)
        fixed = "".join(
            f", {label}={value}"
            for label, value in (("batch_size", self.batch_size), ("num_heads", self.num_heads))
            if value is not None
        )
        return f"predicate({name}{fixed})"


def predicate(
    fn: MaskMod,
    *,
    batch_size: int | None = None,
    num_heads: int | None = None,
    device: torch.device | str | None = None,
) -> Mask:
    """A mask from any predicate ``fn(b, h, q, k) -> bool`` (True = may attend).

    ``fn`` has the form of FlexAttention's ``mask_mod``: it receives integer index tensors that
    broadcast against each other (batch entry, head, query position, key position) and combines
    them elementwise, so one call answers a whole rectangle::

        window = masks.predicate(lambda b, h, q, k: (q - k).abs() <= 2)
        prefix_lm = masks.predicate(lambda b, h, q, k: (k <= q) | (k < 4))

    The answers backends use to skip work (which tiles are empty, full or partial) are computed
    by evaluating ``fn`` tile by tile once per (L, S), never on the whole L x S at once, and
    cached on the mask. It combines with ``&`` / ``|`` like every mask; a built-in kind that
    says the same thing (``causal``, ``sliding_window``) is faster, because it knows its tiles
    without evaluating anything.

    Args:
        fn: ``(b, h, q, k) -> bool tensor``, elementwise over broadcast index tensors. It may
            index tensors of its own (``ids[b, q] == ids[b, k]``); keep them on ``device``.
        batch_size: B when ``fn`` depends on the batch entry ``b``; None (default) means it
            does not, and ``b`` is always 0 outside FlexAttention.
        num_heads: H when ``fn`` depends on the head ``h``; None (default) means it does not.
        device: where the index tensors are made when the mask answers for itself (default:
            the CPU, or the device a backend asks for); the device of ``fn``'s own tensors.

    Raises:
        TypeError: ``fn`` is not callable, or returns something other than a bool tensor.
        ValueError: ``fn``'s result does not broadcast to the rectangle asked for.
    """
    return _Predicate(fn, batch_size, num_heads, device)
