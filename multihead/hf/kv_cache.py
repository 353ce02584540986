"""The cache side of ``compress``: ``CompressedLayer``, a transformers cache layer over a
``multihead.kv.LayerState``, and the two steps the attention function takes with it (``start``
after the prompt's call, ``state_of`` for a call over a compressed cache).

The layer reports the uncompressed length to transformers, which therefore makes positions and
masks as without compression; the attention function reads each mask at the kept positions.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn
from transformers.cache_utils import DynamicLayer

from ..acting import Compression
from ..kv import LayerState, grouped

__all__ = ["CompressedLayer", "grouped", "layer_index", "start", "state_of"]


class CompressedLayer(DynamicLayer):
    """A transformers cache layer over a ``LayerState``: it appends as ``DynamicLayer`` does,
    and reports the uncompressed length (so positions and masks are made as without
    compression)."""

    def __init__(self, state: LayerState, sliding: bool) -> None:
        super().__init__()
        self.state = state
        self.is_sliding = sliding
        self.dtype, self.device = state.keys.dtype, state.keys.device
        self.is_initialized = True

    @property
    def keys(self) -> Tensor | None:
        state = self.__dict__.get("state")
        return None if state is None else state.keys

    @keys.setter
    def keys(self, value: Tensor | None) -> None:
        if "state" in self.__dict__ and value is not None:
            self.state.keys = value

    @property
    def values(self) -> Tensor | None:
        state = self.__dict__.get("state")
        return None if state is None else state.values

    @values.setter
    def values(self, value: Tensor | None) -> None:
        if "state" in self.__dict__ and value is not None:
            self.state.values = value

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any):
        return self.state.append(key_states, value_states)

    def get_seq_length(self) -> int:
        return self.state.total

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.state.total + query_length, 0

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError(
            "a compressed KV cache cannot be cropped (its slots are not the last positions). "
            f"Received: crop({tokens_to_remove})"
        )

    def batch_repeat_interleave(self, repeats: int) -> None:
        state = self.state
        for name in ("keys", "values", "positions", "scores", "ok"):
            value = getattr(state, name)
            if value is not None:
                setattr(state, name, value.repeat_interleave(repeats, dim=0))
        state.sinks_end = state.sinks_end.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: Tensor) -> None:
        state = self.state
        for name in ("keys", "values", "positions", "scores", "ok", "sinks_end"):
            value = getattr(state, name)
            if value is not None:
                setattr(state, name, value[indices])


def layer_index(module: nn.Module, layer: int) -> int:
    """The cache layer of an attention module: its ``layer_idx`` where it has one."""
    index = getattr(module, "layer_idx", None)
    return index if isinstance(index, int) else layer


def start(
    block: Compression,
    module: nn.Module,
    layer: int,
    key: Tensor,
    value: Tensor,
    scores: Tensor | None,
    valid: Tensor,
) -> None:
    """After the call that filled a layer's cache: replace it by its compressed form."""
    cache = block.cache_of(module)
    if cache is None:
        return
    index = layer_index(module, layer)
    old = cache.layers[index]
    if not isinstance(old, DynamicLayer):
        raise ValueError(
            "compress shrinks the KV cache's tensors, which a static cache cannot do (its "
            "size is fixed when it is made): use generate()'s default dynamic cache. "
            f"Received: a cache layer of type {type(old).__name__}"
        )
    assert block.policy is not None
    kv_scores = None if scores is None else grouped(scores, key.shape[1])
    state = LayerState.from_prompt(block.policy, key, value, kv_scores, valid)
    cache.layers[index] = CompressedLayer(state, bool(getattr(old, "is_sliding", False)))
    block.states[layer] = state


def state_of(block: Compression, module: nn.Module, layer: int) -> LayerState | None:
    """The compressed state this call's cache holds for the layer, or None (a new cache)."""
    cache = block.cache_of(module)
    if cache is None:
        return None
    index = layer_index(module, layer)
    if index >= len(cache.layers):
        return None
    found = cache.layers[index]
    return found.state if isinstance(found, CompressedLayer) else None
