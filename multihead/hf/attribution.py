"""transformers models as ``multihead.inspect.attribute`` reads them, registered on
``import multihead.hf``.

Every transformers model takes the gradient methods and occlusion (its input embeddings are
perturbed) and the weights-only methods (``attention``, ``rollout``); ``norm`` and ``alti``
also read each layer's residual stream, output projection and norms, found here for two
layouts:

* Llama-style pre-norm decoder layers (Llama, SmolLM2, Qwen2, Mistral): the layer's input is
  the residual stream, ``self_attn.o_proj`` the output projection, no norm after the sum;
* BERT-style post-norm attention blocks (``BertAttention``: ``self`` then ``output.dense``
  and ``output.LayerNorm`` over the sum with the block's input).

A layer whose attention output passes a norm of its own before the residual (Gemma 2 and 3's
``post_attention_layernorm`` beside a ``pre_feedforward_layernorm``) is not read.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from ..inspect import subjects
from ..inspect.subjects import CAUSAL, CLASSIFIER, ENCODER, Layer, Subject
from .reader import attention_layers

__all__ = ["open_model"]


def _hidden(args: tuple, kwargs: dict) -> Tensor:
    return args[0] if args else kwargs["hidden_states"]


def _layers(model: nn.Module) -> tuple[list[Layer] | None, str]:
    """Each self-attention layer's parts, or (None, why)."""
    parents = {id(child): module for module in model.modules() for child in module.children()}
    found = []
    for attn in attention_layers(model):
        parent: Any = parents.get(id(attn))
        o_proj = getattr(attn, "o_proj", None)
        if parent is not None and isinstance(o_proj, nn.Linear):
            if hasattr(parent, "pre_feedforward_layernorm"):
                return None, (
                    f"{type(parent).__name__} passes the attention output through a norm of its "
                    "own before the residual"
                )
            if not hasattr(parent, "input_layernorm"):
                return None, f"{type(parent).__name__} is not a pre-norm decoder layer"
            found.append(Layer(parent, attn, o_proj, None, _hidden))
            continue
        output = getattr(parent, "output", None)
        dense, norm = getattr(output, "dense", None), getattr(output, "LayerNorm", None)
        if isinstance(dense, nn.Linear) and isinstance(norm, nn.LayerNorm):
            found.append(Layer(parent, attn, dense, norm, _hidden))
            continue
        return None, f"the layout of {type(parent).__name__} is not one it reads"
    return (found or None), "" if found else "no self-attention layers"


def _backend(tokenizer: Any) -> Any:
    return getattr(tokenizer, "backend_tokenizer", tokenizer)


def open_model(model: Any, tokenizer: Any = None) -> Subject | None:
    """The ``Subject`` of a transformers ``PreTrainedModel`` (None for any other object)."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        return None
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    name = type(model).__name__
    layers, why = _layers(model)
    tok = _backend(tokenizer)
    special, mask = subjects._tokenizer_specials(tok)
    pad = getattr(text, "pad_token_id", None)
    eos = getattr(text, "eos_token_id", None)
    eos = eos[0] if isinstance(eos, list) else eos
    baseline = mask if mask is not None else (pad if pad is not None else (eos or 0))
    common = {"tokenizer": tok, "layers": layers, "why": why, "special_ids": special,
              "max_positions": getattr(text, "max_position_embeddings", None),
              "baseline_id": int(baseline), "name": name}  # fmt: skip
    embedding = model.get_input_embeddings()
    if name.endswith("ForCausalLM"):
        base = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model
        return Subject(CAUSAL, model, lambda ids: model(input_ids=ids).logits, embedding,
                       final_norm=getattr(base, "norm", None),
                       unembedding=model.get_output_embeddings().weight, causal=True,
                       **common)  # fmt: skip
    if name.endswith("ForSequenceClassification"):
        pooling = "last" if getattr(text, "is_decoder", False) or (layers and any(
            hasattr(layer.block, "input_layernorm") for layer in layers
        )) else "first"  # fmt: skip
        return Subject(CLASSIFIER, model, lambda ids: model(input_ids=ids).logits, embedding,
                       pooling=pooling, **common)  # fmt: skip
    return Subject(ENCODER, model, lambda ids: model(input_ids=ids).last_hidden_state,
                   embedding, **common)  # fmt: skip


subjects.register("transformers models", open_model)
