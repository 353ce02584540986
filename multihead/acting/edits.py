"""Acting on attention inside a model (a transformers model or one of the library's own):
``ablate`` (scale chosen heads' outputs), ``knockout`` (block attention between positions,
inside the kernel) and ``patch`` (run chosen heads with weights captured earlier). Each is a
context manager that opens a block the model's attention reads per call, like ``capture``;
blocks nest and combine.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence

import torch
from torch import Tensor, nn

from .. import masks
from ..functional import check_heads
from .blocks import Capture, Edit, active
from .capture import check_layers, open_block
from .readers import Reader, find

__all__ = ["ablate", "knockout", "patch", "scaled"]


def _heads_of(model: nn.Module, reader: Reader, what: str) -> int:
    count = reader.num_heads(model)
    if count is None:
        raise ValueError(
            f"{what} needs the model's head count, which it does not give (a transformers "
            "config's num_attention_heads, or one num_heads shared by every MultiHeadAttention "
            "layer). Received: a model without one head count"
        )
    return count


def _check_scale(scale: object) -> float:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite float (0 ablates). Received: scale={scale!r}")
    return float(scale)


def _check_head_map(heads: object, layers: int, count: int) -> dict[int, list[int]]:
    """``{layer: [head, ...]}`` checked: layers and heads that exist, no repeats."""
    if not isinstance(heads, Mapping) or not heads:
        raise ValueError(
            "heads must be a non-empty dict {layer: [head, ...]} (layers and heads counted "
            f"from 0). Received: heads={heads!r}"[:300]
        )
    chosen = check_layers(list(heads), layers)
    assert chosen is not None  # a non-empty list of layers
    return {layer: check_heads(heads[layer], count) for layer in chosen}


def _conflicts(kind: str, model: nn.Module, covered: frozenset[tuple[int, int]]) -> None:
    """Refuse a block that would decide again what an active block of the same kind on the
    same model already decides for a (layer, head)."""
    for block in active():
        if not isinstance(block, Edit) or block.kind != kind or block._model is not model:
            continue
        both = sorted(covered & block.targets)
        if both:
            raise ValueError(
                f"this {kind} block conflicts with an active {kind} block on the same model: "
                "both set (layer, head) pairs "
                f"{both[:5]}; close the outer block first or merge them into one. "
                f"Received: a nested {kind} over {both[:5]}"
            )


@contextlib.contextmanager
def ablate(
    model: nn.Module, heads: Mapping[int, Sequence[int]], *, scale: float = 0.0
) -> Iterator[Edit]:
    """Multiply the outputs of chosen heads by ``scale`` while ``model`` runs.

    ::

        with multihead.acting.ablate(model, {3: [0, 5], 7: [2]}):
            loss = model(**inputs, labels=labels).loss

    A head's output is its weighted sum of values, before the output projection, so scale 0
    removes the head as transformers 4's ``head_mask`` did, and any other float scales it. It
    costs one multiplication of the attention output; the kernel runs as without the block.

    Args:
        model: a transformers model or one of the library's own (as ``capture`` takes it).
        heads: ``{layer: [head, ...]}``, layers counted from 0 as in ``capture`` and heads as
            the model's query heads.
        scale: the factor (0.0: ablate).

    Yields:
        The block's ``Edit`` record.

    Raises:
        TypeError: ``model`` is neither a transformers model nor one of the library's own.
        ValueError: a layer or head that does not exist, repeated or negative indices, a scale
            that is not a finite float, or a nested ``ablate`` of the same model that sets one
            of the same heads.
    """
    reader, found = find(model, "ablate")
    count = _heads_of(model, reader, "ablate")
    chosen = _check_head_map(heads, len(found), count)
    factor = _check_scale(scale)
    scales = {}
    for layer, hs in chosen.items():
        scales[layer] = torch.ones(count)
        scales[layer][hs] = factor
    targets = frozenset((layer, h) for layer, hs in chosen.items() for h in hs)
    _conflicts("ablate", model, targets)
    block = Edit(sorted(chosen), len(found), kind="ablate", scales=scales, targets=targets)
    with open_block(model, block, reader, found):
        yield block


@contextlib.contextmanager
def scaled(model: nn.Module, scales: Mapping[int, Tensor]) -> Iterator[Edit]:
    """Multiply every head's output of layer ``layer`` by ``scales[layer]`` (H,), a tensor
    that may require a gradient (``multihead heads --method gradient`` reads d loss / d
    scale at 1)."""
    reader, found = find(model, "scaled")
    count = _heads_of(model, reader, "scaled")
    for layer, scale in scales.items():
        if not isinstance(scale, Tensor) or tuple(scale.shape) != (count,):
            raise ValueError(
                f"scales[{layer}] must be a tensor of shape ({count},), one scale per head. "
                f"Received: {type(scale).__name__} {tuple(getattr(scale, 'shape', ()))}"
            )
    layers = check_layers(list(scales), len(found))
    targets = frozenset((layer, h) for layer in scales for h in range(count))
    _conflicts("ablate", model, targets)
    block = Edit(layers, len(found), kind="ablate", scales=dict(scales), targets=targets)
    with open_block(model, block, reader, found):
        yield block


@contextlib.contextmanager
def knockout(
    model: nn.Module,
    *,
    queries: Sequence[int] | Tensor,
    keys: Sequence[int] | Tensor,
    layers: list[int] | None = None,
    heads: list[int] | None = None,
) -> Iterator[Edit]:
    """Block attention from the query positions ``queries`` to the key positions ``keys`` in
    chosen layers and heads while ``model`` runs.

    ::

        with multihead.acting.knockout(model, queries=[7], keys=[2, 3], layers=[0, 1]):
            out = model(**inputs)

    The block joins the model's own mask inside the kernel (``masks.knockout``), so tiles it
    empties are skipped; a query row left with no visible key gives 0, as every fully hidden
    row does in multihead. Positions are the input's (padding included). Inside
    ``generate()`` a decoding step's one query row is the newest position, and keys are
    positions in the KV cache (in the library's ``KVCache`` a row's own slots 0, 1, ...:
    for rows of one length, the input's positions). On a transformers sliding-window cache
    that has slid (Mistral, Gemma 2 and 3 past their window) key positions are mapped to
    the slots the cache holds. A rolling ``KVCache`` (``window=``) hands the attention its
    ring slots, which are not positions: a call of a covered layer with one is refused.

    Args:
        model: a transformers model or one of the library's own (as ``capture`` takes it).
        queries: query positions: a list or 1-D tensor of ints, or a 1-D bool tensor (L,).
        keys: key positions, likewise ((S,) for a bool tensor).
        layers: layer indices (None: every layer).
        heads: query-head indices (None: every head).

    Yields:
        The block's ``Edit`` record.

    Raises:
        TypeError: ``model`` is neither a transformers model nor one of the library's
            own, or positions of the wrong type.
        ValueError: a layer or head that does not exist, repeated, negative or empty
            positions. (Positions past the input are taken: inside ``generate()`` the
            decoding steps reach them.) At a covered layer's call: a rolling ``KVCache``.
            When the block closes: a knockout that no call reached (no call held one of its
            query positions with one of its key positions), which would have hidden nothing.
    """
    reader, found = find(model, "knockout")
    count = None if heads is None else _heads_of(model, reader, "knockout")
    cut = masks.knockout(queries, keys, heads=heads, num_heads=count)
    block = Edit(check_layers(layers, len(found)), len(found), kind="knockout", mask=cut)
    with open_block(model, block, reader, found):
        yield block
    if block.calls and not block.reached:
        raise ValueError(
            "this knockout reached no call: none of the block's calls held one of its query "
            "positions together with one of its key positions (a query in the prompt never "
            "sees a key past the input; a decoding step's one row is the newest position), so "
            "nothing was hidden. Name positions inside the input, or the queries of the "
            f"tokens you generate. Received: {cut!r} over {block.calls} calls"
        )


@contextlib.contextmanager
def patch(model: nn.Module, cap: Capture) -> Iterator[Edit]:
    """Run the captured heads of the captured layers with the captured weights.

    ::

        with multihead.acting.capture(model, layers=[2], heads=[1]) as cap:
            model(**clean)
        with multihead.acting.patch(model, cap):
            out = model(**corrupted)   # layer 2, head 1: cap.weights[2] @ V of this input

    Inside the block a patched head's output is ``W_captured @ V_current`` (its values from
    the running input, its weights from the capture); every other head runs normally.

    Args:
        model: the model ``cap`` was captured from.
        cap: a ``Capture`` holding weights (not statistics) from an earlier ``capture``.

    Yields:
        The block's ``Edit`` record.

    Raises:
        TypeError: ``cap`` is not a ``Capture``.
        ValueError: a capture of another model, one without weights, a nested patch of the
            same heads, and at a call, weights whose shape does not match the call (both
            shapes named).
    """
    reader, found = find(model, "patch")
    if not isinstance(cap, Capture):
        raise TypeError(
            "patch takes the Capture an earlier multihead.acting.capture(model, ...) yielded. "
            f"Received: cap of type {type(cap).__name__}"
        )
    if cap._model is not model:
        raise ValueError(
            "patch needs a capture of the same model: its weights belong to another one. "
            f"Received: a capture of {type(cap._model).__name__} at {id(cap._model):#x}, "
            f"model {type(model).__name__} at {id(model):#x}"
        )
    if not cap.weights:
        raise ValueError(
            "the capture holds no weights to patch in (it recorded statistics, or the model "
            "did not run inside it). Received: cap.weights={}"
        )
    count = _heads_of(model, reader, "patch")
    heads = list(range(count)) if cap.heads is None else list(cap.heads)
    targets = frozenset((layer, h) for layer in cap.weights for h in heads)
    _conflicts("patch", model, targets)
    block = Edit(sorted(cap.weights), len(found), kind="patch", heads=heads, source=cap,
                 targets=targets)  # fmt: skip
    with open_block(model, block, reader, found):
        yield block
