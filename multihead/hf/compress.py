"""``compress``: a transformers model's KV cache compressed by a ``multihead.kv`` policy, from
the scores its own attention calls compute.

Inside ``with multihead.hf.compress(model, SnapKV(0.25)) as kv: model.generate(...)`` the
prompt's attention call of each layer asks the kernel for the policy's statistic in the same
pass (SnapKV: ``window_mass``; H2O: ``key_mass``; TOVA: the last row's weights), and the
layer's cache is replaced at once by a ``CompressedLayer`` holding only the kept keys and
values (the memory is freed). Decoding steps run over the kept slots at the positions the
uncompressed sequence gives them: the cache reports the uncompressed length to transformers,
which therefore makes its masks and positions as without compression, and each mask is read
at the kept positions (``LayerState.slot_mask``). H2O and TOVA read each step's scores from
the same kernel call and evict back to the budget.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..acting import Compression, active, find, open_block
from ..kv import Policy
from . import compressing
from ._transformers import attn_implementation
from .capture import READER
from .registration import NAME

__all__ = ["Compression", "compress"]


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
def compress(model: nn.Module, policy: Policy) -> Iterator[Compression]:
    """Compress ``model``'s KV cache with ``policy`` while it runs.

    ::

        with torch.inference_mode(), multihead.hf.compress(model, SnapKV(0.25)) as kv:
            out = model.generate(**inputs, max_new_tokens=32)
        kv.kept[0]  # (B, H_kv, n): the positions layer 0's KV heads kept

    Every call that starts a cache (the prompt of ``generate``, or a forward with
    ``use_cache=True``) compresses each layer's cache right after its attention call, from
    the statistics that call computed; decoding steps append to the compressed cache and, for
    H2O, TOVA and StreamingLLM, evict back to the budget.

    Args:
        model: a transformers causal LM on ``attn_implementation="multihead"``.
        policy: a ``multihead.kv`` policy.

    Yields:
        A ``Compression`` record: ``kept`` (the positions each KV head keeps, per layer),
        ``states`` and ``nbytes``.

    Raises:
        TypeError: ``policy`` is not a policy record, ``model`` not a transformers model (the
            library's own decoders take ``KVCache(policy=)``).
        ValueError: a model not on "multihead", gradients enabled, a second compress block
            on the same model, and at the prompt's call a cache that cannot shrink (a static
            cache) or another block (capture, ablate, knockout, patch) acting on the same
            layer.
    """
    policy = _check_policy(policy)
    reader, found = find(model, "compress")
    if reader is not READER:
        raise TypeError(
            "compress takes a transformers model; the library's own decoders compress their "
            "KVCache themselves: generate(compress=policy) or KVCache(policy=policy). "
            f"Received: model of type {type(model).__name__}"
        )
    _check_model(model)
    block = Compression(None, len(found), policy=policy, layer_calls=compressing.attend)

    def remember(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        cache = kwargs.get("past_key_values", kwargs.get("past_key_value"))
        block._caches[module] = cache

    handles = [layer.register_forward_pre_hook(remember, with_kwargs=True) for layer in found]
    try:
        with open_block(model, block, reader, found):
            yield block
    finally:
        for handle in handles:
            handle.remove()
        block._caches.clear()
