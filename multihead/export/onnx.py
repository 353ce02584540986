"""``to_onnx``: trace a multihead model into an ONNX graph with dynamic batch and length axes.

Decoders (``models.gpt2`` / ``models.llama``) export as one graph with the past keys and
values as inputs and the present ones as outputs, in the names onnxruntime-genai and optimum
use, so one graph serves the prefill (past length 0) and every decoding step.

Export goes through ``torch.onnx.export(..., dynamo=True)`` (torch.export, then translation
and graph optimization by onnxscript), the exporter PyTorch maintains. While it traces,
``attention(backend="auto")`` runs the reference backend, whose plain ops (MatMul, Softmax,
Where) carry no data-dependent branch, so one graph serves every batch size and length.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from .. import masks
from .._atomic import replace_file
from .._extras import require
from .._flags import option, required
from ..models.bert import Bert, Pretrained
from ..models.causal_lm import CausalLM
from ..modules import (
    MultiHeadAttention,
    TransformerDecoder,
    TransformerDecoderLayer,
    TransformerEncoder,
    TransformerEncoderLayer,
)

__all__ = [
    "DEFAULT_OPSET",
    "MIN_OPSET",
    "ExportOptions",
    "GraphSpec",
    "check_opset",
    "check_target",
    "exports",
    "graph_spec",
    "load_for_export",
    "run",
    "to_onnx",
]

# multihead.save folders of these export too (besides the model families' own)
_SAVED_MODULES = (
    "multihead.MultiHeadAttention",
    "multihead.TransformerEncoder",
    "multihead.TransformerEncoderLayer",
)

# opset 18 is the newest whose every op onnxruntime >= 1.14 runs on CPU, and it has
# LayerNormalization (17), so nothing is decomposed into slower primitives
DEFAULT_OPSET = 18
# torch's exporter has no op below 18: asked for less, it converts down, and where that fails
# (it does for these graphs) it keeps 18 and says so only in a log line
MIN_OPSET = 18
# graphs whose weights pass this size keep them in a file beside the graph, as torch's
# exporter does (protobuf cannot hold 2 GB)
_EXTERNAL_FROM = 1536 * 1024**2
_EXAMPLE_BATCH, _EXAMPLE_LENGTH, _EXAMPLE_KEYS = 2, 5, 7  # > 1: torch.export specializes 0 and 1
# names of a decoder graph's length axes; the total is how the exporter itself names the
# present's axis (past + new), given to attention_mask too
_PAST, _NEW = "past_sequence", "sequence"
_TOTAL = f"{_PAST} + {_NEW}"


@dataclass(frozen=True)
class GraphSpec:
    """The exported graph's interface.

    inputs / outputs: names in order. ``attention_mask`` is int64 (B, L) or (B, S),
    1 = real token (the Hugging Face convention; True = may attend, as everywhere here).
    """

    kind: str  # "attention", "encoder", "bert" or "decoder"
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]

    def describe(self) -> str:
        """One line: "inputs ...; outputs ...", a decoder's per-layer names folded into
        ``past_key_values.{0..N-1}.key/value``."""

        def fold(names: tuple[str, ...], prefix: str) -> list[str]:
            layers = [n for n in names if n.startswith(prefix + ".")]
            if not layers:
                return list(names)
            first = names.index(layers[0])
            short = f"{prefix}.{{0..{len(layers) // 2 - 1}}}.key/value"
            return [*names[:first], short, *names[first + len(layers) :]]

        inputs = ", ".join(fold(self.inputs, "past_key_values"))
        return f"inputs {inputs}; outputs {', '.join(fold(self.outputs, 'present'))}"


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
        if self.weights:
            return tuple(self.module.run(query, key, value, mask=mask))
        return self.module(query, key, value, mask=mask)


class _EncoderGraph(nn.Module):
    def __init__(self, encoder: TransformerEncoder, weights: bool) -> None:
        super().__init__()
        self.encoder, self.weights = encoder, weights

    def forward(
        self, hidden_states: Tensor, attention_mask: Tensor
    ) -> Tensor | tuple[Tensor, Tensor]:
        mask = _key_mask(attention_mask)
        if self.weights:
            out = self.encoder.run(hidden_states, mask=mask)
            return out.output, torch.stack(out.weights)  # [layers, B, H, L, L]
        return self.encoder(hidden_states, mask=mask)


class _GraphLayerCache:
    """One layer's view of ``_GraphCache``: the ``LayerCache`` interface an attention uses."""

    def __init__(self, cache: _GraphCache, layer: int) -> None:
        self.cache, self.layer = cache, layer

    @property
    def positions(self) -> Tensor:
        return self.cache.positions

    def update(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, masks.Mask]:
        """The past keys (B, H_kv, P, D) and values followed by the new ones (B, H_kv, L, D):
        the layer's present (B, H_kv, P + L, D), recorded as a graph output."""
        past_key, past_value = self.cache.past[2 * self.layer : 2 * self.layer + 2]
        key, value = torch.cat((past_key, key), dim=2), torch.cat((past_value, value), dim=2)
        self.cache.present.extend((key, value))
        return key, value, self.cache.mask


class _GraphCache:
    """The ``KVCache`` interface a ``TransformerDecoder`` threads through its layers, over
    graph inputs: the past arrives as tensors, the present leaves as outputs, and the mask
    comes from ``attention_mask`` instead of per-row lengths held on the host (a traced graph
    cannot read them)."""

    def __init__(self, past: list[Tensor], positions: Tensor, mask: masks.Mask) -> None:
        self.num_layers = len(past) // 2
        self.past, self.positions, self.mask = past, positions, mask
        self.present: list[Tensor] = []

    def __getitem__(self, layer: int) -> _GraphLayerCache:
        return _GraphLayerCache(self, layer)


class _DecoderGraph(nn.Module):
    def __init__(self, lm: CausalLM, weights: bool) -> None:
        super().__init__()
        self.lm, self.weights = lm, weights

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        position_ids: Tensor,
        past_key_values: list[Tensor],
    ) -> tuple[Tensor, ...]:
        # queries are the last L of the P + L keys: causal() is bottom-right aligned, and the
        # key padding (left padding of a batch, any padding of the past) comes on top
        mask = masks.causal() & _key_mask(attention_mask)
        cache = _GraphCache(list(past_key_values), position_ids, mask)
        x = self.lm.embed(input_ids, position_ids)
        if not self.weights:
            return self.lm.lm_head(self.lm.decoder(x, cache=cache)), *cache.present
        out = self.lm.decoder.run(x, cache=cache)
        # [layers, B, H, L, P + L]
        return self.lm.lm_head(out.output), *cache.present, torch.stack(out.weights)


class _BertGraph(nn.Module):
    def __init__(self, bert: Bert, weights: bool) -> None:
        super().__init__()
        self.bert, self.weights = bert, weights

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        out = self.bert.run(input_ids, mask=_key_mask(attention_mask), return_weights=self.weights)
        if self.weights:
            return out.last_hidden_state, torch.stack(out.weights)  # [layers, B, H, L, L]
        return out.last_hidden_state


def graph_spec(model: nn.Module | Pretrained, *, weights: bool = False) -> GraphSpec:
    """The inputs and outputs ``to_onnx`` gives this model (see ``to_onnx``)."""
    extra = ("attention_weights",) if weights else ()
    if isinstance(model, CausalLM):
        layers = range(len(model.decoder.layers))
        past = tuple(f"past_key_values.{i}.{kv}" for i in layers for kv in ("key", "value"))
        present = tuple(f"present.{i}.{kv}" for i in layers for kv in ("key", "value"))
        inputs = ("input_ids", "attention_mask", "position_ids", *past)
        return GraphSpec("decoder", inputs, ("logits", *present, *extra))
    if isinstance(model, TransformerDecoder | TransformerDecoderLayer):
        raise TypeError(
            "a decoder stack exports as part of its language model, which gives it token "
            "embeddings, positions and the output layer: to_onnx(gpt2.load(path)) or "
            f"to_onnx(llama.load(path)). Received: {type(model).__name__}"
        )
    if isinstance(model, Pretrained | Bert):
        return GraphSpec("bert", ("input_ids", "attention_mask"), ("last_hidden_state", *extra))
    if isinstance(model, TransformerEncoder | TransformerEncoderLayer):
        return GraphSpec("encoder", ("hidden_states", "attention_mask"), ("output", *extra))
    if isinstance(model, MultiHeadAttention):
        if model.rotary is not None:
            raise ValueError(
                "a MultiHeadAttention with rotary embeddings needs token positions and is "
                "self-attention only; export the language model it belongs to (to_onnx(lm)), "
                "whose graph takes position_ids. Received: a MultiHeadAttention with rotary="
                f"{model.rotary!r}"
            )
        inputs = ("query", "key", "value", "attention_mask")
        return GraphSpec("attention", inputs, ("output", *extra))
    raise TypeError(
        "to_onnx exports a MultiHeadAttention, a TransformerEncoder or TransformerEncoderLayer, "
        "a models.bert.Bert or a loaded models.bert.Pretrained, or a decoder language model "
        "(models.gpt2.load, models.llama.load). "
        f"Received: {type(model).__name__}"
    )


def _prepare(
    model: nn.Module | Pretrained, weights: bool
) -> tuple[nn.Module, tuple[Tensor, ...], dict[str, dict[int, object]]]:
    """The wrapper module, example inputs (with padding) and dynamic axes for ``model``."""
    batch = torch.export.Dim("batch", min=1)
    b, n = _EXAMPLE_BATCH, _EXAMPLE_LENGTH
    if isinstance(model, CausalLM):
        return _prepare_decoder(model, weights, batch)
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


def _prepare_decoder(
    lm: CausalLM, weights: bool, batch: torch.export.Dim
) -> tuple[nn.Module, tuple[object, ...], dict[str, object]]:
    for i, layer in enumerate(lm.decoder.layers):
        if not isinstance(layer.self_attn, MultiHeadAttention):
            raise TypeError(
                "a decoder exports when every layer's self_attn is a multihead "
                "MultiHeadAttention (it reads and writes the graph's past and present keys "
                f"through the KV-cache interface). Received: layer {i} with self_attn of type "
                f"{type(layer.self_attn).__name__}"
            )
    b, n, p = _EXAMPLE_BATCH, _EXAMPLE_LENGTH, _EXAMPLE_KEYS
    attn, weight = lm._attention, lm.lm_head.weight
    # left padding, as in batched generation: row 1 starts 3 tokens late
    mask = torch.ones(b, p + n, dtype=torch.long)
    mask[1, :3] = 0
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)[:, p:]
    ids = torch.randint(0, lm.vocab_size, (b, n))
    shapes = ((attn.head_dim, attn.num_kv_heads), (attn.value_head_dim, attn.num_kv_heads))
    past = [
        torch.randn(b, heads, p, d, dtype=weight.dtype)
        for _ in lm.decoder.layers
        for d, heads in shapes
    ]
    new = torch.export.Dim(_NEW, min=1)
    old = torch.export.Dim(_PAST, min=0)  # 0: the prefill runs the same graph
    axes = {
        "input_ids": {0: batch, 1: new},
        # past + new: a sum of two axes is no Dim, so the exporter infers it (renamed later)
        "attention_mask": {0: batch, 1: torch.export.Dim.AUTO},
        "position_ids": {0: batch, 1: new},
        "past_key_values": [{0: batch, 2: old} for _ in past],
    }
    return _DecoderGraph(lm, weights), (ids, mask, positions, past), axes


def _name_total_axis(program: object) -> None:
    """Give attention_mask's length axis the name of the present's (past + new)."""
    import onnx_ir as ir

    value = program.model.graph.inputs[1]  # attention_mask
    value.shape = ir.Shape([value.shape[0], _TOTAL])


def exports() -> str:
    """What ``multihead export onnx`` takes: every model family's folders, and
    ``multihead.save`` folders of the modules ``to_onnx`` exports."""
    from ..models import all_families, kinds

    return (
        f"{kinds.listed(all_families())}, and multihead.save folders of a MultiHeadAttention, a "
        "TransformerEncoder or TransformerEncoderLayer, or of a family's model"
    )


def load_for_export(path: str | Path | None) -> nn.Module | Pretrained:
    """The model a folder holds, by its ``config.json``: a model family's (None: the default
    BERT model), or a ``multihead.save`` folder of a module ``to_onnx`` exports (``exports()``
    says which).

    Raises:
        ValueError: a folder of another kind (T5, a saved application model, ...): the message
            names the kind found and what export supports.
    """
    from .. import folder_reading, models
    from ..models import kinds

    if path is None:
        return models.load(None)
    folder = folder_reading.model_folder(path)
    kinds.check_family_kind(folder, "multihead export onnx", exports, saved_classes=_SAVED_MODULES)
    return models.load(folder)


def check_target(path: str | Path) -> Path:
    """Check, before any long work, that an ONNX file can be written at ``path``: not an
    existing folder, no existing file where a folder must be, an existing folder to hold it
    (folders are not created) that is writable (tried by creating and removing a file).

    Raises:
        ValueError: one of those, with the path that blocks it.
        FileNotFoundError: the folder to hold the file does not exist.
    """
    target = Path(path)
    if target.is_dir():
        raise ValueError(
            f"the ONNX file to write is an existing folder; give a file path, e.g. "
            f"{target / 'model.onnx'}. Received: path='{target}'"
        )
    parent = target.parent
    blocker = next((p for p in (parent, *parent.parents) if p.exists()), parent)
    if not blocker.is_dir():
        raise ValueError(
            f"cannot write {target}: {blocker} is an existing file, not a folder; choose "
            f"another path. Received: path='{target}'"
        )
    if not parent.is_dir():
        raise FileNotFoundError(
            f"cannot write {target}: the folder {parent} does not exist, and folders are not "
            f"created for you; make it first (mkdir -p {parent}) or choose another path. "
            f"Received: path='{target}'"
        )
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{target.name}.probe-", dir=parent)
    except OSError as err:
        raise ValueError(
            f"cannot write {target}: creating a file in the folder {parent} failed "
            f"({err.strerror}); choose a writable path or fix the folder's permissions. "
            f"Received: path='{target}'"
        ) from None
    os.close(fd)
    os.unlink(probe)
    return target


def check_opset(opset: int) -> int:
    """Check that torch's exporter writes exactly this opset (see ``MIN_OPSET``) and the
    installed onnx knows it.

    Raises:
        ValueError: an opset out of that range.
    """
    onnx = require("onnx", "export", "ONNX export")
    newest = onnx.defs.onnx_opset_version()
    if isinstance(opset, bool) or not isinstance(opset, int) or not MIN_OPSET <= opset <= newest:
        raise ValueError(
            f"opset must be an int from {MIN_OPSET} (the lowest torch's exporter writes) to "
            f"{newest} (the newest the installed onnx knows). Received: opset={opset!r}"
        )
    return opset


def _data_files(target: Path) -> list[Path]:
    """External-data files ``to_onnx`` wrote for ``target`` (``NAME.<8 hex>.data``), and the
    ``NAME.data`` of torch's own naming."""
    pattern = re.compile(re.escape(target.name) + r"(\.[0-9a-f]{8})?\.data")
    return [p for p in target.parent.iterdir() if pattern.fullmatch(p.name)]


def _save(program: object, target: Path, external: bool | None, check: bool) -> None:
    """Write the graph (and its weights file) so that a kill at any point leaves the previous
    export or the new one, whole: the weights go to a file of a fresh name, the graph to a
    temporary file that is checked and then renamed over ``target``; the weights file of the
    previous export is removed after that rename (a kill before leaves it, and the next export
    removes it)."""
    import onnx
    import onnx_ir as ir

    graph = program.model.graph
    values = [v.const_value for v in graph.initializers.values()]
    size = sum(t.nbytes for t in values if t is not None)
    if external is None:
        external = size > _EXTERNAL_FROM
    data = f"{target.name}.{secrets.token_hex(4)}.data" if external else None
    try:
        with replace_file(target) as tmp:
            if data is None:
                ir.save(program.model, tmp)
            else:
                ir.save(program.model, tmp, external_data=data)
            if check:
                onnx.checker.check_model(str(tmp), full_check=True)
    except BaseException:
        if data is not None:
            (target.parent / data).unlink(missing_ok=True)
        raise
    for old in _data_files(target):
        if old.name != data:
            old.unlink(missing_ok=True)


def to_onnx(
    model: nn.Module | Pretrained,
    path: str | Path,
    *,
    weights: bool = False,
    opset: int = DEFAULT_OPSET,
    check: bool = True,
    external_data: bool | None = None,
) -> Path:
    """Export ``model`` to an ONNX file with dynamic batch and sequence axes.

    The graph's interface (``attention_mask`` is int64, 1 = real token, 0 = padding):

    - ``MultiHeadAttention``: inputs query (B, L, E), key (B, S, kdim), value (B, S, vdim),
      attention_mask (B, S); output ``output`` (B, L, E).
    - ``TransformerEncoder`` (or one ``TransformerEncoderLayer``): inputs hidden_states
      (B, L, E), attention_mask (B, L); output ``output`` (B, L, E).
    - ``Bert`` or a loaded ``Pretrained``: inputs input_ids (B, L) int64, attention_mask
      (B, L); output ``last_hidden_state`` (B, L, E). L is at most max_position_embeddings.
    - a decoder language model (``models.gpt2.load``, ``models.llama.load``): one graph for
      the prefill and every decoding step, named as in onnxruntime-genai and optimum. Inputs
      input_ids (B, L) int64, attention_mask (B, P + L) int64 over the past and the new
      tokens (padding anywhere, usually on the left), position_ids (B, L) int64 (with left
      padding ``cumsum(attention_mask) - 1`` of the new tokens), and for every layer i
      ``past_key_values.{i}.key`` / ``.value`` (B, H_kv, P, D) (P = 0 for the prefill).
      Outputs logits (B, L, vocab) and ``present.{i}.key`` / ``.value`` (B, H_kv, P + L, D):
      the past followed by the new tokens' keys (after RoPE for Llama), fed back as the next
      step's past. Each new token sees the real tokens up to its own place (causal, aligned
      bottom-right: the L queries are the last L of the P + L keys). Logits at padded
      positions mean nothing. GPT-2's position_ids must stay below n_positions.

    With ``weights=True`` the graph also outputs ``attention_weights``: the per-head softmax
    weights, (B, H, L, S) for a ``MultiHeadAttention``, (layers, B, H, L, L) for the stacks
    and (layers, B, H, L, P + L) for a decoder (after the presents), so inspection survives
    export. Padded keys get weight 0; outputs at padded query positions are computed but
    mean nothing (as in every BERT).

    The file is written whole or not at all: a previous file at ``path`` stays until the new
    graph has been written and checked, and is then replaced in one rename (its weights file,
    if it had one, is removed after).

    Args:
        model: the module to export (its training mode is restored afterwards; the export
            runs in eval mode, without dropout).
        path: where to write the ``.onnx`` file, in an existing folder (folders are not
            created); checked before the export starts (``check_target``).
        weights: also output the attention weights.
        opset: ONNX opset version, from ``MIN_OPSET`` (18) to the newest the installed onnx
            knows; the graph written has exactly this version.
        check: run ``onnx.checker.check_model(..., full_check=True)`` on the result.
        external_data: keep the weights in a file beside the graph, named
            ``<file name>.<8 hex digits>.data`` (the graph records the name); None: only when
            they pass 1.5 GiB, as torch does.

    Returns:
        The path written.

    Raises:
        TypeError: a model of another type (a bare decoder stack included: export its
            language model), or a decoder layer whose self_attn is not a MultiHeadAttention.
        ValueError: a MultiHeadAttention with rotary embeddings on its own, an opset out of
            range, or a path that cannot be written (an existing folder, a file where a
            folder must be, a folder without write permission).
        ModuleNotFoundError: onnx / onnxscript missing (the ``export`` extra).
    """
    graph_spec(model, weights=weights)  # type check first, before any import
    target = check_target(path)
    require("onnx", "export", "ONNX export")
    require("onnxscript", "export", "ONNX export")
    check_opset(opset)
    if external_data is not None and not isinstance(external_data, bool):
        raise TypeError(
            f"external_data must be True, False or None. Received: external_data={external_data!r}"
        )
    spec = graph_spec(model, weights=weights)
    wrapper, example, axes = _prepare(model, weights)
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
    if spec.kind == "decoder":
        _name_total_axis(program)
    written = program.model.opset_imports.get("")
    if written != opset:
        raise ValueError(
            f"torch's exporter wrote opset {written} instead of the {opset} asked for (its "
            f"conversion to {opset} failed); nothing was written. Use opset={DEFAULT_OPSET}. "
            f"Received: opset={opset}"
        )
    _save(program, target, external_data, check)
    return target


@dataclass(frozen=True, kw_only=True)
class ExportOptions:
    """What ``multihead export onnx`` takes (``multihead export onnx --help``)."""

    model: Path | None = option(
        None,
        "model folder: BERT family, GPT-2 or Llama (config.json) (default: all-MiniLM-L6-v2)",
        metavar="PATH",
    )
    out: Path = required("where to write it (its folder must exist)", metavar="FILE.onnx")
    weights: bool = option(False, "also output every layer's per-head weights")
    opset: int = option(DEFAULT_OPSET, "ONNX opset version")


def run(options: ExportOptions, *, say: Callable[[str], None] = print) -> Path:
    """``multihead export onnx``: check the target and the opset, load the folder's model,
    export it, and say what the graph takes and gives."""
    from .._progress import stages

    check_target(options.out)  # before the model loads and the export runs
    check_opset(options.opset)
    with stages("export onnx", ("loading the model", "exporting and checking")) as (bar, _):
        bar.begin("loading the model")
        model = load_for_export(options.model)
        bar.begin("exporting and checking")
        path = to_onnx(model, options.out, weights=options.weights, opset=options.opset)
    spec = graph_spec(model, weights=options.weights)
    say(f"wrote {path} ({spec.describe()}); onnx.checker: ok")
    return path
