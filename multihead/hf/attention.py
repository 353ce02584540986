"""The attention function registered with transformers' ``AttentionInterface``.

transformers calls it as every attention module calls its implementation: queries
(B, H, L, D) and keys/values (B, H_kv, S, D) after the projections and rotary embeddings, the
mask its mask interface made (here: the multihead ``Mask`` of ``make_mask``), and keywords
for what the architecture adds. It returns transformers' layout, the output (B, L, H, D_v) and
the softmax weights (B, H, L, S) or None. Underneath it is ``multihead.attention`` or
``attention_with_weights``: every keyword a model passes becomes multihead's own vocabulary,
and one it cannot honour is refused by name. A call from a layer that an active block
covers (``multihead.acting``: capture, ablate, knockout, patch) runs the blocks' plan through
``acting.run_plan``, as ``MultiHeadAttention`` does; ``compress``'s plan is this module's
own. A decoding step's call (one query row) takes the short path of ``decode_route.attend``, to the
same result.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from .. import acting, decode_route
from .. import bias as mb
from ..functional import attention, attention_with_weights
from ..masks import Mask, dense
from ..stats import attention_stats
from . import kv_cache
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
    plain = plan is None and not wants  # no block acts on the layer, no weights asked
    decoding = plain and _decoding(query, key, value, dropout, position_bias, s_aux)
    if decoding and (attention_mask is None or isinstance(attention_mask, Mask)):
        return decode_route.attend(query, key, value, attention_mask, scaling, softcap), None
    mask, extra = _as_mask(attention_mask)
    bias = _bias(position_bias, extra, softcap, s_aux)
    common: dict[str, Any] = {"bias": bias, "scale": scaling, "dropout_p": float(dropout)}
    if plan is not None and plan.compress is not None:
        _check_compressible(plan, position_bias, extra)
        return _compressed(plan, plan.compress, module, query, key, value, mask, common), None
    if plan is not None:
        out, weights = acting.run_plan(plan, query, key, value, mask, **common, weights=wants)
    elif wants:
        out, weights = attention_with_weights(query, key, value, mask, **common)
    else:
        out, weights = attention(query, key, value, mask, **common), None
    return out.transpose(1, 2).contiguous(), weights


def _compressed(
    plan: acting.Plan,
    block: acting.Compression,
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Mask | None,
    common: dict[str, Any],
) -> Tensor:
    """A call of a layer whose cache ``compress`` keeps: the prompt's call computes the
    policy's statistic in its own pass and compresses the cache; a call over the compressed
    cache reads the mask (made for the uncompressed sequence) at the kept positions and, for
    policies that evict as they decode, reads its scores from the same pass. Returns the
    output in transformers' layout (B, L, H, D_v)."""
    policy = block.policy
    assert policy is not None
    state = kv_cache.state_of(block, module, plan.layer)
    if state is None:  # the call that filled the cache: the prompt
        return _compress_prompt(block, plan.layer, module, query, key, value, mask, common)
    heads, length_q, stat = query.shape[1], query.shape[2], policy.prompt_stat
    dense_full = None if mask is None else mask.to_dense(length_q, state.total, device=key.device)
    if dense_full is not None and bool(dense_full.all()):
        dense_full = None  # a causal band over the whole cache: nothing to read per slot
    seen = state.slot_mask(dense_full, heads)
    slots = None if seen is None else dense(seen)
    if policy.evicts_while_decoding and stat is not None:
        step = "key_mass" if stat == "key_mass" else "window_mass"
        out, found = _with_stat(query, key, value, slots, common, step, 1)
        state.observe(kv_cache.grouped(found[step], key.shape[1]))
        return out.transpose(1, 2).contiguous()
    capped = common["bias"] is None or getattr(common["bias"], "label", None) == "softcap"
    if (
        slots is None
        and capped
        and common["dropout_p"] == 0
        and decode_route.applies(query, key, value)
    ):
        out = decode_route.attend(
            query, key, value, None, common["scale"], _softcap(common["bias"])
        )
    else:
        out = attention(query, key, value, slots, **common).transpose(1, 2).contiguous()
    state.shrink()
    return out


def _compress_prompt(
    block: acting.Compression,
    layer: int,
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Mask | None,
    common: dict[str, Any],
) -> Tensor:
    """The call that filled a layer's cache (the prompt): its output, with the policy's
    statistic from the same pass, and the cache replaced by its compressed form."""
    policy = block.policy
    assert policy is not None
    b, length_q, length_k = query.shape[0], query.shape[2], key.shape[2]
    stat, scores = policy.prompt_stat, None
    if stat is None:
        out = attention(query, key, value, mask, **common)
    else:
        out, found = _with_stat(query, key, value, mask, common, stat, getattr(policy, "window", 1))
        scores = found[stat]
    visible = _last_row_visible(mask, b, length_q, length_k, key.device)
    kv_cache.start(block, module, layer, key, value, scores, visible)
    return out.transpose(1, 2).contiguous()


def _with_stat(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Mask | None,
    common: dict[str, Any],
    stat: str,
    rows: int,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The output and one statistic of every head. ``key_mass`` comes from the kernel's
    statistics pass over every row; ``window_mass`` of the last ``rows`` of a longer call
    from the plain pass over every row and the statistics pass over those rows alone (the
    same rows' weights, at the cost of ``rows`` rows: SnapKV's 32 of a 4,000-token prompt)."""
    length_q, length_k = query.shape[2], key.shape[2]
    bias = common["bias"]
    capped = bias is None or getattr(bias, "label", None) == "softcap"  # the same for any rows
    if stat != "window_mass" or rows >= length_q or not capped:
        window = rows if stat == "window_mass" else None
        return attention_stats(
            query, key, value, mask, stats=[stat], window=window, bias=common["bias"],
            scale=common["scale"],
        )  # fmt: skip
    out = attention(query, key, value, mask, **common)
    first = length_q - rows  # the window's rows, every key; a soft-cap holds for any rows
    crop = (length_q, length_k, first, length_q, 0, length_k)
    part_mask = None if mask is None else mask.crop(*crop)
    _, found = attention_stats(
        query[:, :, first:], key, value, part_mask, stats=[stat], window=rows, bias=bias,
        scale=common["scale"],
    )  # fmt: skip
    return out, found


def _last_row_visible(
    mask: Mask | None, batch: int, length_q: int, length_k: int, device: torch.device
) -> Tensor:
    """(B, S) bool: the keys the prompt's last row may see in any head, which are the keys a
    later token may see (padding and keys past a sliding window are not)."""
    if mask is None:
        return torch.ones(batch, length_k, dtype=torch.bool, device=device)
    last = mask.crop(length_q, length_k, length_q - 1, length_q, 0, length_k)
    seen = last.to_dense(1, length_k, device=device)  # (B|1, H|1, 1, S)
    return seen.any(1)[:, 0].expand(batch, length_k)


def _softcap(modifier: Any) -> float | None:
    """The cap of a bias that is a soft-cap alone (what ``decode_route.attend`` takes)."""
    return None if modifier is None else float(modifier.cap)


def _check_compressible(
    plan: acting.Plan, position_bias: Tensor | None, extra: Tensor | None
) -> None:
    others = plan.capture is not None or plan.scales or plan.knockouts or plan.patches
    if others:
        raise ValueError(
            "compress does not combine with capture, ablate, knockout or patch on the same "
            "layer: run them in separate blocks. Received: another block acting on layer "
            f"{plan.layer} inside compress"
        )
    if position_bias is not None or extra is not None:
        raise ValueError(
            "compress reads the mask at the kept positions, which it cannot do for an additive "
            "position bias or a float attention mask. Received: "
            f"{'position_bias' if position_bias is not None else 'a float attention_mask'}"
        )


def _decoding(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    dropout: float,
    position_bias: Tensor | None,
    sinks: Tensor | None,
) -> bool:
    """A decoding step's call, which ``decode_route.attend`` takes with a multihead mask or none:
    nothing added to the scores (a cap may bend them), no dropout, and what
    ``decode_route.applies`` asks (one query row, no gradient, no graph being traced)."""
    return (
        position_bias is None
        and sinks is None
        and dropout == 0
        and decode_route.applies(query, key, value)
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
