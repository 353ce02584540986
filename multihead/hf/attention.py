"""The attention function registered with transformers' ``AttentionInterface``.

transformers calls it as every attention module calls its implementation: queries
(B, H, L, D) and keys/values (B, H_kv, S, D) after the projections and rotary embeddings, the
mask its mask interface made (here: the multihead ``Mask`` of ``make_mask``), and keywords
for what the architecture adds. It returns transformers' layout, the output (B, L, H, D_v) and
the softmax weights (B, H, L, S) or None. Every keyword a model passes becomes multihead's own
vocabulary, and one it cannot honour is refused by name: the function builds one ``Call``
(``backends.call.prepare``, the checks of ``multihead.attention``) and runs it through
``registry.run``. A call from a layer that an active block covers (``multihead.acting``:
capture, ablate, knockout, patch) runs the blocks' plan on that call through
``acting.run_plan``, as ``MultiHeadAttention`` does; a ``compress`` block, which keeps the
layer's cache, runs its layers' calls itself (``Compression.layer_calls``, here
``compress.attend``); the choice among these is ``acting.route``'s, which the library's own
``MultiHeadAttention`` reads too. A knockout on a sliding-window layer whose cache has slid
names positions, which are mapped to the columns the cache holds. A decoding step's call (one
query row) takes the short path of ``routes.attend``, to the same result.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from .. import acting
from .. import bias as mb
from .. import decoding_routes as routes
from ..backends import registry
from ..backends.call import prepare
from ..masks import Mask, dense
from ._transformers import collecting_attentions

__all__ = ["attention_forward"]

# keywords transformers' modules pass that do not change the result here: the mask already
# holds the sliding window, causality and packing (flash-attention's varlen arguments describe
# the same packing); the rest is bookkeeping of the surrounding model
_IGNORED = frozenset(
    {
        "sliding_window",
        "is_causal",
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
        "max_seqlen_q",
        "max_seqlen_k",
        "position_ids",
        "seq_idx",
        "deterministic",
        "use_cache",
        "cache_position",
        "past_key_values",
        "past_key_value",
        "position_embeddings",
        "output_hidden_states",
        "output_router_logits",
        "return_dict",
        "num_items_in_batch",
        "layer_idx",
        "token_type_ids",
        "use_top_left_mask",
    }
)


def attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Mask | Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
    s_aux: Tensor | None = None,
    position_bias: Tensor | None = None,
    output_attentions: bool | None = None,
    **kwargs: Any,
) -> tuple[Tensor, Tensor | None]:
    """transformers' attention interface on multihead's kernels.

    Args:
        module: the calling attention module (its layer is found for ``capture``).
        query: (B, H, L, D).
        key: (B, H_kv, S, D); grouped-query attention needs no repeated keys.
        value: (B, H_kv, S, D_v).
        attention_mask: what ``make_mask`` returned (a multihead ``Mask`` or None), or a
            tensor a caller prepared: bool (True = may attend) or float (0 where visible,
            the dtype's minimum or -inf where hidden, anything else added to the scores).
        dropout: dropout on the weights (transformers passes 0.0 outside training).
        scaling: multiplies the scores; None is 1 / sqrt(D).
        softcap: Gemma 2's logit cap, applied in the kernel (``multihead.bias.softcap``).
        s_aux: gpt-oss's sink logits (H,) (``multihead.bias.sinks``).
        position_bias: an additive (B|1, H, L, S) tensor (T5 and its relatives).
        output_attentions: return the weights of every head.

    Returns:
        (output (B, L, H, D_v) contiguous, weights (B, H, L, S) or None). The weights come
        from the same kernel call as the output; they are returned when
        ``output_attentions`` asks for them or transformers is collecting attentions.

    Raises:
        ValueError: a keyword that would change the result and that multihead cannot apply
            (named in the message), and every error ``multihead.attention`` raises.
    """
    _check_keywords(kwargs)
    plan = acting.plan_for(module)
    wants = _wants_weights(output_attentions)
    step = (
        not wants
        and (attention_mask is None or isinstance(attention_mask, Mask))
        and _decoding(query, key, value, dropout, position_bias, s_aux)
    )
    way = acting.route(plan, compressing=False, step=step)
    if way == "step":
        assert attention_mask is None or isinstance(attention_mask, Mask)
        return routes.attend(query, key, value, attention_mask, scaling, softcap), None
    mask, extra = _as_mask(attention_mask)
    bias = _bias(position_bias, extra, softcap, s_aux)
    if way == "compress":  # the block keeps the layer's cache
        assert plan is not None and plan.compress is not None
        layer_calls = plan.compress.layer_calls
        assert layer_calls is not None
        out = layer_calls(plan, module, query, key, value, mask, bias, scaling, float(dropout))
        return out, None
    call = prepare(query, key, value, mask, bias, scaling, float(dropout), wants)
    if way == "plan":
        assert plan is not None
        out, weights = acting.run_plan(plan, call, key_offset=_key_offset(plan, key, kwargs))
        return out.transpose(1, 2).contiguous(), weights
    ran, weights = registry.run(call, "auto")
    assert ran is not None
    return ran.transpose(1, 2).contiguous(), weights


def _key_offset(plan: acting.Plan, key: Tensor, kwargs: dict[str, Any]) -> int:
    """The position of the call's first key column: 0, except on a sliding-window layer whose
    cache has slid (transformers keeps its last W - 1 keys), where knockout's key positions
    are mapped to the columns the cache holds. The newest query's position is read from
    ``position_ids`` (its largest row: the row without left padding, whose positions are the
    cache's); the decoders with a sliding cache pass them, and a call without them (an
    encoder's local attention) has no cache."""
    if not plan.knockouts or kwargs.get("sliding_window") is None:
        return 0
    positions = kwargs.get("position_ids")
    if not isinstance(positions, Tensor) or positions.numel() == 0:
        return 0  # an encoder's local attention (ModernBERT): no cache, keys from position 0
    newest = int(positions[..., -1].max())
    return max(newest + 1 - key.shape[2], 0)


def _decoding(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    dropout: float,
    position_bias: Tensor | None,
    sinks: Tensor | None,
) -> bool:
    """A decoding step's call, which ``routes.attend`` takes with a multihead mask or none:
    nothing added to the scores (a cap may bend them), no dropout, and what
    ``routes.applies`` asks (one query row, no gradient, no graph being traced)."""
    return (
        position_bias is None
        and sinks is None
        and dropout == 0
        and routes.applies(query, key, value)
    )


def _check_keywords(kwargs: dict[str, Any]) -> None:
    for name, value in kwargs.items():
        if value is None or name in _IGNORED:
            continue
        raise ValueError(
            f"the multihead attention implementation cannot apply the keyword {name!r} that "
            "this model passes to its attention function; rather than compute a different "
            "result it stops here. Load the model with attn_implementation='eager' or 'sdpa'. "
            f"Received: {name}={_short(value)}"
        )


def _short(value: object) -> str:
    if isinstance(value, Tensor):
        return f"tensor of shape {tuple(value.shape)}"
    return repr(value)[:80]


def _as_mask(attention_mask: object) -> tuple[Mask | None, Tensor | None]:
    """(mask, additive part) from what transformers handed over."""
    if attention_mask is None or isinstance(attention_mask, Mask):
        return attention_mask, None
    if not isinstance(attention_mask, Tensor):
        raise TypeError(
            "attention_mask must be what multihead.hf's mask function made (a multihead Mask or "
            "None) or a 4-D tensor. Received: attention_mask of type "
            f"{type(attention_mask).__name__}"
        )
    if attention_mask.dim() != 4:
        raise ValueError(
            "a tensor attention_mask must be 4-D (B or 1, 1 or H, L, S), as transformers "
            f"prepares it. Received: attention_mask.shape={tuple(attention_mask.shape)}"
        )
    if attention_mask.dtype == torch.bool:
        return dense(attention_mask), None
    # transformers' float masks: 0 visible, the dtype's minimum (or -inf) hidden
    hidden = attention_mask <= torch.finfo(attention_mask.dtype).min / 2
    extra = torch.where(hidden, torch.zeros((), dtype=attention_mask.dtype), attention_mask)
    keep = dense(~hidden) if bool(hidden.any()) else None
    return keep, (extra if bool(extra.any()) else None)


def _bias(
    position_bias: Tensor | None, extra: Tensor | None, softcap: float | None, sinks: Tensor | None
) -> mb.ScoreModifier | None:
    terms: list[mb.ScoreModifier | Tensor] = [t for t in (position_bias, extra) if t is not None]
    if softcap is not None:
        terms.append(mb.softcap(float(softcap)))
    if sinks is not None:
        terms.append(mb.sinks(sinks))
    total: mb.ScoreModifier | None = None
    for t in terms:
        total = mb.as_modifier(t) if total is None else total + t
    return total


def _wants_weights(output_attentions: bool | None) -> bool:
    """Whether the caller reads the weights: asked for by keyword, or transformers is
    collecting attentions (``output_attentions`` in the config or the model's call)."""
    return bool(output_attentions) or collecting_attentions()
