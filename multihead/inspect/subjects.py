"""The models ``multihead.inspect.attribute`` explains, as one ``Subject`` each: how to run
the model from token ids, which module's output the gradient methods perturb, and for the
``norm``/``alti`` methods where each layer's residual stream, attention call, output
projection and norms are.

The library's own models are read here by their parts (``multihead.modules``' layers); other
kinds register an opener (``register``): ``multihead.hf`` registers transformers models on
import, as it registers its reader of layers for ``multihead.acting``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ..modules import MultiHeadAttention, TransformerDecoderLayer, TransformerEncoderLayer

__all__ = ["CAUSAL", "CLASSIFIER", "ENCODER", "Layer", "Subject", "open_subject", "register"]

ENCODER, CAUSAL, CLASSIFIER = "encoder", "causal LM", "classifier"


@dataclass(frozen=True)
class Layer:
    """Where one self-attention layer's parts are.

    Attributes:
        block: the layer; its input is the residual stream the attention output joins.
        attention: the module whose attention call ``multihead.acting`` records for the layer.
        out_proj: the output projection (E, H * D_v).
        post_norm: the norm after the residual sum (post-norm layers), or None (pre-norm).
        stream: (args, kwargs) of ``block``'s call -> its input hidden states (B, L, E).
    """

    block: nn.Module
    attention: nn.Module
    out_proj: nn.Linear
    post_norm: nn.Module | None = None
    stream: Callable[[tuple, dict], Tensor] = lambda args, kwargs: args[0]


@dataclass
class Subject:
    """A model as ``attribute`` runs it.

    Attributes:
        kind: ``ENCODER`` (a token's last hidden state is the target), ``CAUSAL`` (a next-token
            logit) or ``CLASSIFIER`` (a class score).
        model: the module whose layers ``multihead.acting`` finds (blocks open on it).
        run: ids (1, L) -> the output targets read: hidden states (1, L, E), logits (1, L, V)
            or scores (1,) / (1, K).
        embedding: the token embedding; its output is what gradient methods perturb.
        layers: every self-attention layer in order, or None where the model's layers are not
            read (``why`` says why): then ``norm`` and ``alti`` are refused.
        final_norm, unembedding: a causal LM's norm before the output layer and its (V, E)
            weight, for ALTI's logit form.
        pooling: a classifier's reading of the last layer: "mean" over tokens, "first", "last".
        tokenizer: a ``tokenizers.Tokenizer`` or None.
        max_positions: the longest input (None: no limit).
        baseline_id: the token occlusion puts in place of another ([MASK] where there is one).
        causal: no token sees a later one.
        special_ids: ids of the special tokens ([CLS], [SEP], <s>).
    """

    kind: str
    model: Any
    run: Callable[[Tensor], Tensor]
    embedding: nn.Module
    layers: list[Layer] | None = None
    why: str = ""
    final_norm: nn.Module | None = None
    unembedding: Tensor | None = None
    pooling: str | None = None
    tokenizer: Any = None
    max_positions: int | None = None
    baseline_id: int = 0
    causal: bool = False
    special_ids: frozenset[int] = field(default_factory=frozenset)
    name: str = ""


_OPENERS: list[tuple[str, Callable[[Any, Any], Subject | None]]] = []


def register(name: str, opener: Callable[[Any, Any], Subject | None]) -> None:
    """Add ``opener`` ((model, tokenizer or None) -> ``Subject``, or None for a model it does
    not know); a name registered again is replaced."""
    _OPENERS[:] = [(n, o) for n, o in _OPENERS if n != name] + [(name, opener)]


def open_subject(model: Any, tokenizer: Any = None) -> Subject:
    """The ``Subject`` of ``model``: the library's own models first, then the openers
    registered by other kinds. ``tokenizer`` (a ``tokenizers.Tokenizer``, or a transformers
    tokenizer: its ``backend_tokenizer``) replaces the model's own.

    Raises:
        TypeError: no opener knows the model.
    """
    tokenizer = getattr(tokenizer, "backend_tokenizer", tokenizer)
    found = _own(model)
    if found is not None and tokenizer is not None:
        found.tokenizer = tokenizer
        found.special_ids = _tokenizer_specials(tokenizer)[0]
    for _, opener in _OPENERS:
        if found is not None:
            break
        found = opener(model, tokenizer)
    if found is None:
        raise TypeError(
            "attribute takes one of the library's own models (models.bert.load(), a "
            "multihead.load folder of a BERT encoder, a sentiment model or a causal LM) or a "
            "transformers model (import multihead.hf first). Received: model of type "
            f"{type(model).__name__}"
        )
    return found


def _tokenizer_specials(tokenizer: Any) -> tuple[frozenset[int], int | None]:
    """(special token ids, the [MASK] id or None) of a ``tokenizers.Tokenizer``."""
    if tokenizer is None or not hasattr(tokenizer, "get_added_tokens_decoder"):
        return frozenset(), None
    added = tokenizer.get_added_tokens_decoder()
    special = frozenset(i for i, t in added.items() if getattr(t, "special", False))
    mask = tokenizer.token_to_id("[MASK]")
    if mask is None:
        mask = tokenizer.token_to_id("<mask>")
    return special, mask


def _encoder_layers(stack: Sequence[nn.Module]) -> list[Layer] | None:
    found = []
    for layer in stack:
        if not isinstance(layer, (TransformerEncoderLayer, TransformerDecoderLayer)):
            return None
        attn = layer.self_attn
        if not isinstance(attn, MultiHeadAttention):
            return None
        post = None
        if isinstance(layer, TransformerEncoderLayer) and not layer.norm_first:
            post = layer.norm1
        found.append(Layer(layer, attn, attn.out_proj, post))
    return found


def _own(model: Any) -> Subject | None:
    """The library's own models, read by their parts: a ``models.bert.Pretrained`` or ``Bert``,
    a sentiment regressor (a BERT encoder, mean pooling, a head), a ``CausalLM``."""
    found = getattr(model, "model", None) if not isinstance(model, nn.Module) else model
    if not isinstance(found, nn.Module):
        return None
    module: Any = found
    tokenizer = getattr(model, "tokenizer", None)
    special, mask = _tokenizer_specials(tokenizer)
    common = {"tokenizer": tokenizer, "special_ids": special}
    baseline = mask if mask is not None else 0
    if hasattr(module, "embeddings") and hasattr(module, "encoder"):
        if hasattr(module.embeddings, "word"):
            return _bert(module, model, common, baseline)
        return None
    if hasattr(module, "head") and hasattr(getattr(module, "encoder", None), "embeddings"):
        return _sentiment(module, common, baseline)
    if hasattr(module, "decoder") and hasattr(module, "lm_head") and hasattr(module, "embed"):
        return _causal(module, common)
    return None


def _bert(bert: Any, model: Any, common: dict[str, Any], baseline: int) -> Subject:
    return Subject(ENCODER, bert, lambda ids: bert(ids), bert.embeddings.word,
                   _encoder_layers(bert.encoder.layers),
                   max_positions=bert.config.max_position_embeddings, baseline_id=baseline,
                   name=str(getattr(model, "path", type(bert).__name__)), **common)  # fmt: skip


def _sentiment(module: Any, common: dict[str, Any], baseline: int) -> Subject:
    """The sentiment regressor: its encoder's layers, mean pooling, its score."""
    encoder = module.encoder

    def scores(ids: Tensor) -> Tensor:
        lengths = torch.full((ids.shape[0],), ids.shape[1], device=ids.device)
        return module(ids, lengths).reshape(ids.shape[0], -1)

    return Subject(CLASSIFIER, module, scores, encoder.embeddings.word,
                   _encoder_layers(encoder.encoder.layers), pooling="mean",
                   max_positions=encoder.config.max_position_embeddings, baseline_id=baseline,
                   name=type(module).__name__, **common)  # fmt: skip


def _causal(module: Any, common: dict[str, Any]) -> Subject:
    """A ``CausalLM``: its token embedding, decoder layers, final norm and output layer."""
    embedding = next(
        m for m in module.modules()
        if isinstance(m, nn.Embedding) and m.num_embeddings == module.vocab_size
    )  # fmt: skip
    decoder = module.decoder
    # run(weights=False): the layers are called (their hooks fire), not their run()
    return Subject(CAUSAL, module, lambda ids: module.run(ids, weights=False).logits, embedding,
                   _encoder_layers(decoder.layers), final_norm=decoder.norm,
                   unembedding=module.lm_head.weight, max_positions=module.max_positions,
                   baseline_id=module.pad_token_id, causal=True,
                   name=str(getattr(module, "path", None) or type(module).__name__),
                   **common)  # fmt: skip
