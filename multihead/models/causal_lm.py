"""Decoder-only language models: padded batches, cached generation and sampling, shared by the
gpt2 and llama loaders.

Every row of a batch is handled as if it were alone: right-padded rows keep their real tokens
at positions 0..n-1, left-padded rows are moved to that layout first (and the results moved
back), and generation appends each row's new tokens to its own KV-cache prefix, so padding
never shifts a position or leaks into a score.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, overload

import torch
from torch import Tensor, nn

from .. import _validation as V
from .. import masks
from ..modules import KVCache, MultiHeadAttention, TransformerDecoder, quant

__all__ = ["CausalLM", "CausalLMOutput", "decode_layout", "filter_top_k", "filter_top_p"]

_PADDING_SIDES = ("right", "left")


class CausalLMOutput(NamedTuple):
    """logits (B, L, vocab); hidden_states: embeddings then every layer's output (the last
    one after the final norm) when asked; weights: every layer's per-head weights (B, H, L, L)
    when asked. For left-padded input all of them are in the input's own layout."""

    logits: Tensor
    hidden_states: tuple[Tensor, ...] | None
    weights: tuple[Tensor, ...] | None


def filter_top_k(scores: Tensor, k: int | None) -> Tensor:
    """Keep the k highest scores of each row (and any tied with the k-th), -inf elsewhere.

    scores: (B, vocab) logits (after temperature)."""
    if k is None or k >= scores.shape[-1]:
        return scores
    kth = torch.topk(scores, k, dim=-1).values[..., -1:]
    return scores.masked_fill(scores < kth, float("-inf"))


def filter_top_p(scores: Tensor, p: float | None) -> Tensor:
    """Nucleus filtering (Holtzman et al. 2020): keep the most likely tokens until their total
    probability reaches ``p`` (the token that crosses it included, the top token always),
    -inf elsewhere. scores: (B, vocab)."""
    if p is None or p >= 1.0:
        return scores
    ordered, order = scores.sort(dim=-1, descending=True)
    probs = ordered.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # probability of the tokens ranked above
    drop = (before >= p).scatter(-1, order, before >= p)
    return scores.masked_fill(drop, float("-inf"))


def decode_layout(model: nn.Module) -> None:
    """Store every linear layer's weight transposed in memory: (in, out) contiguous, the layout
    of transformers' GPT-2 ``Conv1D``. Shapes, values and tying stay as they are; only the
    strides change (so ``F.linear`` hands the BLAS a contiguous (in, out) matrix).

    Decoding multiplies one row per sequence by every weight matrix, and torch's CPU BLAS
    streams an (in, out) matrix through such a product about 1.5x faster than an (out, in) one
    (measured on GPT-2-small shapes: 18 against 12 GB/s); products of many rows (prefill,
    training) run at the same speed either way. ``state_dict`` tensors are then
    non-contiguous: call ``.contiguous()`` before writing them with safetensors.
    """
    replaced: dict[int, nn.Parameter] = {}
    # plain nn.Linear only: a RowsLinear (modules/quant.py) reads its weight as (out, in) rows
    weights = {id(m.weight) for m in model.modules() if type(m) is nn.Linear}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or id(param) not in weights:
                continue
            if id(param) not in replaced:
                stored = param.detach().t().contiguous().t()
                replaced[id(param)] = nn.Parameter(stored, requires_grad=param.requires_grad)
            setattr(module, name, replaced[id(param)])


def _roll_rows(t: Tensor, shift: Tensor, dim: int) -> Tensor:
    """Row b of ``t`` (batch dim 0) moved left by ``shift[b]`` along ``dim``, cyclically."""
    n = t.shape[dim]
    index = (torch.arange(n, device=t.device)[None] + shift[:, None]) % n  # [B, n]
    shape = [1] * t.dim()
    shape[0], shape[dim] = t.shape[0], n
    return t.gather(dim, index.view(shape).expand(t.shape))


def load_checkpoint(
    path: str | Path,
    model_cls: Callable[[Any], CausalLM],
    config_cls: Any,
    *,
    prefix: str,
    names: Callable[[Any, bool], dict[str, Any]],
    unused_suffixes: tuple[str, ...],
    dtype: torch.dtype,
    weights: str | None = None,
) -> Any:
    """The loading sequence gpt2.load and llama.load share: read and validate config.json and
    the tokenizer (when present); check the config against the weights' header (names,
    shapes, dtypes, ``prefix`` stripped) on a model built on the meta device, so a wrong
    config allocates nothing; then build the model, read the weights and assign them with
    ``names(config, tied)`` (never a partial load; ``unused_suffixes`` and a tied output layer
    saved anyway are the only tensors allowed to be left over), then eval mode in the
    decoding layout with ``.tokenizer`` and ``.path`` set: float32 linear layers become
    ``RowsLinear`` (few-row products on every core), or ``PackedLinear`` with ``weights``
    "bf16" / "int8" (``modules/quant.py``)."""
    from .. import checkpoint

    check_weights(weights, dtype)
    folder = checkpoint.model_folder(path)
    config = config_cls.from_dict(checkpoint.read_config(folder))
    tokenizer = checkpoint.read_tokenizer(folder, required=False)
    stored = checkpoint.weights(folder).renamed(lambda k: k.removeprefix(prefix))
    tied = config.tie_word_embeddings

    def unused(name: str) -> bool:  # a tied output layer saved anyway is the embeddings again
        return name.endswith(unused_suffixes) or (tied and name == "lm_head.weight")

    skeleton = checkpoint.build_on_meta(lambda: model_cls(config), stored)
    names_of = names(config, tied)  # after the meta build, which stops absurd layer counts
    if skeleton is not None:
        own = skeleton.state_dict()
        checkpoint.match(own, stored.header, names_of, weights=stored, unused=unused)
        checkpoint.check_unstored(skeleton, stored)
    model = model_cls(config)
    checkpoint.assign(model, stored.read(), names_of, weights=stored, unused=unused)
    model.to(dtype).eval()
    if dtype == torch.float32:
        quant.pack_linears(model, weights)
    decode_layout(model)
    model.tokenizer, model.path = tokenizer, folder
    return model


def check_token_ids(config: Any, source: str = "config.json") -> None:
    """``bos_token_id``, ``eos_token_id`` (an id or a list) and ``pad_token_id`` of a decoder
    config must be ids of its vocabulary: an id past ``vocab_size`` can never be generated
    (so it never stops a row) and would pad the output with a token the model cannot embed.

    Raises:
        ValueError: naming the field, its value and ``vocab_size``.
    """
    v = config.vocab_size
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(config, name)
        ids = [] if value is None else [value] if isinstance(value, int) else list(value)
        bad = [i for i in ids if not 0 <= i < v]
        if bad:
            raise ValueError(
                f"{source}: {name} must be a token id in [0, vocab_size={v}) (set it to an id "
                f"of the vocabulary, or to null). Received: {name}={value!r}"
            )


def check_weights(weights: str | None, dtype: torch.dtype) -> None:
    """Refuse a ``weights=`` value that is not None, "bf16" or "int8", or one combined with a
    ``dtype`` other than float32 (packed weights take float32 activations)."""
    if weights is not None and weights not in quant.WEIGHT_FORMATS:
        raise ValueError(
            "weights must be None (the weights in dtype), 'bf16' or 'int8' (weight-only formats "
            f"for the linear layers, float32 activations). Received: weights={weights!r}"
        )
    if weights is not None and dtype != torch.float32:
        raise ValueError(
            f"weights={weights!r} packs the linear layers for float32 activations; pass "
            f"dtype=torch.float32 (the default) with it. Received: dtype={dtype}"
        )


class CausalLM(nn.Module):
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
    def _attention(self) -> MultiHeadAttention:
        return self.decoder.layers[0].self_attn

    @property
    def _activations(self) -> Tensor:
        """A parameter in the activations' dtype and device: the final norm's weight (the
        output layer may hold packed bf16/int8 weights, whose ``.weight`` dequantizes)."""
        norm = self.decoder.norm
        return norm.weight if norm is not None else self.lm_head.weight

    def new_cache(self, batch_size: int, max_length: int | None = None) -> KVCache:
        """An empty ``KVCache`` for this model (its layers, H_kv, D, dtype and device);
        ``max_length=None`` grows on demand."""
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

    def _check_memory(self, batch_size: int, total: int, max_new_tokens: int) -> None:
        """Refuse, before allocating anything, a generation whose KV cache (preallocated for
        ``total`` tokens per row) and token buffers would not fit in the memory free on the
        model's device."""
        attn, weight = self._attention, self._activations
        layers = len(self.decoder.layers)
        itemsize = weight.element_size()
        d, d_v = attn.head_dim, attn.value_head_dim
        cache = layers * batch_size * attn.num_kv_heads * total * (d + d_v) * itemsize
        buffers = 2 * batch_size * (total + max_new_tokens) * 8  # new ids and the output, int64
        free = _free_bytes(weight.device)
        if free is None or cache + buffers <= free:
            return
        raise ValueError(
            f"generating {max_new_tokens} new tokens needs a KV cache of {_bytes(cache)} "
            f"({layers} layers x B={batch_size} x H_kv={attn.num_kv_heads} x T={total} tokens "
            f"x (D={d} + D_v={d_v}) x {itemsize} bytes) plus {_bytes(buffers)} of token ids, "
            f"more than the {_bytes(free)} free on {weight.device}; ask for fewer new tokens, "
            f"a smaller batch or a lower-precision dtype. Received: max_new_tokens="
            f"{max_new_tokens}, batch of {batch_size}, longest prompt {total - max_new_tokens}"
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

    @torch.inference_mode()
    def generate(
        self,
        input_ids: Tensor,
        max_new_tokens: int,
        *,
        lengths: Tensor | None = None,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        generator: torch.Generator | None = None,
        padding_side: str = "right",
        attention_mask: Tensor | None = None,
        eos_token_id: int | Sequence[int] | None = None,
    ) -> Tensor:
        """Greedy or sampled continuation of every row, with a ``KVCache``: token ids in,
        token ids out (text goes through ``generate_text`` and ``stream_text``).

        The prompts run once (prefill); then each step feeds one new token per row. Row b's
        new tokens follow its own last real token, so rows of any lengths decode together
        and each gets the tokens it would get alone.

        Args:
            input_ids: (B, L) prompt token ids.
            max_new_tokens: tokens to add to every row.
            lengths: (B,) real prompt tokens per row (default: all L).
            do_sample: sample instead of taking the most likely token.
            temperature: divides the logits before sampling: finite and > 0. As it nears 0,
                sampling nears the greedy choice, which a tiny temperature (1e-45, say) gives
                exactly; large values near uniform sampling.
            top_k: sample among the k most likely tokens only.
            top_p: sample from the smallest set of tokens whose probability reaches p.
            generator: a ``torch.Generator`` for reproducible sampling.
            padding_side: "right" (default) or "left" padding of ``input_ids``.
            attention_mask: instead of ``lengths`` and ``padding_side``, transformers' (B, L)
                0/1 mask, as in ``forward``.
            eos_token_id: stop a row at this token (or any of these): its later tokens are
                ``pad_token_id``. Default: never (every row gets max_new_tokens tokens).

        Raises:
            TypeError: text instead of ids (call ``generate_text``).
            ValueError: a bad argument (named), a prompt with its new tokens longer than the
                model's positions (``max_positions``), or a KV cache that would not fit in the
                memory free on the model's device (checked before anything is allocated).

        Returns:
            (B, L + max_new_tokens) ids. Right padding: row b holds its prompt, then its new
            tokens, then ``pad_token_id``. Left padding: ``input_ids`` followed by the new
            tokens.
        """
        if isinstance(input_ids, str) or _holds_text(input_ids):
            raise TypeError(
                "generate takes token ids (B, L); for text in and text out call "
                "generate_text(text, max_new_tokens, ...) (or stream_text for the new text "
                f"piece by piece). Received: {_describe(input_ids)}"
            )
        choose = _Sampling.checked(max_new_tokens, do_sample, temperature, top_k, top_p, generator)
        stop = _eos_list(eos_token_id)
        ids, lengths, shift = self._prepare(input_ids, lengths, padding_side, attention_mask)
        self._check_budget(ids.shape[0], int(lengths.max()), max_new_tokens)
        new = torch.full(
            (ids.shape[0], max_new_tokens), self.pad_token_id, dtype=ids.dtype, device=ids.device
        )
        for t, token in enumerate(self._steps(ids, lengths, max_new_tokens, choose, stop)):
            new[:, t] = token
        if shift is not None:
            return torch.cat((input_ids, new), dim=1)
        real = torch.arange(ids.shape[1], device=ids.device)[None] < lengths[:, None]
        prompts = torch.where(real, ids, self.pad_token_id)
        out = torch.cat((prompts, torch.full_like(new, self.pad_token_id)), dim=1)
        at = lengths[:, None] + torch.arange(max_new_tokens, device=ids.device)
        return out.scatter(1, at, new)

    @overload
    def generate_text(
        self,
        text: str,
        max_new_tokens: int,
        *,
        do_sample: bool = ...,
        temperature: float = ...,
        top_k: int | None = ...,
        top_p: float | None = ...,
        generator: torch.Generator | None = ...,
        eos_token_id: int | Sequence[int] | None = ...,
    ) -> str: ...

    @overload
    def generate_text(
        self,
        text: Sequence[str],
        max_new_tokens: int,
        *,
        do_sample: bool = ...,
        temperature: float = ...,
        top_k: int | None = ...,
        top_p: float | None = ...,
        generator: torch.Generator | None = ...,
        eos_token_id: int | Sequence[int] | None = ...,
    ) -> list[str]: ...

    @torch.inference_mode()
    def generate_text(
        self,
        text: str | Sequence[str],
        max_new_tokens: int,
        *,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        generator: torch.Generator | None = None,
        eos_token_id: int | Sequence[int] | None = None,
    ) -> str | list[str]:
        """Text in, text out: each prompt followed by its continuation, decoded.

        A str gives a str; a list of str gives a list of str (the prompts decode together as
        one batch, each as if alone). Needs the model's tokenizer.

        Args:
            text: a prompt, or a non-empty list of prompts (each with at least one token).
            max_new_tokens, do_sample, temperature, top_k, top_p, generator: as in
                ``generate``.
            eos_token_id: stop a prompt's continuation at this token (or any of these);
                default the model's end-of-sequence tokens. Special tokens are left out of
                the text.

        Raises:
            TypeError: token ids (call ``generate``), or anything but a str or a list of str.
            ValueError: as ``generate``; a model without tokenizer; a prompt with no tokens.
        """
        single = isinstance(text, str)
        texts = self._check_texts([text] if single else text, "generate_text")
        choose = _Sampling.checked(max_new_tokens, do_sample, temperature, top_k, top_p, generator)
        stop = self._text_stops(eos_token_id)
        ids, lengths = self._tokenize_prompts(texts)
        self._check_budget(ids.shape[0], int(lengths.max()), max_new_tokens)
        new: list[list[int]] = [[] for _ in texts]
        for token in self._steps(ids, lengths, max_new_tokens, choose, stop):
            for row, t in zip(new, token.tolist()):
                row.append(t)
        decoded = [
            self.tokenizer.decode(row[:n] + _cut_after_stop(extra, stop), skip_special_tokens=True)
            for row, n, extra in zip(ids.tolist(), lengths.tolist(), new)
        ]
        return decoded[0] if single else decoded

    def stream_text(
        self,
        text: str,
        max_new_tokens: int,
        *,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        generator: torch.Generator | None = None,
        eos_token_id: int | Sequence[int] | None = None,
    ) -> Iterator[str]:
        """The continuation of one prompt, yielded piece by piece as the tokens are produced.

        Each piece is the text the new tokens add, yielded as soon as it is complete UTF-8 (a
        character split across byte-level tokens waits for its last byte); the pieces joined
        are exactly the continuation ``generate_text`` returns after the prompt for the same
        arguments (and the same generator state). Arguments are checked when this is called,
        before the first token.

        Args:
            text: one prompt (str).
            max_new_tokens, do_sample, temperature, top_k, top_p, generator, eos_token_id: as
                in ``generate_text``.
        """
        if not isinstance(text, str):
            raise TypeError(
                "stream_text takes one prompt (a str); for a batch call generate_text, for "
                f"token ids generate. Received: {_describe(text)}"
            )
        self._check_texts([text], "stream_text")
        choose = _Sampling.checked(max_new_tokens, do_sample, temperature, top_k, top_p, generator)
        stop = self._text_stops(eos_token_id)
        ids, lengths = self._tokenize_prompts([text])
        self._check_budget(1, int(lengths.max()), max_new_tokens)
        tokens = (int(t) for t in self._steps(ids, lengths, max_new_tokens, choose, stop))
        return _stream_pieces(self.tokenizer, ids[0].tolist(), tokens)

    def _check_budget(self, batch_size: int, longest: int, max_new_tokens: int) -> None:
        """Refuse a generation that would not fit the positions or the free memory."""
        total = longest + max_new_tokens
        self._check_length(total, "the longest prompt with its new tokens")
        if max_new_tokens:
            self._check_memory(batch_size, total, max_new_tokens)

    @torch.inference_mode()
    def _steps(
        self,
        ids: Tensor,
        lengths: Tensor,
        max_new_tokens: int,
        choose: _Sampling,
        stop: list[int],
    ) -> Iterator[Tensor]:
        """Yield each step's new token of every row (B,), prefill first. A row that has
        produced a stop token gets ``pad_token_id`` from then on; the steps end after
        ``max_new_tokens`` or once every row has stopped."""
        if not max_new_tokens:
            return
        b = ids.shape[0]
        cache = self.new_cache(b, max_length=int(lengths.max()) + max_new_tokens)
        hidden = self.extend(ids, lengths, cache)
        last = hidden[torch.arange(b, device=ids.device), lengths - 1]  # [B, E]
        done = torch.zeros(b, dtype=torch.bool, device=ids.device)
        stops = torch.tensor(stop, dtype=ids.dtype, device=ids.device)
        for t in range(max_new_tokens):
            token = choose(self.lm_head(last))  # [B]
            if stop:
                token = torch.where(done, self.pad_token_id, token)
                done |= torch.isin(token, stops)
            yield token
            if t + 1 == max_new_tokens or (stop and bool(done.all())):
                return
            last = self.extend(token[:, None], 1, cache)[:, 0]

    def _check_texts(self, texts: object, where: str) -> list[str]:
        if self.tokenizer is None:
            raise ValueError(
                f"this model has no tokenizer (its folder had no tokenizer.json); {where} "
                "needs one: call generate with token ids (B, L) instead. Received: text"
            )
        if isinstance(texts, Tensor):
            raise TypeError(
                f"{where} takes text; for token ids call generate(input_ids, max_new_tokens). "
                f"Received: {_describe(texts)}"
            )
        texts = list(texts) if isinstance(texts, (list, tuple)) else texts
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            got = [type(t).__name__ for t in texts] if isinstance(texts, list) else texts
            raise TypeError(
                f"text input must be a string or a non-empty list of strings. Received: {got!r}"
            )
        return texts

    def _text_stops(self, eos_token_id: int | Sequence[int] | None) -> list[int]:
        if eos_token_id is None:
            return list(self.eos_token_ids or [])
        return _eos_list(eos_token_id)

    def _tokenize_prompts(self, texts: list[str]) -> tuple[Tensor, Tensor]:
        """Right-padded ids (B, L) and lengths (B,) of the prompts, on the model's device."""
        encodings = self.tokenizer.encode_batch(texts)
        for i, e in enumerate(encodings):
            if not e.ids:
                raise ValueError(
                    f"text {i} has no tokens; give it some words. Received: {texts[i]!r}"
                )
        lengths = torch.tensor([len(e.ids) for e in encodings])
        ids = torch.full((len(texts), int(lengths.max())), self.pad_token_id, dtype=torch.long)
        for i, e in enumerate(encodings):
            ids[i, : len(e.ids)] = torch.tensor(e.ids)
        device = self._activations.device  # the norm's: a packed lm_head would dequantize
        ids, lengths, _ = self._prepare(ids.to(device), lengths.to(device), "right")
        return ids, lengths


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


def _stream_pieces(tokenizer: Any, prompt: list[int], tokens: Iterator[int]) -> Iterator[str]:
    """The text each new token adds, once it is complete.

    Decodes a short window (from the token before the last emitted text) rather than the
    whole sequence, so each step costs the same; the window keeps one earlier token so that
    decoders which treat a sequence's first token specially (SentencePiece's leading space)
    see the new tokens in context. Text ending in U+FFFD (a character whose bytes have not
    all arrived) is held back until it completes, or until the end, where whatever is left
    is yielded as the full decode would show it."""
    ids = list(prompt)
    start, read = max(len(ids) - 1, 0), len(ids)  # window start; tokens before read are out
    for token in tokens:
        ids.append(token)
        before = tokenizer.decode(ids[start:read], skip_special_tokens=True)
        after = tokenizer.decode(ids[start:], skip_special_tokens=True)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            yield after[len(before) :]
            start, read = read, len(ids)
    if read < len(ids):
        before = tokenizer.decode(ids[start:read], skip_special_tokens=True)
        rest = tokenizer.decode(ids[start:], skip_special_tokens=True)[len(before) :]
        if rest:
            yield rest


def _cut_after_stop(tokens: list[int], stop: list[int]) -> list[int]:
    """``tokens`` up to and including the first stop token (the rest is padding)."""
    for j, t in enumerate(tokens):
        if t in stop:
            return tokens[: j + 1]
    return tokens


def _holds_text(value: object) -> bool:
    return isinstance(value, (list, tuple)) and any(isinstance(t, str) for t in value)


def _describe(value: object) -> str:
    if isinstance(value, Tensor):
        return f"a tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    if isinstance(value, str):
        return f"the text {value[:40]!r}"
    return f"an object of type {type(value).__name__}"


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


def _free_bytes(device: torch.device) -> int | None:
    """Bytes that can still be allocated on ``device``: on CUDA the driver's free memory plus
    what torch's caching allocator holds unused; on CPU the kernel's MemAvailable (Linux) or
    the physical memory; None where it cannot be told."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        held = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return free + held
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as file:
            for line in file:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def _bytes(n: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _eos_list(eos: int | Sequence[int] | None) -> list[int]:
    if eos is None:
        return []
    values = [eos] if isinstance(eos, int) else list(eos)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ValueError(
            f"eos_token_id must be a token id or a list of them. Received: eos_token_id={eos!r}"
        )
    return values


def _check_sampling(
    do_sample: bool,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None,
) -> None:
    if not isinstance(do_sample, bool):
        raise TypeError(f"do_sample must be a bool. Received: do_sample={do_sample!r}")
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, (int, float))
        or not (0 < temperature < math.inf)
    ):
        raise ValueError(
            "temperature must be a finite number > 0 (use do_sample=False for the most likely "
            f"token). Received: temperature={temperature!r}"
        )
    _check_filters(top_k, top_p)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(
            f"generator must be a torch.Generator. Received: {type(generator).__name__}"
        )


@dataclass(frozen=True)
class _Sampling:
    """How each step picks its token: the most likely one, or a sample."""

    do_sample: bool
    temperature: float
    top_k: int | None
    top_p: float | None
    generator: torch.Generator | None

    @classmethod
    def checked(
        cls,
        max_new_tokens: int,
        do_sample: bool,
        temperature: float,
        top_k: int | None,
        top_p: float | None,
        generator: torch.Generator | None,
    ) -> _Sampling:
        """Check ``max_new_tokens`` and the sampling options (named in each message)."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
            raise TypeError(
                f"max_new_tokens must be an int. Received: max_new_tokens={max_new_tokens!r}"
            )
        if max_new_tokens < 0:
            raise ValueError(
                f"max_new_tokens must be >= 0. Received: max_new_tokens={max_new_tokens}"
            )
        _check_sampling(do_sample, temperature, top_k, top_p, generator)
        return cls(do_sample, temperature, top_k, top_p, generator)

    def __call__(self, logits: Tensor) -> Tensor:
        """(B, vocab) logits -> (B,) tokens."""
        if not self.do_sample:
            return logits.argmax(dim=-1)
        return _sample(logits, self.temperature, self.top_k, self.top_p, self.generator)


def _check_filters(top_k: int | None, top_p: float | None) -> None:
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be a positive int or None. Received: top_k={top_k!r}")
    if top_p is not None and (
        isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1
    ):
        raise ValueError(f"top_p must be in (0, 1] or None. Received: top_p={top_p!r}")


def _sample(
    logits: Tensor,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None,
) -> Tensor:
    """One token per row from softmax(logits / temperature), after top-k then top-p (the
    order transformers applies them in).

    The logits are shifted by their row maximum before the division (softmax does not change)
    and divided in float64, where every finite temperature > 0 is itself representable (in
    float32 5e-324 is 0): the scores are then <= 0, so a tiny temperature drives them to -inf
    but never makes inf or NaN, and sampling tends to the greedy choice (tokens tied at the
    maximum share it)."""
    logits = logits.double()
    shifted = logits - logits.max(dim=-1, keepdim=True).values
    scores = filter_top_p(filter_top_k(shifted / temperature, top_k), top_p)
    return torch.multinomial(scores.softmax(dim=-1), 1, generator=generator)[:, 0]


# ---------------------------------------------------------------------------------------------
# saving: the decoder families (gpt2.py, llama.py) register themselves through this


def _save_tokenizer(model: CausalLM, folder: Path) -> None:
    if model.tokenizer is not None:
        model.tokenizer.save(str(folder / "tokenizer.json"))


def _restore_tokenizer(model: CausalLM, folder: Path) -> None:
    if (folder / "tokenizer.json").is_file():
        from .. import checkpoint

        model.tokenizer = checkpoint.read_tokenizer(folder, required=False)
    model.path = folder


def register_family(
    model_type: str,
    cls: type[CausalLM],
    config_cls: Any,
    loader: Callable[[Path], CausalLM],
) -> None:
    """Make a decoder family saveable by ``multihead.save`` (its config as data plus the
    weights under this library's names; the tokenizer, when the model has one, beside them as
    tokenizer.json) and openable by ``multihead.models.load`` through its ``model_type``. A
    loaded model keeps the decoding layout of ``decode_layout``."""
    from dataclasses import asdict

    from .. import io
    from .families import register_builtin

    def build(args: dict[str, Any]) -> CausalLM:
        model = cls(config_cls.from_dict(args["config"], source="config.json model.args"))
        quant.pack_linears(model, None)
        decode_layout(model)
        return model.eval()

    io.register(
        cls,
        name=f"{cls.__module__}.{cls.__qualname__}",
        describe=lambda model: {"config": asdict(model.config)},
        build=build,
        files=_save_tokenizer,
        restore=_restore_tokenizer,
    )
    register_builtin(model_type, loader)
