"""``capture``: the softmax weights, or statistics of them, of chosen heads of chosen layers
of a model: a transformers model or one of the library's own.

Inside ``with capture(model, layers=[1], heads=[0, 2]) as cap:`` every forward of ``model``
asks ``attention_with_weights(..., heads=[0, 2])`` for exactly those heads of layer 1 and runs
every other call without weights, so nothing else is ever materialized. ``open_block`` is how
every block (``capture``, ``ablate``, ``knockout``, ``patch``) starts: the model's reader
(``readers.py``) finds its layers, and the block is active while the model runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

from torch import nn

from .. import _validation as V
from ..functional import check_heads
from ..stats import check_stats
from .blocks import Block, Capture, activate
from .readers import Reader, find

__all__ = ["Capture", "capture", "check_layers", "num_heads", "open_block"]


def num_heads(model: nn.Module) -> int | None:
    """The model's query heads per layer (None where it does not say)."""
    reader, _ = find(model, "num_heads")
    return reader.num_heads(model)


def check_layers(layers: object, count: int) -> list[int] | None:
    if layers is None:
        return None
    return V.check_indices(
        "layers", layers, count, kind="layer", every="layer",
        size=f"the model has {count} self-attention layers, counted from 0",
    )  # fmt: skip


@contextlib.contextmanager
def open_block(
    model: nn.Module, block: Block, reader: Reader, found: list[nn.Module]
) -> Iterator[None]:
    """Run ``model`` with ``block`` active over its layers ``found`` (``find``), in the
    context its reader gives (a transformers model on the multihead implementation, given its
    own back on leaving)."""
    for index, layer in enumerate(found):
        for part in layer.modules():
            block._owner.setdefault(part, index)
    block._model = model
    with reader.running(model), activate(block):
        yield


@contextlib.contextmanager
def capture(
    model: nn.Module,
    layers: list[int] | None = None,
    heads: list[int] | None = None,
    *,
    stats: Sequence[str] = (),
    window: int | None = None,
    accumulate: bool = False,
) -> Iterator[Capture]:
    """Record the softmax weights, or statistics of them, for chosen heads of chosen layers
    while ``model`` runs.

    ::

        with multihead.acting.capture(model, layers=[1], heads=[0, 2]) as cap:
            model(ids)
        cap.weights[1]  # (B, 2, L, S): heads 0 and 2 of layer 1, in that order

        with multihead.acting.capture(model, stats=["key_mass", "entropy"]) as cap:
            model(ids)
        cap.stats[0]["key_mass"]  # (B, H, S): layer 0's weights summed over the queries

    Only the chosen heads of the chosen layers are computed with weights (through
    ``attention_with_weights(..., heads=...)``); every other attention call runs without
    any, so on a long input two heads of one layer cost about their own size in memory.
    Statistics come from ``multihead.attention_stats``: the weights of one slice of query
    rows at a time, reduced at once, never (B, h, L, S). A transformers model runs on the
    ``"multihead"`` attention implementation inside the block, whatever it was loaded with,
    and gets its own back on leaving it. Inside ``generate()`` each call of a layer (the
    prompt, then one row per new token over the KV cache) replaces what the last one kept,
    except key statistics with ``accumulate=True``.

    Args:
        model: a transformers model (``PreTrainedModel``; ``multihead.hf`` imported), whose
            layers are the modules transformers reports ``attentions`` of (for an
            encoder-decoder model the encoder's; pass ``model.get_decoder()`` for the
            decoder's), or one of the library's own models, whose layers are its
            ``MultiHeadAttention`` modules in order (``multihead.models.gpt2.load``,
            ``multihead.load``, a ``TransformerEncoder``, ...).
        layers: layer indices counted from 0 as in the model's config (None: every layer).
        heads: query-head indices, recorded in the order given (None: every head).
        stats: statistics to record instead of the weights, from ``"key_mass"`` (B, h, S),
            ``"window_mass"`` (B, h, S), ``"entropy"`` (B, h, L), ``"head_mean"`` (B, L, S);
            with any, ``cap.weights`` stays empty.
        window: the last query rows ``"window_mass"`` sums (required with it).
        accumulate: sum ``key_mass`` and ``window_mass`` over successive calls of a layer
            inside the block, per key position (H2O's accumulated attention over a growing
            KV cache; earlier calls are zero-extended).

    Yields:
        A ``Capture`` whose ``weights`` (or ``stats``) fill as the model runs: ``{layer:
        Tensor (B, len(heads), L, S)}``, detached, from the last forward that ran each layer.

    Raises:
        TypeError: ``model`` is neither a transformers model nor one of the library's own.
        ValueError: no self-attention layers found, ``layers`` / ``heads`` that are not
            lists of distinct indices in range, an unknown or repeated statistic, ``window``
            missing for ``window_mass`` or below 1.
    """
    reader, found = find(model, "capture")
    names = check_stats(stats, window)
    accumulate = V.check_bool("accumulate", accumulate)
    cap = Capture(check_layers(layers, len(found)), len(found))
    cap.stat_names, cap.window, cap.accumulate = names, window, accumulate
    if heads is not None:
        count = reader.num_heads(model)
        cap.heads = check_heads(heads, count) if count is not None else list(heads)
    with open_block(model, cap, reader, found):
        yield cap
