"""Every transformers model on multihead's attention: ``attn_implementation="multihead"``.

Importing this module registers the name ``"multihead"`` with transformers' two interfaces, the
attention function (``AttentionInterface``) and the mask function (``AttentionMaskInterface``;
without one transformers hands an unknown implementation no mask at all). After that::

    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="multihead")
    model = AutoModel.from_config(config, attn_implementation="multihead")
    model.set_attn_implementation("multihead")

run every attention call of the model through ``multihead.attention`` (or
``attention_with_weights`` when the weights are wanted): masks as masks whose tiles are known
(a sliding window skips what it hides), soft-capping and attention sinks inside the kernel,
grouped-query attention without repeated keys, ``output_attentions=True`` on the fast path.
``capture(model, layers=, heads=)`` records the weights of chosen heads only.

Needs the ``hf`` extra (transformers); ``import multihead`` never imports transformers.
"""

from __future__ import annotations

from .. import _extras

_extras.require("transformers", "hf", "multihead.hf")

from .attention import attention_forward  # noqa: E402  after the check for the extra
from .capture import Capture, attention_layers, capture  # noqa: E402
from .mask_functions import make_mask  # noqa: E402

__all__ = ["Capture", "attention_forward", "attention_layers", "capture", "make_mask", "register"]

NAME = "multihead"

# transformers' own implementations: registering over one would change every model using it
_BUILTIN = ("eager", "sdpa", "flex_attention", "paged|eager")


def register(name: str = NAME) -> str:
    """Register multihead's attention and mask functions with transformers under ``name``.

    Idempotent: registering again (the import did it once) changes nothing. Models then take
    ``attn_implementation=name`` in ``from_pretrained`` / ``from_config`` and
    ``model.set_attn_implementation(name)``.

    Args:
        name: the implementation name (default "multihead"); not one of transformers' own.

    Returns:
        ``name``.

    Raises:
        ValueError: ``name`` is empty, not a string, or names one of transformers' own
            implementations (eager, sdpa, flex_attention, flash_attention_*).
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    if not isinstance(name, str) or not name or name in _BUILTIN or "flash" in name:
        raise ValueError(
            "name must be a non-empty string other than transformers' own implementations "
            f"({', '.join(_BUILTIN)}, flash_attention_*). Received: name={name!r}"
        )
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, make_mask)
    return name


register()
