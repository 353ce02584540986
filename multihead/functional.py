"""``attention()``: validate, normalize the mask, and hand the call to a backend."""

from __future__ import annotations

import torch
from torch import Tensor

from . import _validation as V
from . import bias as _bias
from .backends import registry, tiled
from .backends._call import prepare as _prepare
from .backends._nonfinite import run_guarded
from .masks import Mask

__all__ = ["attention", "attention_weights", "explain_backend"]


def attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Mask | Tensor | None = None,
    *,
    bias: Tensor | _bias.ScoreModifier | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    return_weights: bool = False,
    backend: str = "auto",
    **unexpected: object,
) -> Tensor | tuple[Tensor, Tensor]:
    """Scaled dot-product attention for every mask, on any backend.

    Efficient implementation equivalent to the following (``keep`` is the mask lowered to a
    bool tensor, True = may attend)::

        scores = query @ key.transpose(-2, -1) * scale + bias      # [B, H, L, S]
        scores = scores.masked_fill(~keep, -inf)
        weights = softmax(scores, dim=-1)
        weights = weights.where(keep.any(-1, keepdim=True), 0)     # no visible key -> 0
        out = dropout(weights, dropout_p) @ value                  # [B, H, L, D_v]

    Causal masks are bottom-right aligned by default (``masks.causal(align="top_left")`` gives
    PyTorch's ``is_causal``). For L = 2 queries and S = 5 keys::

        causal()                      causal(align="top_left")
        # # # # .                     # . . . .
        # # # # #                     # # . . .

    Args:
        query: (B, H, L, D).
        key: (B, H_kv, S, D). H_kv must divide H (grouped-query attention): with H=8, H_kv=2,
            query heads 0-3 read key/value head 0 and heads 4-7 read head 1.
        value: (B, H_kv, S, D_v).
        mask: a ``multihead.masks.Mask`` (True = may attend), a bool tensor (same as
            ``masks.dense(tensor)``), or None for no mask.
        bias: additive scores: a float tensor broadcastable to (B, H, L, S) (2-D must be
            exactly (L, S)), or a score modifier from ``multihead.bias`` (``alibi``,
            ``relative_buckets``, sums of them and tensors) that the fast backends compute
            per tile, never as an L x S tensor. Must be finite: blocking is the mask's job.
            It is added in float32 beside float32/bf16/fp16 inputs (float64 beside float64)
            on every backend, never rounded to a half-precision input dtype.
        scale: multiplies the scores; default 1 / sqrt(D).
        dropout_p: dropout on the weights, in [0, 1), drawn from torch's global generator.
        return_weights: also return the softmax weights (before dropout).
        backend: "auto" (fastest backend that honours the call), "tiled", "half" (bf16/fp16
            matmuls on CPU), "sdpa", "reference", "flex" (FlexAttention compiled from the
            mask; inference only on CPU), "fused" (the C++ kernel), or any name given to
            ``multihead.backends.register``. ``explain_backend`` says why each backend was
            or was not chosen.

    Returns:
        The output (B, H, L, D_v), or ``(output, weights)`` with weights (B, H, L, S) when
        ``return_weights=True``. A query row with no visible key outputs exactly 0, its weights
        are all 0 and its gradients are 0. NaN or Inf in a query row, or in a key or value
        that row may see, makes that row's output and weights NaN (corrupt data never looks
        healthy); non-finite values that no query may see never reach a result, so padding
        may hold garbage. L = 0 or S = 0 are allowed.

    Raises:
        TypeError: non-float inputs, int/float masks, mixed dtypes, a non-bool
            ``return_weights``, and SDPA keywords (``attn_mask``, ``is_causal``,
            ``enable_gqa``), each with the equivalent to use here.
        ValueError: shapes that do not fit, a mask or bias that does not fit (B, H, L, S),
            dropout_p outside [0, 1), or a backend that cannot honour the call.
    """
    V.reject_foreign_keywords("attention()", unexpected)
    call = _prepare(query, key, value, mask, bias, scale, dropout_p, return_weights)
    out, weights = run_guarded(registry.runner(call, backend), call)
    return (out, weights) if call.return_weights else out


def explain_backend(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Mask | Tensor | None = None,
    *,
    bias: Tensor | _bias.ScoreModifier | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    return_weights: bool = False,
    **unexpected: object,
) -> registry.Choice:
    """Which backend ``attention(..., backend="auto")`` would run, and why not the others.

    Takes the same arguments as ``attention`` and computes nothing. ``str(choice)`` prints one
    line per backend.
    """
    V.reject_foreign_keywords("explain_backend()", unexpected)
    call = _prepare(query, key, value, mask, bias, scale, dropout_p, return_weights)
    return registry.explain(call)


def attention_weights(
    query: Tensor,
    key: Tensor,
    mask: Mask | Tensor | None = None,
    *,
    bias: Tensor | _bias.ScoreModifier | None = None,
    scale: float | None = None,
    heads: slice | list[int] | None = None,
) -> Tensor:
    """Softmax attention weights (B, H, L, S), computed tile by tile; no values needed.

    Tiles the mask hides are never computed and stay 0; a query with no visible key has
    all-zero weights.

    Args:
        query: (B, H, L, D).
        key: (B, H_kv, S, D).
        mask, bias, scale: as in ``attention``.
        heads: only these query heads (a slice or list of indices); the matching key heads
            are picked for grouped-query attention. The result then has len(heads) heads.
    """
    _, h, h_kv, _, _, _ = V.check_qkv(query, key, key)  # before slicing: messages name all heads
    if heads is not None:
        index = torch.arange(h)[heads] if isinstance(heads, slice) else torch.as_tensor(heads)
        if index.dim() != 1 or index.numel() == 0 or not bool(((index >= 0) & (index < h)).all()):
            raise ValueError(
                f"heads must select query heads in [0, {h}). Received: heads={heads!r}"
            )
        key = key[:, index // (h // h_kv)]
        query = query[:, index]
        if (isinstance(mask, Mask) and mask.num_heads is not None) or (
            isinstance(mask, Tensor) and mask.dim() == 4 and mask.shape[1] != 1
        ):
            raise ValueError(
                "heads= cannot be combined with a mask that differs per head; slice the mask "
                "yourself. Received: a per-head mask"
            )
        if bias is not None:
            bias = _bias.as_modifier(bias).heads(index)
    call = _prepare(query, key, key, mask, bias, scale, 0.0, True)
    return run_guarded(lambda c: (None, tiled.weights(c)), call, values=False)[1]
