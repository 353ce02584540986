"""``attention()``: validate, normalize the mask, and hand the call to a backend.

``attention`` returns the output tensor and nothing else; ``attention_with_weights`` returns an
``AttentionOutput(output, weights)`` record, with the weights of every head or of the heads
asked for. No flag changes what a function returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import NamedTuple

from torch import Tensor

from . import _validation as V
from . import bias as _bias
from .backends import registry
from .backends.call import prepare as _prepare
from .backends.call import select_heads
from .backends.stat_names import check_stats
from .masks import Mask

__all__ = [
    "AttentionOutput",
    "attention",
    "attention_with_weights",
    "explain_backend",
    "select_heads",
]


class AttentionOutput(NamedTuple):
    """What ``attention_with_weights`` and every attention module's ``run`` return.

    output: the attention output, all heads ((B, H, L, D_v) from the function, (B, L, E) from
        a module).
    weights: softmax weights before dropout, (B, H, L, S), or (B, len(heads), L, S) in the
        order of ``heads`` when heads were chosen.
    """

    output: Tensor
    weights: Tensor


@V.torch_keywords("attention()")
def attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Mask | Tensor | None = None,
    *,
    bias: Tensor | _bias.ScoreModifier | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    backend: str = "auto",
) -> Tensor:
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
            on every backend, never rounded to a half-precision input dtype. Two
            non-additive modifiers join the sum: ``bias.softcap(cap)`` caps the scaled scores
            (``cap * tanh(s / cap)``, before the additive terms and the mask) and
            ``bias.sinks(logits)`` puts one logit per head in every row's softmax
            denominator; backends without them are not chosen.
        scale: multiplies the scores; default 1 / sqrt(D).
        dropout_p: dropout on the weights, in [0, 1), drawn from torch's global generator.
        backend: "auto" (fastest backend that honours the call), "tiled", "half" (bf16/fp16
            matmuls on CPU), "sdpa", "reference", "flex" (FlexAttention compiled from the
            mask; inference only on CPU), "fused" (the C++ kernel), or any name given to
            ``multihead.backends.register``. ``explain_backend`` says why each backend was
            or was not chosen.

    Returns:
        The output (B, H, L, D_v), always a tensor (the weights come from
        ``attention_with_weights``). A query row with no visible key outputs exactly 0 and its
        gradients are 0. NaN or Inf in a query row, or in a key or value that row may see,
        makes that row's output NaN (corrupt data never looks healthy); non-finite values that
        no query may see never reach a result, so padding may hold garbage. L = 0 or S = 0
        are allowed.

    Raises:
        TypeError: non-float inputs, int/float masks, mixed dtypes, and SDPA keywords
            (``attn_mask``, ``is_causal``, ``enable_gqa``), each with the equivalent to use
            here.
        ValueError: shapes that do not fit, a mask or bias that does not fit (B, H, L, S),
            dropout_p outside [0, 1), or a backend that cannot honour the call.
    """
    call = _prepare(query, key, value, mask, bias, scale, dropout_p, False)
    return _given(registry.run(call, backend)[0], "output")


def _given(t: Tensor | None, what: str) -> Tensor:
    """A result a backend must have returned (every backend returns the output, and the
    weights when the call asks for them)."""
    if t is None:
        raise RuntimeError(f"the attention backend returned no {what}; it must return it")
    return t


@V.torch_keywords("attention_with_weights()")
def attention_with_weights(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Mask | Tensor | None = None,
    *,
    bias: Tensor | _bias.ScoreModifier | None = None,
    scale: float | None = None,
    heads: list[int] | None = None,
    dropout_p: float = 0.0,
    backend: str = "auto",
) -> AttentionOutput:
    """``attention`` that also returns the softmax weights: ``AttentionOutput(output, weights)``.

    Args:
        query, key, value, mask, bias, scale, dropout_p, backend: as in ``attention``.
        heads: a non-empty list of distinct query-head indices in [0, H): the weights are
            computed for those heads only and returned in that order, (B, len(heads), L, S).
            The output still covers every head (computed on the fast path for all of them).
            None (default): every head's weights, (B, H, L, S).

    Returns:
        ``AttentionOutput(output, weights)``: output (B, H, L, D_v) as ``attention`` returns
        it; weights before dropout, all 0 in a query row with no visible key, NaN in a row
        whose output is NaN.

    Raises:
        TypeError, ValueError: as ``attention``; a ValueError for ``heads`` that are not a
            non-empty list of distinct ints in [0, H), and for a backend that cannot return
            weights (``explain_backend(..., weights=True)`` says which can).
    """
    call = _prepare(query, key, value, mask, bias, scale, dropout_p, True)
    if heads is not None:  # one pass where the backend computes chosen heads' weights alone
        call = replace(call, heads=tuple(check_heads(heads, call.shape[1])))
    out, weights = registry.run(call, backend)
    return AttentionOutput(_given(out, "output"), _given(weights, "weights"))


def check_heads(heads: object, num_heads: int) -> list[int]:
    """``heads`` as a list of distinct query-head indices in [0, H), or a clear ValueError."""
    return V.check_indices(
        "heads", heads, num_heads, kind="query-head", every="head", size=f"H={num_heads}"
    )


@V.torch_keywords("explain_backend()")
def explain_backend(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Mask | Tensor | None = None,
    *,
    bias: Tensor | _bias.ScoreModifier | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    weights: bool = False,
    stats: Sequence[str] | None = None,
    window: int | None = None,
) -> registry.Choice:
    """Which backend ``attention(..., backend="auto")`` would run, and why not the others;
    with ``weights=True``, which one ``attention_with_weights`` would run for the weights;
    with ``stats`` (and ``window``, as ``attention_stats`` takes them), which one folds
    those statistics into its pass, or where none can, which one's weights are reduced.

    Takes the same arguments as ``attention`` and computes nothing: no kernel is compiled and
    no backend is run or timed. A backend that leads only where it measured faster (the fused
    and half kernels) is judged by what this process measured for the call's shape class, and
    said to be untimed when nothing was (the first ``attention`` call of the class times it).
    ``str(choice)`` prints one line per backend.
    """
    call = _prepare(
        query, key, value, mask, bias, scale, dropout_p, V.check_bool("weights", weights)
    )
    if stats is not None:
        if weights:
            raise ValueError(
                "explain_backend takes weights=True or stats=..., not both: a call returns "
                "the weights or statistics of them. Received: weights=True, stats="
                f"{stats!r}"
            )
        call = replace(call, stats=check_stats(stats, window), window=window)
    return registry.explain(call)
