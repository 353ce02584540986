"""Acting on attention, in the library's own models and in transformers models alike.

``capture`` records the softmax weights (or statistics of them) of chosen heads of chosen
layers; ``ablate`` scales chosen heads' outputs; ``knockout`` hides attention between chosen
positions inside the kernel; ``patch`` runs chosen heads with captured weights. Each is a
context manager that opens a block; blocks nest and combine::

    with multihead.acting.capture(model, layers=[1], heads=[0, 2]) as cap:
        model(ids)
    cap.weights[1]  # (B, 2, L, S)

Every attention call from a layer a block covers reads the ``Plan`` of the active blocks for
that layer (``plan_for``) and runs it through ``run_plan``, one kernel call: the library's
``MultiHeadAttention`` and the transformers bridge (``multihead.hf``) are its two readers, so
every block works on both, with the same functions and the same errors (``multihead.hf``
re-exports them). A plan acts at two points of a call, the pattern and a head's output
(``apply.py`` names them). A model's layers are found by the reader registered for its kind
(``readers.py``): for the library's own models its ``MultiHeadAttention`` modules in order.
"""

from __future__ import annotations

from . import compressed
from .apply import run_plan
from .blocks import Block, Capture, Compression, Edit, Plan, activate, active, plan_for, route
from .capture import capture, num_heads, open_block
from .edits import ablate, knockout, patch, scaled
from .readers import Reader, find, register

__all__ = [
    "Block",
    "Capture",
    "Compression",
    "Edit",
    "Plan",
    "Reader",
    "ablate",
    "activate",
    "active",
    "capture",
    "compressed",
    "find",
    "knockout",
    "num_heads",
    "open_block",
    "patch",
    "plan_for",
    "register",
    "route",
    "run_plan",
    "scaled",
]
