"""``to_onnx``: trace a multihead model into an ONNX graph with dynamic batch and length axes.

Export goes through ``torch.onnx.export(..., dynamo=True)`` (torch.export, then translation
and graph optimization by onnxscript), the exporter PyTorch maintains. While it traces,
``attention(backend="auto")`` runs the reference backend, whose plain ops (MatMul, Softmax,
Where) carry no data-dependent branch, so one graph serves every batch size and length.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from .. import masks
from .._extras import require
from ..models.bert import Bert, Pretrained
from ..modules import MultiHeadAttention, TransformerEncoder, TransformerEncoderLayer

__all__ = ["DEFAULT_OPSET", "GraphSpec", "graph_spec", "to_onnx"]

# opset 18 is the newest whose every op onnxruntime >= 1.14 runs on CPU, and it has
# LayerNormalization (17), so nothing is decomposed into slower primitives
DEFAULT_OPSET = 18
_EXAMPLE_BATCH, _EXAMPLE_LENGTH, _EXAMPLE_KEYS = 2, 5, 7  # > 1: torch.export specializes 0 and 1


@dataclass(frozen=True)
class GraphSpec:
    """The exported graph's interface.

    inputs / outputs: names in order. ``attention_mask`` is int64 (B, L) or (B, S),
    1 = real token (the Hugging Face convention; True = may attend, as everywhere here).
    """

    kind: str  # "attention", "encoder" or "bert"
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


def _key_mask(attention_mask: Tensor) -> masks.Mask:
    """(B, S) 1 = real token -> a (B, 1, 1, S) dense mask.

    ``masks.key_padding`` and ``masks.lengths`` read their tensor on the host when they are
    built, which a traced graph cannot do; a dense mask made from the graph input traces.
    """
    return masks.dense(attention_mask.bool()[:, None, None, :])


class _AttentionGraph(nn.Module):
    def __init__(self, module: MultiHeadAttention, weights: bool) -> None:
        super().__init__()
        self.module, self.weights = module, weights

    def forward(
        self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor
    ) -> Tensor | tuple[Tensor, Tensor]:
        mask = _key_mask(attention_mask)
        return self.module(query, key, value, mask=mask, return_weights=self.weights)


class _EncoderGraph(nn.Module):
    def __init__(self, encoder: TransformerEncoder, weights: bool) -> None:
        super().__init__()
        self.encoder, self.weights = encoder, weights

    def forward(
        self, hidden_states: Tensor, attention_mask: Tensor
    ) -> Tensor | tuple[Tensor, Tensor]:
        mask = _key_mask(attention_mask)
        out = self.encoder(hidden_states, mask=mask, return_weights=self.weights)
        if self.weights:
            return out.output, torch.stack(out.weights)  # [layers, B, H, L, L]
        return out


class _BertGraph(nn.Module):
    def __init__(self, bert: Bert, weights: bool) -> None:
        super().__init__()
        self.bert, self.weights = bert, weights

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        out = self.bert(input_ids, mask=_key_mask(attention_mask), return_weights=self.weights)
        if self.weights:
            return out.last_hidden_state, torch.stack(out.weights)  # [layers, B, H, L, L]
        return out.last_hidden_state


def graph_spec(model: nn.Module | Pretrained, *, weights: bool = False) -> GraphSpec:
    """The inputs and outputs ``to_onnx`` gives this model (see ``to_onnx``)."""
    extra = ("attention_weights",) if weights else ()
    if isinstance(model, Pretrained | Bert):
        return GraphSpec("bert", ("input_ids", "attention_mask"), ("last_hidden_state", *extra))
    if isinstance(model, TransformerEncoder | TransformerEncoderLayer):
        return GraphSpec("encoder", ("hidden_states", "attention_mask"), ("output", *extra))
    if isinstance(model, MultiHeadAttention):
        inputs = ("query", "key", "value", "attention_mask")
        return GraphSpec("attention", inputs, ("output", *extra))
    raise TypeError(
        "to_onnx exports a MultiHeadAttention, a TransformerEncoder or TransformerEncoderLayer, "
        "a models.bert.Bert or a loaded models.bert.Pretrained. "
        f"Received: {type(model).__name__}"
    )


def _prepare(
    model: nn.Module | Pretrained, weights: bool
) -> tuple[nn.Module, tuple[Tensor, ...], dict[str, dict[int, object]]]:
    """The wrapper module, example inputs (with padding) and dynamic axes for ``model``."""
    batch = torch.export.Dim("batch", min=1)
    b, n = _EXAMPLE_BATCH, _EXAMPLE_LENGTH
    if isinstance(model, Pretrained):
        model = model.model
    if isinstance(model, TransformerEncoderLayer):
        model = TransformerEncoder([model])
    mask = torch.ones(b, n, dtype=torch.long)
    mask[1, n - 2 :] = 0  # the example has padding, so the mask path is traced for real
    if isinstance(model, Bert):
        length = torch.export.Dim("sequence", min=1, max=model.config.max_position_embeddings)
        ids = torch.randint(1, model.config.vocab_size, (b, n)) * mask  # pad id 0
        axes = {"input_ids": {0: batch, 1: length}, "attention_mask": {0: batch, 1: length}}
        return _BertGraph(model, weights), (ids, mask), axes
    dtype = next(model.parameters()).dtype
    length = torch.export.Dim("sequence", min=1)
    if isinstance(model, TransformerEncoder):
        width = model.layers[0].self_attn.embed_dim
        x = torch.randn(b, n, width, dtype=dtype)
        axes = {"hidden_states": {0: batch, 1: length}, "attention_mask": {0: batch, 1: length}}
        return _EncoderGraph(model, weights), (x, mask), axes
    keys = torch.export.Dim("keys", min=1)
    s = _EXAMPLE_KEYS
    mask = torch.ones(b, s, dtype=torch.long)
    mask[1, s - 3 :] = 0
    query = torch.randn(b, n, model.embed_dim, dtype=dtype)
    key = torch.randn(b, s, model.kdim, dtype=dtype)
    value = torch.randn(b, s, model.vdim, dtype=dtype)
    axes = {
        "query": {0: batch, 1: length},
        "key": {0: batch, 1: keys},
        "value": {0: batch, 1: keys},
        "attention_mask": {0: batch, 1: keys},
    }
    return _AttentionGraph(model, weights), (query, key, value, mask), axes


def to_onnx(
    model: nn.Module | Pretrained,
    path: str | Path,
    *,
    weights: bool = False,
    opset: int = DEFAULT_OPSET,
    check: bool = True,
) -> Path:
    """Export ``model`` to an ONNX file with dynamic batch and sequence axes.

    The graph's interface (``attention_mask`` is int64, 1 = real token, 0 = padding):

    - ``MultiHeadAttention``: inputs query (B, L, E), key (B, S, kdim), value (B, S, vdim),
      attention_mask (B, S); output ``output`` (B, L, E).
    - ``TransformerEncoder`` (or one ``TransformerEncoderLayer``): inputs hidden_states
      (B, L, E), attention_mask (B, L); output ``output`` (B, L, E).
    - ``Bert`` or a loaded ``Pretrained``: inputs input_ids (B, L) int64, attention_mask
      (B, L); output ``last_hidden_state`` (B, L, E). L is at most max_position_embeddings.

    With ``weights=True`` the graph also outputs ``attention_weights``: the per-head softmax
    weights, (B, H, L, S) for a ``MultiHeadAttention`` and (layers, B, H, L, L) for the stacks,
    so inspection survives export. Padded keys get weight 0; outputs at padded query
    positions are computed but mean nothing (as in every BERT).

    Args:
        model: the module to export (its training mode is restored afterwards; the export
            runs in eval mode, without dropout).
        path: where to write the ``.onnx`` file (folders are created).
        weights: also output the attention weights.
        opset: ONNX opset version.
        check: run ``onnx.checker.check_model(..., full_check=True)`` on the result.

    Returns:
        The path written.

    Raises:
        TypeError: a model of another type.
        ModuleNotFoundError: onnx / onnxscript missing (the ``export`` extra).
    """
    graph_spec(model, weights=weights)  # type check first, before any import
    onnx = require("onnx", "export", "ONNX export")
    require("onnxscript", "export", "ONNX export")
    spec = graph_spec(model, weights=weights)
    wrapper, example, axes = _prepare(model, weights)
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    modes = [(m, m.training) for m in wrapper.modules()]
    wrapper.eval()
    registration = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = registration.level
    registration.setLevel(logging.ERROR)  # "torchvision is not installed": not our business
    try:
        with torch.no_grad(), warnings.catch_warnings():
            # torch's own notes on its renaming of shared axes and on a deprecated pytree
            # class: nothing the caller can act on
            warnings.filterwarnings("ignore", message=r"# The axis name")
            warnings.filterwarnings("ignore", category=FutureWarning, message=r".*LeafSpec")
            program = torch.onnx.export(
                wrapper,
                example,
                dynamo=True,
                input_names=list(spec.inputs),
                output_names=list(spec.outputs),
                dynamic_shapes=axes,
                opset_version=opset,
                optimize=True,
                verbose=False,
            )
    finally:
        registration.setLevel(level)
        for module, mode in modes:
            module.training = mode
    program.save(str(target))
    if check:
        onnx.checker.check_model(str(target), full_check=True)
    return target
