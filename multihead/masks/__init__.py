"""Attention masks as composable data, with one polarity everywhere: True = may attend.

A mask is a small object, not an L x S tensor. Each mask can

* lower any rectangular block of itself to a bool tensor (``block``; ``to_dense`` is the whole
  (L, S) block), and
* answer, for a tile of query rows and one batch entry, which contiguous key range can be visible
  and whether that tile is fully visible, partly visible or empty (``tile``), without building
  the block. The fast backends use the second answer to skip work.

Masks combine with ``&`` (visible in both) and ``|`` (visible in either)::

    m = masks.causal() & masks.lengths(torch.tensor([3, 2]))

Any rule is a mask through ``predicate(fn)`` (FlexAttention's ``mask_mod`` form). Structured
masks (``causal``, ``sliding_window``) know nothing about sizes; the sizes come from the tensors
they are used with. Masks built from tensors (``lengths``, ``key_padding``, ``documents``,
``dense``) fix the batch size B, and ``dense`` may fix the head count H.

Layout: ``base`` (the protocol, the algebra, ``dense``), ``kinds`` (the built-in kinds),
``predicate``, and ``convert`` (torch and Keras conventions, apart from the core).
"""

from __future__ import annotations

from .base import Mask, MaskMod, Tile, TileKind, dense
from .convert import TorchMasks, from_keras, from_torch
from .kinds import causal, documents, key_padding, lengths, sliding_window
from .knockout import knockout
from .predicate import predicate

__all__ = [
    "Mask",
    "MaskMod",
    "Tile",
    "TileKind",
    "TorchMasks",
    "causal",
    "dense",
    "documents",
    "from_keras",
    "from_torch",
    "key_padding",
    "knockout",
    "lengths",
    "predicate",
    "sliding_window",
]
