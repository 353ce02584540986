"""The model behind the service: tokenization, embeddings and attention weights, on torch or on
an exported graph under onnxruntime. Everything here is synchronous; the app calls it off the
event loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from ..apps.embed_precision import linear_precision
from ..export.runtime import OnnxBert
from ..models.bert import Pretrained

__all__ = ["Engine", "OnnxRuntime", "Runtime", "Tokens", "TooLong", "TorchRuntime"]


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


class Runtime(Protocol):
    """What runs the model for the engine: torch or onnxruntime, behind the same two calls."""

    name: str

    def embed(self, ids: Sequence[Sequence[int]], *, max_tokens: int) -> np.ndarray:
        """Mean-pooled last hidden states (N, E) float32, not normalized, in input order."""
        ...

    def attention(self, ids: Sequence[int]) -> np.ndarray:
        """Per-layer, per-head weights (layers, H, L, L) float32 of one tokenized text."""
        ...


class TorchRuntime:
    """The loaded model on torch (packed rows for embeddings)."""

    name = "torch"

    def __init__(self, pretrained: Pretrained) -> None:
        self.pretrained = pretrained

    def embed(self, ids: Sequence[Sequence[int]], *, max_tokens: int) -> np.ndarray:
        return self.pretrained.embed_ids(ids, max_tokens=max_tokens, normalize=False).numpy()

    def attention(self, ids: Sequence[int]) -> np.ndarray:
        with torch.inference_mode():
            batch = torch.tensor([list(ids)], dtype=torch.long)
            out = self.pretrained.model.run(batch, return_weights=True)
        return torch.stack(out.weights)[:, 0].numpy()


class OnnxRuntime:
    """An exported graph under onnxruntime."""

    name = "onnx"

    def __init__(self, onnx: OnnxBert) -> None:
        self.onnx = onnx

    def embed(self, ids: Sequence[Sequence[int]], *, max_tokens: int) -> np.ndarray:
        return self.onnx.embed_ids(ids, max_tokens=max_tokens, normalize=False)

    def attention(self, ids: Sequence[int]) -> np.ndarray:
        return self.onnx.attention(ids)


class Engine:
    """Tokenizer plus model, shared by every request.

    Thread safety: ``tokenize`` may run in many threads at once (``Pretrained`` never changes
    its tokenizers after building them); ``embed`` and ``attention`` run on one model thread.

    Args:
        pretrained: the loaded BERT-family model (its tokenizer is used on both runtimes).
        runtime: what runs the model (default: ``TorchRuntime(pretrained)``); the tokenizer is
            always the pretrained model's.
        model_id: the name reported in responses (default: the model folder's name).
        max_tokens: tokens per packed row on torch, padded tokens per batch on onnxruntime.
    """

    def __init__(
        self,
        pretrained: Pretrained,
        *,
        runtime: Runtime | None = None,
        model_id: str | None = None,
        max_tokens: int = 1536,
    ) -> None:
        self.pretrained = pretrained
        self.backend: Runtime = runtime if runtime is not None else TorchRuntime(pretrained)
        self.model_id = model_id or _model_id(pretrained)
        self.max_tokens = max(max_tokens, pretrained.embed_length)

    @property
    def runtime(self) -> str:
        """The runtime's name, as responses report it ("torch" or "onnx")."""
        return self.backend.name

    @property
    def precision(self) -> str:
        """What the linear layers run in: "bf16" on torch with ``Bf16Linear`` layers
        (``--precision``), else "fp32" (onnxruntime runs the exported fp32 graph)."""
        if self.runtime != "torch":
            return "fp32"
        return linear_precision(self.pretrained.model)

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
        return self.backend.embed(ids, max_tokens=self.max_tokens)

    def attention(self, ids: Sequence[int]) -> np.ndarray:
        """Per-layer, per-head weights (layers, H, L, L) float32 of one tokenized text."""
        return self.backend.attention(ids)


def _model_id(pretrained: Pretrained) -> str:
    from ..models.bert import default_path

    try:
        if pretrained.path.resolve() == default_path().resolve():
            return "sentence-transformers/all-MiniLM-L6-v2"  # what the default package holds
    except ModuleNotFoundError:  # no default package: the folder names the model
        pass
    return pretrained.path.name
