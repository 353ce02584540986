"""``register``: multihead's attention and mask functions under a name transformers' models
accept as ``attn_implementation`` (``import multihead.hf`` calls it once)."""

from __future__ import annotations

from .attention import attention_forward
from .mask_functions import make_mask

__all__ = ["NAME", "register"]

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
