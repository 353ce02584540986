"""``masks.predicate(fn)``: a mask from any vectorized predicate (FlexAttention's ``mask_mod``)."""

from __future__ import annotations

import inspect

import torch
from torch import Tensor

from .. import _validation as V
from .base import Mask, MaskMod, _evaluate

__all__ = ["predicate"]

# the index tensors ``fn`` is tried on when the mask is made: every index 0 (valid for any
# tensor ``fn`` indexes), a different size per axis, so the result's shape says which of
# b, h, q, k it depends on and a dimension that moved is caught
_PROBE = (2, 3, 5, 7)


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
        _check_function(fn, batch_size, num_heads, self._home)

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
    cached on the mask, as is the work list the kernels run from them: used again with the
    same shapes, a predicate that describes a band, causal documents or a window costs what
    the built-in kind costs (its work list reads no more keys). Only its first use per shape
    pays for evaluating ``fn`` (about 3 s at L = S = 16384 on two cores), where a built-in
    kind (``causal``, ``sliding_window``) knows its tiles without evaluating anything. A mask
    does not change once made: build a new one when the tensors ``fn`` reads change. It
    combines with ``&`` / ``|`` like every mask.

    ``fn`` is called once when the mask is made, on small index tensors (every index 0, a
    different size per axis): so a function of the wrong arity, one combining its conditions
    with Python's ``and`` instead of ``&``, or one returning no bool tensor is refused here, and
    the shape of its result tells whether it depends on ``b`` and ``h``.

    Args:
        fn: ``(b, h, q, k) -> bool tensor``, elementwise over broadcast index tensors. It may
            index tensors of its own (``ids[b, q] == ids[b, k]``); keep them on ``device``.
        batch_size: B, required when ``fn`` depends on the batch entry ``b``; None (default)
            when it does not.
        num_heads: H, required when ``fn`` depends on the head ``h``; None (default) when it
            does not.
        device: where the index tensors are made when the mask answers for itself (default:
            the CPU, or the device a backend asks for); the device of ``fn``'s own tensors.

    Raises:
        TypeError: ``fn`` is not callable, does not take four arguments, uses ``and`` / ``or``
            / ``not`` on tensors, or returns something other than a bool tensor.
        ValueError: ``fn``'s result does not broadcast to its index tensors' shape, or it
            depends on ``b`` (``h``) while ``batch_size`` (``num_heads``) is None: it would
            otherwise be evaluated for b = 0 (h = 0) alone.
    """
    return _Predicate(fn, batch_size, num_heads, device)


def _name(fn: object) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def _check_function(
    fn: MaskMod, batch_size: int | None, num_heads: int | None, device: torch.device | None
) -> None:
    """Call ``fn`` once on small index tensors: it takes (b, h, q, k), combines them
    elementwise into a bool tensor, and depends on b or h only where the mask knows B or H
    (else a backend would evaluate it for b = 0 and h = 0 alone: silently wrong)."""
    _check_arity(fn)
    b, h, q, k = (torch.zeros(n, dtype=torch.long, device=device) for n in _PROBE)
    try:
        keep = _evaluate(fn, b, h, q, k, _PROBE)
    except RuntimeError as err:
        if "Boolean value of Tensor" not in str(err):
            raise
        raise TypeError(
            "a mask predicate combines its conditions with & | ~ (elementwise), not with "
            "Python's and / or / not, which want a single True or False: write "
            "lambda b, h, q, k: (k <= q) & (k > q - 4), each comparison in parentheses. "
            f"Received: {_name(fn)} raised '{err}'"
        ) from None
    except ValueError as err:  # _evaluate's shape check, said for the probe
        shape = str(err).rsplit("Received: shape ", 1)[-1]
        raise ValueError(
            "a mask predicate must combine its index tensors elementwise (as FlexAttention's "
            "mask_mod): called with b, h, q, k of shapes (2, 1, 1, 1), (1, 3, 1, 1), "
            "(1, 1, 5, 1) and (1, 1, 1, 7), each dimension of its result must be 1 or that "
            f"index's size. Received: shape {shape}"
        ) from None
    _check_sizes(fn, keep, batch_size, num_heads)


def _check_sizes(fn: MaskMod, keep: Tensor, batch_size: int | None, num_heads: int | None) -> None:
    """Refuse a rule whose probe result varies along b or h when the mask does not know B or
    H (backends would evaluate it for b = 0 and h = 0 alone)."""
    unknown = [
        (letter, letter.upper() if letter == "b" else "H", name)
        for axis, letter, name, known in ((0, "b", "batch_size", batch_size),
                                          (1, "h", "num_heads", num_heads))
        if keep.shape[axis] != 1 and known is None
    ]  # fmt: skip
    if unknown:
        said = " and ".join(letter for letter, _, _ in unknown)
        raise ValueError(
            f"{_name(fn)} depends on {said} (its result varies along "
            f"{'those axes' if len(unknown) > 1 else 'that axis'}), so the mask must be told "
            f"{' and '.join(size for _, size, _ in unknown)}, or backends would evaluate it "
            f"for {' and '.join(f'{letter} = 0' for letter, _, _ in unknown)} alone: pass "
            f"predicate(fn, {', '.join(f'{name}={size}' for _, size, name in unknown)}) with "
            "the inputs' sizes. "
            f"Received: {', '.join(f'{name}=None' for _, _, name in unknown)}"
        )


def _check_arity(fn: MaskMod) -> None:
    if torch.compiler.is_compiling():  # dynamo cannot trace inspect; the probe's call remains
        return
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to read (some builtins): the call tells
        return
    try:
        signature.bind(0, 0, 0, 0)
    except TypeError:
        raise TypeError(
            "predicate(fn) takes a function of four index tensors, fn(b, h, q, k) -> bool "
            "tensor (batch entry, head, query position, key position), as FlexAttention's "
            f"mask_mod. Received: {_name(fn)}{signature}"
        ) from None
