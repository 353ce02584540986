"""Converters from other libraries' mask conventions: ``torch.nn.MultiheadAttention``'s
(True = blocked, float = added) and Keras's (1 = attend, (B, L, S) or (B, S)).

They build ordinary masks and never touch the protocol, so the core does not depend on them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .base import Mask, dense
from .kinds import key_padding

__all__ = ["TorchMasks", "from_keras", "from_torch"]


class TorchMasks(NamedTuple):
    """What ``from_torch`` returns: a mask (True = may attend) and an additive bias."""

    mask: Mask | None
    bias: Tensor | None


def _attn_mask_4d(attn_mask: object, num_heads: int | None) -> Tensor:
    """torch's (L, S) or (B * H, L, S) ``attn_mask`` as (1 or B, 1 or H, L, S)."""
    if not isinstance(attn_mask, Tensor) or attn_mask.dim() not in (2, 3):
        shape = tuple(attn_mask.shape) if isinstance(attn_mask, Tensor) else type(attn_mask)
        raise ValueError(
            f"attn_mask must be a 2-D (L, S) or 3-D (B * H, L, S) tensor. Received: {shape}"
        )
    if attn_mask.dim() == 2:
        return attn_mask[None, None]
    if num_heads is None:
        raise ValueError(
            "a 3-D attn_mask is laid out (B * H, L, S); pass num_heads=H to unpack it. "
            f"Received: attn_mask.shape={tuple(attn_mask.shape)}, num_heads=None"
        )
    if attn_mask.shape[0] % num_heads:
        raise ValueError(
            "the first dimension of a 3-D attn_mask must be B * num_heads. "
            f"Received: attn_mask.shape={tuple(attn_mask.shape)}, num_heads={num_heads}"
        )
    return attn_mask.reshape(-1, num_heads, *attn_mask.shape[1:])


def from_torch(
    *args: object,
    attn_mask: Tensor | None = None,
    key_padding_mask: Tensor | None = None,
    num_heads: int | None = None,
) -> TorchMasks:
    """Convert ``torch.nn.MultiheadAttention`` masks to this library's convention.

    In torch a bool ``True`` means *blocked* and a float mask is *added* to the scores. Here a
    bool True means *may attend* and additive terms travel separately as ``bias``. A float
    ``-inf`` becomes a masked position; other float values become the bias.

    Args:
        attn_mask: (L, S) or (B * H, L, S), bool or float. The 3-D form needs ``num_heads``.
        key_padding_mask: (B, S), bool (True = padding) or float (added to every query row).
        num_heads: H, needed to unpack a 3-D ``attn_mask``.

    Returns:
        ``TorchMasks(mask, bias)``; either may be None. Pass it whole where a mask is taken
        (``attention(q, k, v, masks.from_torch(...))``, ``mha(x, mask=masks.from_torch(...))``)
        or unpack it: ``m, bias = masks.from_torch(...); attention(q, k, v, m, bias=bias)``.

    Raises:
        TypeError: positional arguments. Both masks are keyword-only because a (B, S)
            ``key_padding_mask`` passed first would be read as an (L, S) ``attn_mask``.
    """
    if args:
        raise TypeError(
            "from_torch takes keyword arguments only: from_torch(attn_mask=..., "
            "key_padding_mask=...), because a (B, S) key_padding_mask and an (L, S) attn_mask "
            f"are easy to swap. Received: {len(args)} positional argument(s)"
        )
    parts: list[Mask] = []
    biases: list[Tensor] = []
    if attn_mask is not None:
        parts, biases = _split_torch_mask(
            _attn_mask_4d(attn_mask, num_heads), "attn_mask", parts, biases
        )
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, Tensor) or key_padding_mask.dim() != 2:
            raise ValueError(
                "key_padding_mask must be a 2-D (B, S) tensor. "
                f"Received: {getattr(key_padding_mask, 'shape', type(key_padding_mask))}"
            )
        if key_padding_mask.dtype == torch.bool:
            parts.append(key_padding(~key_padding_mask))
        else:
            parts, biases = _split_torch_mask(
                key_padding_mask[:, None, None, :], "key_padding_mask", parts, biases
            )
    mask = None
    for p in parts:
        mask = p if mask is None else mask & p
    bias = None
    for b in biases:
        bias = b if bias is None else bias + b
    return TorchMasks(mask, bias)


def _split_torch_mask(
    t: Tensor, name: str, parts: list[Mask], biases: list[Tensor]
) -> tuple[list[Mask], list[Tensor]]:
    if t.dtype == torch.bool:
        return parts + [dense(~t)], biases
    if not t.is_floating_point():
        raise TypeError(
            f"{name} must be bool (True = blocked) or float (additive), as in "
            f"torch.nn.MultiheadAttention. Received: {name}.dtype={t.dtype}"
        )
    if torch.isnan(t).any() or torch.isposinf(t).any():
        raise ValueError(f"{name} may hold finite values and -inf only. Received: NaN or +inf")
    blocked = torch.isneginf(t)
    if blocked.any():
        parts = parts + [dense(~blocked)]
    return parts, biases + [torch.where(blocked, torch.zeros((), dtype=t.dtype), t)]


def from_keras(attention_mask: Tensor) -> Mask:
    """Convert a Keras mask (True / 1 = attend) to a mask.

    Args:
        attention_mask: Keras ``MultiHeadAttention``'s ``attention_mask`` (B, L, S), or a
            (B, S) padding mask such as an ``Embedding(mask_zero=True)`` produces, which
            becomes ``key_padding`` (every query sees the same keys).
    """
    if not isinstance(attention_mask, Tensor):
        attention_mask = torch.as_tensor(attention_mask)
    if attention_mask.dim() not in (2, 3):
        raise ValueError(
            "a Keras mask has shape (B, L, S) (attention_mask) or (B, S) (padding). "
            f"Received: attention_mask.shape={tuple(attention_mask.shape)}"
        )
    if attention_mask.is_floating_point():
        raise TypeError(
            "a Keras attention_mask must be bool or integer (1 = attend). "
            f"Received: attention_mask.dtype={attention_mask.dtype}"
        )
    if attention_mask.dim() == 2:
        return key_padding(attention_mask != 0)
    return dense((attention_mask != 0)[:, None])
