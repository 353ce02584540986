"""Decoder-only language models: ``CausalLM``, the base of the decoder families, runs a padded
batch (``forward``, ``run``) and extends a ``KVCache`` (``extend``); generation and sampling
come from ``generation.Generation`` and ``sampling``.

Every row of a batch is handled as if it were alone: right-padded rows keep their real tokens
at positions 0..n-1, left-padded rows are moved to that layout first (and the results moved
back), and generation appends each row's new tokens to its own KV-cache prefix, so padding
never shifts a position or leaks into a score.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from .. import _validation as V
from .. import masks
from ..kv import Policy
from ..modules import KVCache, MultiHeadAttention, TransformerDecoder
from .generation import Generation
from .sampling import filter_top_k, filter_top_p

__all__ = ["CausalLM", "CausalLMOutput", "decode_layout", "filter_top_k", "filter_top_p"]

_PADDING_SIDES = ("right", "left")


class CausalLMOutput(NamedTuple):
    """logits (B, L, vocab); hidden_states: embeddings then every layer's output (the last
    one after the final norm) when asked; weights: every layer's per-head weights (B, H, L, L)
    when asked. For left-padded input all of them are in the input's own layout."""

    logits: Tensor
    hidden_states: tuple[Tensor, ...] | None
    weights: tuple[Tensor, ...] | None


def _roll_rows(t: Tensor, shift: Tensor, dim: int) -> Tensor:
    """Row b of ``t`` (batch dim 0) moved left by ``shift[b]`` along ``dim``, cyclically."""
    n = t.shape[dim]
    index = (torch.arange(n, device=t.device)[None] + shift[:, None]) % n  # [B, n]
    shape = [1] * t.dim()
    shape[0], shape[dim] = t.shape[0], n
    return t.gather(dim, index.view(shape).expand(t.shape))


def decode_layout(model: nn.Module) -> None:
    """Store every linear layer's weight transposed in memory: (in, out) contiguous, the layout
    of transformers' GPT-2 ``Conv1D``. Shapes, values and tying stay as they are; only the
    strides change (so ``F.linear`` hands the BLAS a contiguous (in, out) matrix).

    Decoding multiplies one row per sequence by every weight matrix, and torch's CPU BLAS
    streams an (in, out) matrix through such a product faster than an (out, in) one; products of
    many rows (prefill, training) run at the same speed either way. ``state_dict`` tensors are then
    non-contiguous: call ``.contiguous()`` before writing them with safetensors.
    """
    replaced: dict[int, nn.Parameter] = {}
    # plain nn.Linear only: a RowsLinear (modules/few_rows.py) reads its weight as (out, in) rows
    weights = {id(m.weight) for m in model.modules() if type(m) is nn.Linear}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or id(param) not in weights:
                continue
            if id(param) not in replaced:
                stored = param.detach().t().contiguous().t()
                replaced[id(param)] = nn.Parameter(stored, requires_grad=param.requires_grad)
            setattr(module, name, replaced[id(param)])


class CausalLM(Generation, nn.Module):
    """Base of the decoder-only models: ``forward``/``run`` over a padded batch and
    ``generate`` with a ``KVCache``.

    Subclasses build ``self.decoder`` (a ``TransformerDecoder``) and ``self.lm_head``, set
    ``vocab_size``, ``max_positions`` (None: no limit), ``pad_token_id`` and ``eos_token_ids``,
    and implement ``embed(input_ids, positions)``.

    Attributes:
        tokenizer: a ``tokenizers.Tokenizer`` when the folder had ``tokenizer.json``, else None.
        path: the folder the model was loaded from (None when built in memory).
    """

    decoder: TransformerDecoder
    lm_head: nn.Linear
    vocab_size: int
    max_positions: int | None
    pad_token_id: int
    eos_token_ids: list[int]
    tokenizer: Any = None
    path: Path | None = None

    def embed(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        """(B, L) ids at (L,) or (B, L) positions -> (B, L, E)."""
        raise NotImplementedError

    @property
    def shape(self) -> str:
        """The model's sizes in words: "4 layers, E=192, H=6" (and H_kv where it differs)."""
        attn = self._attention
        kv = "" if attn.num_kv_heads == attn.num_heads else f", H_kv={attn.num_kv_heads}"
        return f"{len(self.decoder.layers)} layers, E={attn.embed_dim}, H={attn.num_heads}{kv}"

    def __repr__(self) -> str:
        if self.path is None:
            return super().__repr__()
        return f"{type(self).__name__}(path='{self.path}', {self.shape})"

    @property
    def _attention(self) -> MultiHeadAttention:
        return self.decoder.layers[0].self_attn

    @property
    def _activations(self) -> Tensor:
        """A parameter in the activations' dtype and device: the final norm's weight (the
        output layer may hold packed bf16/int8 weights, whose ``.weight`` dequantizes)."""
        norm = self.decoder.norm
        return norm.weight if norm is not None else self.lm_head.weight

    def new_cache(
        self, batch_size: int, max_length: int | None = None, *, policy: Policy | None = None
    ) -> KVCache:
        """An empty ``KVCache`` for this model (its layers, H_kv, D, dtype and device);
        ``max_length=None`` grows on demand; ``policy`` compresses it (``multihead.kv``)."""
        attn, weight = self._attention, self._activations
        return KVCache(
            len(self.decoder.layers),
            batch_size,
            attn.num_kv_heads,
            attn.head_dim,
            max_length=max_length,
            value_dim=attn.value_head_dim,
            dtype=weight.dtype,
            device=weight.device,
            policy=policy,
        )

    def _rotary_positions(self, positions: Tensor) -> Tensor | None:
        return positions if self._attention.rotary is not None else None

    def _prepare(
        self,
        input_ids: Tensor,
        lengths: Tensor | None,
        padding_side: str,
        attention_mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """Validate a padded batch; return it right-padded, its lengths (B,) and, for left
        padding, each row's shift (B,) to undo the move."""
        _check_input_ids(input_ids)
        if padding_side not in _PADDING_SIDES:
            raise ValueError(
                f"padding_side must be 'right' or 'left'. Received: padding_side={padding_side!r}"
            )
        if attention_mask is not None:
            if lengths is not None:
                raise ValueError("pass lengths or attention_mask, not both. Received: both")
            lengths, padding_side = _from_attention_mask(attention_mask, input_ids.shape)
        lengths = _check_lengths(lengths, input_ids)
        shift = None
        if padding_side == "left":
            shift = input_ids.shape[1] - lengths
            input_ids = _roll_rows(input_ids, shift, 1)
        real = torch.arange(input_ids.shape[1], device=input_ids.device)[None] < lengths[:, None]
        if not V.tracing():  # the id check reads the ids on the host (see V.tracing)
            self._check_vocabulary(input_ids, real)
        # padding may hold any value (a pad id outside the vocabulary, say): nothing sees it,
        # but the embedding lookup still reads it
        return torch.where(real, input_ids, 0), lengths, shift

    def _check_vocabulary(self, input_ids: Tensor, real: Tensor) -> None:
        """Every real token (``real``: (B, L) bool) must be an id of the vocabulary."""
        ids = input_ids[real]
        if int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
            bad = ids[(ids < 0) | (ids >= self.vocab_size)][:5].tolist()
            raise ValueError(
                f"input_ids must be token ids in [0, {self.vocab_size}) (the vocabulary); "
                f"check the tokenizer matches the model. Received: ids {bad}"
            )

    def _check_length(self, need: int, what: str) -> None:
        if self.max_positions is not None and need > self.max_positions:
            raise ValueError(
                f"{what} needs {need} positions but the model has {self.max_positions}; "
                f"shorten the input or ask for fewer new tokens. Received: {need} positions"
            )

    def forward(
        self,
        input_ids: Tensor,
        *,
        lengths: Tensor | None = None,
        padding_side: str = "right",
        attention_mask: Tensor | None = None,
    ) -> Tensor:
        """Logits (B, L, vocab) of a padded batch.

        Args:
            input_ids: (B, L) token ids.
            lengths: (B,) real tokens per row (default: every row is full). The padding of a
                row sees nothing and is seen by nothing; its logits are meaningless.
            padding_side: "right" (real tokens first) or "left" (real tokens last).
            attention_mask: instead of ``lengths`` and ``padding_side``, the (B, L) 0/1 mask
                of transformers (1 = real token); each row's ones must be one block at the
                start (right padding) or all rows' at the end (left padding).
        """
        return self.run(
            input_ids, lengths=lengths, padding_side=padding_side, attention_mask=attention_mask
        ).logits

    def run(
        self,
        input_ids: Tensor,
        *,
        lengths: Tensor | None = None,
        padding_side: str = "right",
        attention_mask: Tensor | None = None,
        weights: bool = True,
        heads: list[int] | None = None,
        return_hidden: bool = False,
    ) -> CausalLMOutput:
        """``forward`` with more, always as a ``CausalLMOutput(logits, hidden_states,
        weights)``.

        Args:
            input_ids, lengths, padding_side, attention_mask: as in ``forward``.
            weights: every layer's per-head weights (B, H, L, L) (default); False leaves
                ``weights`` None and runs on the fast path.
            heads: only these query heads' weights, in every layer (B, len(heads), L, L).
            return_hidden: also every layer's hidden states.
        """
        ids, lengths, shift = self._prepare(input_ids, lengths, padding_side, attention_mask)
        length = ids.shape[1]
        self._check_length(length, "the input")
        positions = torch.arange(length, device=ids.device)
        mask = masks.causal()
        # a traced graph cannot ask whether a row is padded: it always carries the lengths
        if V.tracing() or bool((lengths < length).any()):
            mask = mask & masks.lengths(lengths, query_lens=lengths)
        out = self.decoder.run(
            self.embed(ids, positions),
            mask=mask,
            positions=self._rotary_positions(positions),
            weights=weights,
            heads=heads,
            return_hidden=return_hidden,
        )
        result = CausalLMOutput(self.lm_head(out.output), out.hidden_states, out.weights)
        return result if shift is None else _unshift(result, shift)

    def extend(self, input_ids: Tensor, counts: Tensor | int, cache: KVCache) -> Tensor:
        """Run ``counts[b]`` new tokens of each row through the model on top of ``cache``.

        Args:
            input_ids: (B, L) new tokens, right-padded.
            counts: (B,) real new tokens per row, or one int.
            cache: the ``KVCache`` holding every earlier token (``new_cache``).

        Returns:
            (B, L, E) hidden states after the final norm (``lm_head`` gives logits).
        """
        step = cache.begin(counts, input_ids.shape[1])
        self._check_length(int(cache.lengths.max()), "the cache")
        return self.decoder(self.embed(input_ids, step.positions), cache=cache)


def _unshift(out: CausalLMOutput, shift: Tensor) -> CausalLMOutput:
    """A result computed in the right-padded layout, moved back to the input's left-padded
    one (logits, hidden states by rows; weights by rows and columns)."""
    back = -shift
    logits = _roll_rows(out.logits, back, 1)
    hidden = out.hidden_states
    if hidden is not None:
        hidden = tuple(_roll_rows(h, back, 1) for h in hidden)
    weights = out.weights
    if weights is not None:
        weights = tuple(_roll_rows(_roll_rows(w, back, 2), back, 3) for w in weights)
    return CausalLMOutput(logits, hidden, weights)


def _check_input_ids(input_ids: object) -> None:
    """A (B, L) integer tensor with at least one row of at least one token."""
    if (
        not isinstance(input_ids, Tensor)
        or input_ids.dim() != 2
        or input_ids.dtype == torch.bool
        or input_ids.is_floating_point()
        or input_ids.is_complex()
    ):
        got = (
            f"shape={tuple(input_ids.shape)}, dtype={input_ids.dtype}"
            if isinstance(input_ids, Tensor)
            else f"an object of type {type(input_ids).__name__}"
        )
        raise ValueError(f"input_ids must be a (B, L) integer tensor. Received: {got}")
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(
            "input_ids must hold at least one row of at least one token. "
            f"Received: input_ids.shape={tuple(input_ids.shape)}"
        )


def _check_lengths(lengths: Tensor | None, input_ids: Tensor) -> Tensor:
    """The real tokens per row as a (B,) long tensor on the ids' device (default: all L)."""
    (b, length), device = input_ids.shape, input_ids.device
    if lengths is None:
        return torch.full((b,), length, dtype=torch.long, device=device)
    if not isinstance(lengths, Tensor):
        lengths = torch.as_tensor(lengths)
    if lengths.dtype == torch.bool or lengths.is_floating_point() or lengths.dim() != 1:
        raise ValueError(
            "lengths must be a (B,) integer tensor of real tokens per row. "
            f"Received: lengths.shape={tuple(lengths.shape)}, dtype={lengths.dtype}"
        )
    lengths = lengths.to(device=device, dtype=torch.long)
    if lengths.shape[0] != b or (  # the range is read on the host: not while tracing
        not V.tracing() and (int(lengths.min()) < 1 or int(lengths.max()) > length)
    ):
        raise ValueError(
            f"lengths must have B={b} entries in [1, L={length}] (every row needs a "
            f"real token). Received: lengths={lengths.tolist()}"
        )
    return lengths


def _from_attention_mask(mask: Tensor, shape: torch.Size) -> tuple[Tensor, str]:
    """(lengths, padding side) of a transformers-style (B, L) 0/1 attention mask."""
    if not isinstance(mask, Tensor) or tuple(mask.shape) != tuple(shape) or mask.is_complex():
        got = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
        raise ValueError(
            f"attention_mask must be a (B, L) = {tuple(shape)} tensor of 0/1 (1 = real token). "
            f"Received: {got}"
        )
    real = mask.to(torch.long) != 0
    lengths = real.sum(dim=1)
    ar = torch.arange(shape[1], device=mask.device)[None]
    if bool((real == (ar < lengths[:, None])).all()):
        return lengths, "right"
    if bool((real == (ar >= shape[1] - lengths[:, None])).all()):
        return lengths, "left"
    raise ValueError(
        "attention_mask must mark each row's real tokens as one block, at the start of every "
        "row (right padding) or at the end of every row (left padding). "
        f"Received: attention_mask={real.long().tolist()}"
    )
