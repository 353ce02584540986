"""The model behind the service: tokenization, embeddings and attention weights, on torch or on
an exported graph under onnxruntime. Everything here is synchronous; the app calls it off the
event loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..export.runtime import OnnxBert
from ..models.bert import Pretrained

__all__ = ["Engine", "Tokens", "TooLong"]


class TooLong(ValueError):
    """A text has more tokens than the service takes and the client asked not to truncate."""

    def __init__(self, index: int, count: int, limit: int) -> None:
        super().__init__(
            f"inputs[{index}] has {count} tokens but at most {limit} are allowed; shorten it or "
            f'send "truncate": true. Received: {count} tokens'
        )
        self.index, self.count, self.limit = index, count, limit


@dataclass(frozen=True)
class Tokens:
    """One tokenized text: ids with [CLS]/[SEP], the word pieces and their special flags."""

    ids: list[int]
    pieces: list[str]
    special: list[bool]


class Engine:
    """Tokenizer plus model, shared by every request.

    Thread safety: ``tokenize`` may run in many threads at once (``Pretrained`` never changes
    its tokenizers after building them); ``embed`` and ``attention`` run on one model thread.

    Args:
        pretrained: the loaded BERT-family model (its tokenizer is used on both runtimes).
        onnx: run the model on this exported graph instead of torch.
        model_id: the name reported in responses (default: the model folder's name).
        max_tokens: tokens per packed row on torch, padded tokens per batch on onnxruntime.
    """

    def __init__(
        self,
        pretrained: Pretrained,
        *,
        onnx: OnnxBert | None = None,
        model_id: str | None = None,
        max_tokens: int = 1536,
    ) -> None:
        self.pretrained, self.onnx = pretrained, onnx
        self.model_id = model_id or _model_id(pretrained)
        self.max_tokens = max(max_tokens, pretrained.embed_length)

    @property
    def runtime(self) -> str:
        return "torch" if self.onnx is None else "onnx"

    @property
    def dim(self) -> int:
        return self.pretrained.config.hidden_size

    @property
    def max_input_length(self) -> int:
        """Most tokens per text (with [CLS] and [SEP]): sentence-transformers' max_seq_length."""
        return self.pretrained.embed_length

    @property
    def layers(self) -> int:
        return self.pretrained.config.num_hidden_layers

    @property
    def heads(self) -> int:
        return self.pretrained.config.num_attention_heads

    def tokenize(self, texts: Sequence[str], *, truncate: bool) -> list[Tokens]:
        """Tokenize; texts longer than ``max_input_length`` are cut when ``truncate``, else
        ``TooLong`` names the first one."""
        limit = self.max_input_length
        encodings = self.pretrained._encode(list(texts), limit if truncate else None)
        for i, e in enumerate(encodings):
            if len(e.ids) > limit:
                raise TooLong(i, len(e.ids), limit)
        return [
            Tokens(list(e.ids), list(e.tokens), [bool(s) for s in e.special_tokens_mask])
            for e in encodings
        ]

    def embed(self, ids: Sequence[Sequence[int]]) -> np.ndarray:
        """Mean-pooled last hidden states (N, E) float32, not normalized, in input order."""
        if self.onnx is not None:
            return self.onnx.embed_ids(ids, max_tokens=self.max_tokens, normalize=False)
        return self.pretrained.embed_ids(ids, max_tokens=self.max_tokens, normalize=False).numpy()

    def attention(self, ids: Sequence[int]) -> np.ndarray:
        """Per-layer, per-head weights (layers, H, L, L) float32 of one tokenized text."""
        if self.onnx is not None:
            return self.onnx.attention(ids)
        with torch.inference_mode():
            batch = torch.tensor([list(ids)], dtype=torch.long)
            out = self.pretrained.model(batch, return_weights=True)
        return torch.stack(out.weights)[:, 0].numpy()


def _model_id(pretrained: Pretrained) -> str:
    from ..models.bert import default_path

    try:
        if pretrained.path.resolve() == default_path().resolve():
            return "sentence-transformers/all-MiniLM-L6-v2"  # what the default package holds
    except ModuleNotFoundError:  # no default package: the folder names the model
        pass
    return pretrained.path.name
