"""Running exported graphs with onnxruntime on CPU: sessions, BERT embeddings, int8 weights."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .._extras import require
from ..models.bert import Pretrained

__all__ = ["OnnxBert", "quantize_int8", "session"]

_FEATURE = "running an exported graph"


def session(path: str | Path | bytes, *, threads: int | None = None) -> Any:
    """An ``onnxruntime.InferenceSession`` on CPUExecutionProvider.

    Args:
        path: the ``.onnx`` file (or its bytes).
        threads: intra-op threads (None: onnxruntime's default, one per physical core). Set it
            equal to ``torch.get_num_threads()`` to compare the two runtimes fairly.
    """
    ort = require("onnxruntime", "export", _FEATURE)
    options = ort.SessionOptions()
    if threads is not None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be a positive int. Received: threads={threads!r}")
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
    source = path if isinstance(path, bytes) else str(path)
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


def quantize_int8(source: str | Path, target: str | Path) -> Path:
    """Dynamic int8 quantization (``onnxruntime.quantization.quantize_dynamic``).

    The weights of the linear layers (MatMul with a constant input) are stored as int8 with
    one scale per output channel; activations are quantized on the fly per batch. Embeddings
    change: compare them (cosine) before serving them. On all-MiniLM-L6-v2 one scale per
    channel gave a mean cosine of 0.992 to fp32 where one scale per tensor gave 0.95.
    """
    require("onnxruntime", "export", "int8 quantization")
    from onnxruntime.quantization import QuantType, quantize_dynamic

    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    quiet = logging.getLogger()  # quantize_dynamic logs a generic pre-processing hint there
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        quantize_dynamic(
            str(source),
            str(target),
            weight_type=QuantType.QInt8,
            per_channel=True,
            op_types_to_quantize=["MatMul"],  # the embedding Gather stays fp32: accuracy
        )
    finally:
        quiet.setLevel(level)
    return target


class OnnxBert:
    """An exported BERT graph (``to_onnx(pretrained, path)``) run by onnxruntime, with the
    tokenizer and truncation rules of the torch model it came from.

    A graph exported with ``weights=True`` answers ``attention``; its embeddings run on a copy
    of the graph without the weights output (onnxruntime computes every output of a graph,
    so the copy saves the (layers, B, H, L, L) tensor on every batch).

    Args:
        path: the ``.onnx`` file.
        pretrained: the loaded model it was exported from (for the tokenizer and lengths).
        threads: intra-op threads, as in ``session``.
    """

    def __init__(
        self, path: str | Path, pretrained: Pretrained, *, threads: int | None = None
    ) -> None:
        onnx = require("onnx", "export", _FEATURE)
        self.path, self.pretrained = Path(path), pretrained
        if not self.path.is_file():
            raise FileNotFoundError(f"no such ONNX file. Received: {self.path}")
        graph = onnx.load(str(self.path))
        inputs = [i.name for i in graph.graph.input]
        outputs = [o.name for o in graph.graph.output]
        if inputs != ["input_ids", "attention_mask"] or "last_hidden_state" not in outputs:
            raise ValueError(
                "expected a BERT graph from to_onnx (inputs input_ids, attention_mask; output "
                f"last_hidden_state). Received: inputs={inputs}, outputs={outputs}"
            )
        self.has_weights = "attention_weights" in outputs
        self._full = session(self.path, threads=threads) if self.has_weights else None
        if self.has_weights:
            graph = onnx.utils.Extractor(graph).extract_model(inputs, ["last_hidden_state"])
        self._embedding = session(graph.SerializeToString(), threads=threads)

    def __repr__(self) -> str:
        return f"OnnxBert(path='{self.path}', weights={self.has_weights})"

    def run(
        self, input_ids: np.ndarray, attention_mask: np.ndarray, *, weights: bool = False
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """One padded batch: input_ids and attention_mask (B, L) int64 ->
        last_hidden_state (B, L, E) and, when asked, attention_weights (layers, B, H, L, L)."""
        feed = {
            "input_ids": np.asarray(input_ids, dtype=np.int64),
            "attention_mask": np.asarray(attention_mask, dtype=np.int64),
        }
        if not weights:
            return self._embedding.run(["last_hidden_state"], feed)[0], None
        if self._full is None:
            raise ValueError(
                "this graph has no attention_weights output; export it with "
                f"to_onnx(..., weights=True). Received: {self.path}"
            )
        hidden, attention = self._full.run(["last_hidden_state", "attention_weights"], feed)
        return hidden, attention

    def embed_ids(
        self, ids: Sequence[Sequence[int]], *, max_tokens: int = 4096, normalize: bool = True
    ) -> np.ndarray:
        """Sentence embeddings (N, E) float32 of tokenized texts, in input order.

        Texts are sorted by length and cut into padded batches of at most ``max_tokens``
        (B x longest L) tokens, so little work goes to padding; the mean runs over real tokens.
        """
        limit = self.pretrained.max_length
        for i, seq in enumerate(ids):
            if not 0 < len(seq) <= limit:
                raise ValueError(
                    f"ids[{i}] must hold 1 to {limit} token ids (the model's positions). "
                    f"Received: {len(seq)} ids"
                )
        out = np.empty((len(ids), self.pretrained.config.hidden_size), dtype=np.float32)
        order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
        start = 0
        while start < len(order):
            width = len(ids[order[start]])  # the longest of this batch: sorted descending
            stop = min(len(order), start + max(1, max_tokens // width))
            rows = order[start:stop]
            batch = np.zeros((len(rows), width), dtype=np.int64)
            mask = np.zeros((len(rows), width), dtype=np.int64)
            for r, i in enumerate(rows):
                batch[r, : len(ids[i])] = ids[i]
                mask[r, : len(ids[i])] = 1
            hidden, _ = self.run(batch, mask)
            means = (hidden * mask[..., None]).sum(axis=1) / mask.sum(axis=1, keepdims=True)
            if normalize:
                means /= np.maximum(np.linalg.norm(means, axis=1, keepdims=True), 1e-12)
            out[rows] = means
            start = stop
        return out

    def embed(
        self, texts: Sequence[str], *, max_tokens: int = 4096, normalize: bool = True
    ) -> np.ndarray:
        """``Pretrained.embed`` on onnxruntime: same tokenizer, same truncation (with the same
        warning), same pooling; padded batches instead of packed rows."""
        ids = self.pretrained.embedding_ids(texts)
        return self.embed_ids(ids, max_tokens=max_tokens, normalize=normalize)

    def attention(self, ids: Sequence[int]) -> np.ndarray:
        """Per-layer, per-head weights (layers, H, L, L) of one tokenized text."""
        batch = np.asarray([ids], dtype=np.int64)
        _, weights = self.run(batch, np.ones_like(batch), weights=True)
        return weights[:, 0]
