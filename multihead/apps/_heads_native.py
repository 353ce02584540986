"""``multihead heads`` on the library's own models (``multihead.save`` folders, such as the one
``multihead train lm`` writes): the heads are scaled where their outputs meet the output
projection of each ``MultiHeadAttention``, which is where transformers 4's ``head_mask`` and
``multihead.hf.ablate`` act (each head's weighted sum of values, before the projection), at
the cost of one multiplication per layer."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["attention_modules", "is_native", "load", "measure", "scaled"]


def is_native(folder: Path | None) -> bool:
    """Whether ``folder`` is a ``multihead.save`` folder (the library loads it itself)."""
    from ..models import kinds

    found = kinds.folder_kind(folder)
    return found is not None and found.kind == kinds.SAVED


def load(folder: Path) -> tuple[Any, Any, bool]:
    """(model in eval mode, its ``tokenizers.Tokenizer``, causal) for a ``multihead.save``
    folder of a causal LM or an encoder with a tokenizer."""
    from .. import models
    from ..models import kinds
    from ..models.causal_lm import CausalLM

    model = models.load(folder)
    causal = isinstance(model, CausalLM)
    if not causal:
        kinds.check_encoder(model, folder, "multihead heads")
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is None:
        raise FileNotFoundError(
            f"multihead heads needs the model's tokenizer.json, which is missing from {folder}. "
            "Received: a folder without tokenizer.json"
        )
    if not attention_modules(model):
        raise ValueError(
            f"multihead heads found no multi-head attention in the model of {folder}. "
            f"Received: a {type(model).__name__}"
        )
    return model.eval(), tokenizer, causal


def attention_modules(model: nn.Module) -> list[Any]:
    """The model's attention modules in layer order (what ``heads`` calls layers)."""
    from ..modules.attention import MultiHeadAttention

    return [m for m in model.modules() if isinstance(m, MultiHeadAttention)]


@contextmanager
def scaled(model: nn.Module, scales: dict[int, Tensor]) -> Iterator[None]:
    """Inside the block, the heads of layer ``l`` have their outputs multiplied by
    ``scales[l]`` (H,) before the output projection (tensors with gradients give the gradient
    of a loss with respect to each head's scale)."""
    layers = attention_modules(model)
    hooks = []

    def hook_for(attn: Any, scale: Tensor) -> Callable[..., tuple[Tensor]]:
        def scale_heads(module: nn.Module, args: tuple[Tensor, ...]) -> tuple[Tensor]:
            x = args[0]  # (..., H * D_v): the heads' outputs side by side
            heads = x.unflatten(-1, (attn.num_heads, -1))
            return ((heads * scale.to(x.dtype)[:, None]).flatten(-2),)

        return scale_heads

    try:
        for layer, scale in scales.items():
            attn = layers[layer]
            hooks.append(attn.out_proj.register_forward_pre_hook(hook_for(attn, scale)))
        yield
    finally:
        for hook in hooks:
            hook.remove()


def measure(model: Any, ids: Tensor, causal: bool) -> Callable[[], Tensor]:
    """The function a head's removal changes: the mean next-token cross-entropy of the text
    (as transformers' ``labels=`` loss), or the encoder's mean-pooled last hidden state."""

    def run() -> Tensor:
        if causal:
            logits = model(ids)
            return torch.nn.functional.cross_entropy(
                logits[0, :-1].float(), ids[0, 1:], reduction="mean"
            )
        return model(ids).last_hidden_state.mean(1)[0]

    return run
