"""The cache side of ``compress``: ``CompressedLayer``, a transformers cache layer over a
``multihead.kv.LayerState``, and ``holder``, which finds it for a call (or puts a new one in
place of transformers' layer at the call that fills the cache).

The layer reports the uncompressed length to transformers, which therefore makes positions and
masks as without compression; the attention function reads each mask at the kept positions.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn
from transformers.cache_utils import DynamicLayer

from ..acting import Compression
from ..kv import LayerState

__all__ = ["CompressedLayer", "holder", "keeps_window", "layer_index"]


class CompressedLayer(DynamicLayer):
    """A transformers cache layer over a ``LayerState``: it appends as ``DynamicLayer`` does,
    and reports the uncompressed length (so positions and masks are made as without
    compression)."""

    def __init__(self, state: LayerState | None, sliding: bool, old: Any = None) -> None:
        super().__init__()
        self.state = state
        self.is_sliding = sliding
        self.place: tuple[int, int] | None = None  # (layer index, layers), set by holder
        where = state.keys if state is not None else old.keys
        self.dtype, self.device = where.dtype, where.device
        self.is_initialized = True

    @property
    def keys(self) -> Tensor | None:
        state = self.__dict__.get("state")
        return None if state is None else state.keys

    @keys.setter
    def keys(self, value: Tensor | None) -> None:
        if self.__dict__.get("state") is not None and value is not None:
            self._filled().keys = value

    @property
    def values(self) -> Tensor | None:
        state = self.__dict__.get("state")
        return None if state is None else state.values

    @values.setter
    def values(self, value: Tensor | None) -> None:
        if self.__dict__.get("state") is not None and value is not None:
            self._filled().values = value

    def _filled(self) -> LayerState:
        if self.state is None:
            raise RuntimeError("a compressed cache layer was used before its first call ended")
        return self.state

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any):
        return self._filled().append(key_states, value_states)

    def get_seq_length(self) -> int:
        return self._filled().total

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._filled().total + query_length, 0

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError(
            "a compressed KV cache cannot be cropped (its slots are not the last positions). "
            f"Received: crop({tokens_to_remove})"
        )

    def batch_repeat_interleave(self, repeats: int) -> None:
        state = self._filled()
        for name in ("keys", "values", "positions", "scores", "ok"):
            value = getattr(state, name)
            if value is not None:
                setattr(state, name, value.repeat_interleave(repeats, dim=0))
        state.sinks_end = state.sinks_end.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: Tensor) -> None:
        state = self._filled()
        for name in ("keys", "values", "positions", "scores", "ok", "sinks_end"):
            value = getattr(state, name)
            if value is not None:
                setattr(state, name, value[indices])


def layer_index(module: nn.Module, layer: int) -> int:
    """The cache layer of an attention module: its ``layer_idx`` where it has one."""
    index = getattr(module, "layer_idx", None)
    return index if isinstance(index, int) else layer


def holder(block: Compression, module: nn.Module, layer: int) -> CompressedLayer | None:
    """The ``CompressedLayer`` this call's cache holds for the layer; at the call that fills
    it (a transformers ``DynamicLayer`` there), a new one without a state yet, put in its
    place. None where the call has no cache or the layer keeps transformers' own window cache
    (``keeps_window``)."""
    cache = block.cache_of(module)
    if cache is None:
        return None
    index = layer_index(module, layer)
    if index >= len(cache.layers) or keeps_window(cache, index):
        return None
    found = cache.layers[index]
    if isinstance(found, CompressedLayer):
        return found
    if not isinstance(found, DynamicLayer):
        raise ValueError(
            "compress shrinks the KV cache's tensors, which a static cache cannot do (its "
            "size is fixed when it is made): use generate()'s default dynamic cache. "
            f"Received: a cache layer of type {type(found).__name__}"
        )
    pending = CompressedLayer(None, bool(getattr(found, "is_sliding", False)), found)
    pending.place = (index, block.num_layers)  # for budgets that differ between layers
    cache.layers[index] = pending
    return pending


def keeps_window(cache: Any, index: int) -> bool:
    """Whether cache layer ``index`` is a sliding-window layer of a model that also has global
    layers: it keeps transformers' window cache, and the policy's budget goes to the global
    layers."""
    sliding = getattr(cache, "is_sliding", None)
    if not isinstance(sliding, list) or not sliding or all(sliding):
        return False
    return index < len(sliding) and bool(sliding[index])
