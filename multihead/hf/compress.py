"""``compress``: a transformers model's KV cache compressed by a ``multihead.kv`` policy, from
the scores its own attention calls compute, and the calls of the layers it covers.

Inside ``with multihead.hf.compress(model, SnapKV(0.25)) as kv: model.generate(...)`` every
call of a covered layer goes through ``multihead.kv``'s protocol: ``kv.request`` says which
statistic the call computes in the same kernel pass as its output (SnapKV: ``window_mass`` of
the last rows; H2O: ``key_mass``; TOVA: the last row's weights), and the layer's
``LayerState.observe`` takes it and cuts the cache back to the budget. The prompt's call (or
its first chunk) replaces the layer's cache by a ``CompressedLayer`` holding only the kept keys
and values (the memory is freed); later chunks and decoding steps run over the kept slots at
the positions the uncompressed sequence gives them: the cache reports the uncompressed length
to transformers, which therefore makes its masks and positions as without compression, and
each mask is read at the kept positions (``LayerState.slot_mask``).

With ``chunk=N`` the model's forward runs a long input N tokens at a time on the same cache,
with logits for the last position only, so a prompt's memory above the weights grows with the
budget and N rather than with the prompt. In a model with both sliding-window and global
layers (Gemma 2 and 3) the sliding layers keep transformers' own window cache and nothing
else; the policy's budget applies to the global layers, the only ones whose cache grows.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from .. import acting
from ..acting import Compression, active, compressed, find, open_block
from ..bias import ScoreModifier
from ..kv import LayerState, Policy, Reconstruction, grouped, request
from ..masks import Mask
from . import kv_cache
from ._transformers import attn_implementation
from .reader import READER
from .registration import NAME

__all__ = ["Compression", "attend", "compress", "compress_context"]


def _check_policy(policy: object) -> Policy:
    if not isinstance(policy, Policy):
        raise TypeError(
            "compress takes a multihead.kv policy record (SnapKV, H2O, TOVA, StreamingLLM). "
            f"Received: policy of type {type(policy).__name__}"
        )
    return policy


def _check_model(model: nn.Module) -> None:
    found = attn_implementation(model)
    if found != NAME:
        raise ValueError(
            "compress reads the scores from multihead's attention kernel: load the model with "
            'attn_implementation="multihead" (or call model.set_attn_implementation("multihead") '
            f"after import multihead.hf). Received: a model on {found!r}"
        )
    if torch.is_grad_enabled():
        raise ValueError(
            "compress changes the KV cache in place and is for inference: run it under "
            "torch.no_grad() or torch.inference_mode() (generate() does). "
            "Received: gradients enabled"
        )
    for block in active():
        if isinstance(block, Compression) and block._model is model:
            raise ValueError(
                "this model already runs inside a compress block: one policy at a time. "
                f"Received: a second compress block with {block.policy!r} active"
            )


@contextlib.contextmanager
def compress(
    model: nn.Module, policy: Policy, *, chunk: int | None = None
) -> Iterator[Compression]:
    """Compress ``model``'s KV cache with ``policy`` while it runs.

    ::

        with torch.inference_mode(), multihead.hf.compress(model, SnapKV(0.25), chunk=512) as kv:
            out = model.generate(**inputs, max_new_tokens=32)
        kv.kept[5]  # (B, H_kv, n): the positions layer 5's KV heads kept

    Every call that starts a cache (the prompt of ``generate``, or a forward with
    ``use_cache=True``) compresses each layer's cache right after its attention call, from
    the statistics that call computed; decoding steps append to the compressed cache and, for
    H2O, TOVA and StreamingLLM, evict back to the budget. A fractional ``keep`` counts every
    token seen (prompt and generated), so ``keep=1.0`` never evicts.

    Args:
        model: a transformers causal LM on ``attn_implementation="multihead"``.
        policy: a ``multihead.kv`` policy.
        chunk: run every forward of more than ``chunk`` tokens (the prompt) ``chunk`` tokens
            at a time on one cache, each layer cut back to the budget after each chunk from
            that chunk's statistics (SnapKV's window: the chunk's last rows; H2O adds up; a
            forward without a cache gets a ``DynamicCache``). The output then holds the
            logits of the last position only. None (default): the prompt runs whole.

    Yields:
        A ``Compression`` record: ``kept`` (the positions each KV head keeps, per layer),
        ``states`` and ``nbytes``.

    Raises:
        TypeError: ``policy`` is not a policy record, ``model`` not a transformers model (the
            library's own decoders take ``generate(compress=, chunk=)``).
        ValueError: a model not on "multihead", gradients enabled, a second compress block
            on the same model, a ``chunk`` that is not an int >= 1, and at the prompt's call
            a cache that cannot shrink (a static cache) or another block (capture, ablate,
            knockout, patch) acting on the same layer; with ``chunk``, a forward that asks
            for every position's attentions or hidden states, or a 4-D attention mask.
    """
    policy = _check_policy(policy)
    reader, found = find(model, "compress")
    if reader is not READER:
        raise TypeError(
            "compress takes a transformers model; the library's own decoders compress their "
            "KVCache themselves: generate(compress=policy, chunk=N) or KVCache(policy=policy). "
            f"Received: model of type {type(model).__name__}"
        )
    _check_model(model)
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"chunk must be an int >= 1 (tokens a prompt chunk). Received: {chunk!r}")
    block = Compression(None, len(found), policy=policy, layer_calls=attend)

    def remember(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        cache = kwargs.get("past_key_values", kwargs.get("past_key_value"))
        block._caches[module] = cache

    handles = [layer.register_forward_pre_hook(remember, with_kwargs=True) for layer in found]
    own = "forward" in model.__dict__
    if chunk is not None:
        model.forward = _chunked(model, model.forward, chunk)
    try:
        with open_block(model, block, reader, found):
            yield block
    finally:
        for handle in handles:
            handle.remove()
        if chunk is not None:
            if own:
                model.forward = model.forward.__wrapped__  # type: ignore[attr-defined]
            else:
                del model.forward
        block._caches.clear()


def compress_context(
    model: nn.Module, input_ids: Tensor, policy: Policy, *, repeat_ids: Tensor | None = None
) -> Any:
    """A context compressed once, before any question: a transformers ``DynamicCache`` whose
    layers hold the kept keys and values of ``input_ids`` (B, S), to run questions on under
    ``compress(model, policy)`` (pass it as ``past_key_values``; each question changes it, so
    copy it with ``copy.deepcopy`` to ask several).

    ``kv.Reconstruction`` is scored by a second reading: after the context, the model reads
    ``repeat_ids`` (a request to repeat it, e.g. the ids of "Repeat the text above exactly.")
    and the context again, on the full cache; each context key's score is the attention the
    second reading's rows give it (``window_mass`` over those rows, grouped by KV head); then
    the second reading is cropped off and every layer cut to its budget. It costs the second
    reading: about one prompt more. Any other policy ranks by its own statistic of the
    context's pass (SnapKV: the context's last ``window`` rows), which knows no question.

    Args:
        model: a transformers causal LM on "multihead", with no sliding-window layer.
        input_ids: (B, S) the context, unpadded.
        policy: a ``multihead.kv`` policy.
        repeat_ids: (B, R) or (1, R) ids read between the two readings (Reconstruction only;
            default none).

    Raises:
        TypeError, ValueError: as ``compress``; a model with sliding-window layers (their
            caches keep a window, not the context).
    """
    from transformers import DynamicCache

    policy = _check_policy(policy)
    _check_model(model)
    _refuse_windows(model)
    cache: Any = DynamicCache()
    scores = _context_scores(model, input_ids, policy, repeat_ids, cache)
    batch, length = input_ids.shape
    valid = torch.ones(batch, length, dtype=torch.bool, device=input_ids.device)
    layers = []
    for index, layer in enumerate(cache.layers):
        kv_scores = None if scores is None else grouped(scores[index], layer.keys.shape[1])
        # the context's own slots (a second reading's are left out: its cache is let go)
        keys, values = layer.keys[:, :, :length], layer.values[:, :, :length]
        state = LayerState.from_prompt(policy, keys.contiguous(), values.contiguous(), kv_scores,
                                       valid, place=(index, len(cache.layers)))  # fmt: skip
        layers.append(kv_cache.CompressedLayer(state, False))
    cache.layers = layers
    return cache


def _refuse_windows(model: nn.Module) -> None:
    config = getattr(model, "config", None)
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None) or ["sliding_attention"]
    if window and any(t != "full_attention" for t in types):
        raise ValueError(
            "compress_context keeps every layer's cache of the whole context; a model whose "
            "layers attend through a sliding window keeps only the window: use "
            f"compress(model, policy, chunk=N). Received: sliding_window={window}"
        )


def _context_scores(model: nn.Module, input_ids: Tensor, policy: Policy,
                    repeat_ids: Tensor | None, cache: Any) -> list[Tensor] | None:  # fmt: skip
    """The context's pass on ``cache`` and, per layer, the (B, H, S) scores ``policy`` ranks
    the context's keys by: its own statistic of that pass, or Reconstruction's second
    reading (``repeat_ids`` and the context again, on the full cache)."""
    batch, length = input_ids.shape
    need = request(policy, None, length)
    stat = None if need is None or isinstance(policy, Reconstruction) else need[0]
    if stat is not None and need is not None:
        with acting.capture(model, stats=[stat], window=need[1]) as head:
            model(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return [head.stats[i][stat] for i in range(head.num_layers)]
    model(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    if not isinstance(policy, Reconstruction):
        return None
    second = input_ids
    if repeat_ids is not None:
        second = torch.cat([repeat_ids.expand(batch, -1).to(input_ids), input_ids], 1)
    with acting.capture(model, stats=["window_mass"], window=length) as reread:
        model(input_ids=second, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return [reread.stats[i]["window_mass"][..., :length] for i in range(reread.num_layers)]


# the inputs of a causal LM's forward that run along the sequence: cut to each chunk
_ALONG = ("input_ids", "inputs_embeds", "position_ids", "token_type_ids")


def _chunked(model: nn.Module, forward: Callable[..., Any], chunk: int) -> Callable[..., Any]:
    """``forward`` that runs an input longer than ``chunk`` tokens a chunk at a time on one
    cache, with the last position's logits only."""

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if args:  # transformers' forward takes input_ids first
            kwargs = {"input_ids": args[0], **kwargs}
            args = args[1:]
        seq = kwargs.get("input_ids")
        seq = kwargs.get("inputs_embeds") if seq is None else seq
        if args or seq is None or seq.shape[1] <= chunk or kwargs.get("use_cache") is False:
            return forward(*args, **kwargs)
        _check_chunked_call(kwargs)
        if kwargs.get("past_key_values") is None:
            from transformers import DynamicCache

            kwargs["past_key_values"] = DynamicCache(config=getattr(model, "config", None))
        length, out = seq.shape[1], None
        for start in range(0, length, chunk):
            end = min(start + chunk, length)
            part = dict(kwargs, logits_to_keep=1, use_cache=True)
            for name in _ALONG:
                if kwargs.get(name) is not None:
                    part[name] = kwargs[name][:, start:end]
            if kwargs.get("cache_position") is not None:
                part["cache_position"] = kwargs["cache_position"][start:end]
            if kwargs.get("attention_mask") is not None:
                mask = kwargs["attention_mask"]  # (B, past + L): everything up to the chunk's end
                part["attention_mask"] = mask[:, : mask.shape[1] - length + end]
            out = forward(**part)
        return out

    return run


def _check_chunked_call(kwargs: dict[str, Any]) -> None:
    for name in ("output_attentions", "output_hidden_states"):
        if kwargs.get(name):
            raise ValueError(
                f"compress(chunk=) runs a long input in chunks and keeps the last position's "
                f"logits only; it cannot return every position's {name[7:]}. Run without "
                f"chunk, or without {name}. Received: {name}=True"
            )
    mask = kwargs.get("attention_mask")
    if mask is not None and mask.dim() != 2:
        raise ValueError(
            "compress(chunk=) cuts a 2-D attention mask (B, length) to each chunk; a 4-D mask "
            f"cannot be cut. Received: attention_mask of shape {tuple(mask.shape)}"
        )


def attend(
    plan: acting.Plan,
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Mask | None,
    bias: ScoreModifier | None,
    scale: float | None,
    dropout: float,
) -> Tensor:
    """A call of a layer that a ``compress`` block covers, as the bridge's attention function
    hands it over (``Compression.layer_calls``), in transformers' layout (B, L, H, D_v): the
    layer's cache is found (or, at the call that fills it, replaced by a ``CompressedLayer``)
    and the call goes down to ``acting.compressed.run`` once. A sliding layer of a model with
    global layers keeps transformers' window cache, and a call without a cache attends
    plainly."""
    block = plan.compress
    assert block is not None and block.policy is not None
    _check_alone(plan)
    holder = kv_cache.holder(block, module, plan.layer)
    out = compressed.run(block.policy, holder, query, key, value, mask, bias, scale, dropout)
    if holder is not None and holder.state is not None:
        block.states[plan.layer] = holder.state
    return out


def _check_alone(plan: acting.Plan) -> None:
    """Refuse the other blocks on the layer: ``compress`` keeps its cache alone."""
    if plan.capture is not None or plan.scales or plan.knockouts or plan.patches:
        raise ValueError(
            "compress does not combine with capture, ablate, knockout or patch on the same "
            "layer: run them in separate blocks. Received: another block acting on layer "
            f"{plan.layer} inside compress"
        )
