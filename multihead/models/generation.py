"""Generation for ``CausalLM``: greedy or sampled continuation with a ``KVCache``, token ids
in and out (``generate``), text in and out (``generate_text``) or streamed piece by piece
(``stream_text``); stop tokens, and a memory budget checked before anything is allocated.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, overload

import torch
from torch import Tensor

from ..kv import Policy
from .sampling import Sampler

__all__ = ["Generation"]


class Generation:
    """What ``CausalLM`` inherits for generation. It reads the model's ``_prepare``,
    ``extend``, ``new_cache``, ``lm_head``, ``tokenizer``, ``pad_token_id`` and
    ``eos_token_ids``."""

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
        streamer: Any = None,
        compress: Policy | None = None,
        chunk: int | None = None,
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
            streamer: an object with ``put`` and ``end``, as transformers' ``generate`` takes
                (``transformers.TextStreamer``, a ``BaseStreamer`` of your own): ``put`` gets
                ``input_ids`` first, then each step's new token of every row (B,) as soon as
                it is chosen; ``end()`` comes after the last.
            compress: a ``multihead.kv`` policy: the KV cache is compressed from the
                attention's own scores after the prompt (and kept at its budget while
                decoding for H2O, TOVA and StreamingLLM); see ``KVCache(policy=)``.
            chunk: with ``compress``, run the prompt ``chunk`` tokens at a time and cut every
                layer's cache back to the policy's budget after each chunk, from that
                chunk's statistics: the memory above the weights then grows with the budget
                and ``chunk``, not with the prompt. None (default): the prompt runs whole.

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
        choose = Sampler.checked(max_new_tokens, do_sample, temperature, top_k, top_p, generator)
        stop = _eos_list(eos_token_id)
        _check_chunk(chunk, compress)
        ids, lengths, shift = self._prepare(input_ids, lengths, padding_side, attention_mask)
        self._check_budget(ids.shape[0], int(lengths.max()), max_new_tokens)
        if streamer is not None and not (callable(getattr(streamer, "put", None))
                                         and callable(getattr(streamer, "end", None))):  # fmt: skip
            raise TypeError(
                "streamer must have put(ids) and end() methods, as transformers' streamers "
                f"do. Received: {type(streamer).__name__}"
            )
        new = torch.full(
            (ids.shape[0], max_new_tokens), self.pad_token_id, dtype=ids.dtype, device=ids.device
        )
        if streamer is not None:
            streamer.put(input_ids)
        steps = self._steps(
            ids, lengths, max_new_tokens, choose, stop, policy=compress, chunk=chunk
        )
        for t, token in enumerate(steps):
            new[:, t] = token
            if streamer is not None:
                streamer.put(token)
        if streamer is not None:
            streamer.end()
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
        choose = Sampler.checked(max_new_tokens, do_sample, temperature, top_k, top_p, generator)
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
        choose = Sampler.checked(max_new_tokens, do_sample, temperature, top_k, top_p, generator)
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
        choose: Sampler,
        stop: list[int],
        *,
        policy: Policy | None = None,
        chunk: int | None = None,
    ) -> Iterator[Tensor]:
        """Yield each step's new token of every row (B,), prefill first. A row that has
        produced a stop token gets ``pad_token_id`` from then on; the steps end after
        ``max_new_tokens`` or once every row has stopped."""
        if not max_new_tokens:
            return
        b = ids.shape[0]
        if chunk is None:
            cache = self.new_cache(b, int(lengths.max()) + max_new_tokens, policy=policy)
            hidden = self.extend(ids, lengths, cache)
            last = hidden[torch.arange(b, device=ids.device), lengths - 1]  # [B, E]
        else:  # a growing cache: it never holds more than the first chunk uncompressed
            cache = self.new_cache(b, None, policy=policy)
            last = self._chunked_prompt(ids, lengths, cache, chunk)
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

    def _chunked_prompt(self, ids: Tensor, lengths: Tensor, cache: Any, chunk: int) -> Tensor:
        """The prompts run ``chunk`` columns at a time on ``cache`` (which compresses after
        each); returns each row's last hidden state (B, E)."""
        b = ids.shape[0]
        rows = torch.arange(b, device=ids.device)
        last: Tensor | None = None
        for start in range(0, int(lengths.max()), chunk):
            piece = ids[:, start : start + chunk]
            counts = (lengths - start).clamp(0, piece.shape[1])
            hidden = self.extend(piece, counts, cache)
            ends = lengths - 1 - start  # each row's last token, where it falls in this chunk
            here = (ends >= 0) & (ends < piece.shape[1])
            if last is None:
                last = hidden.new_zeros(b, hidden.shape[-1])
            if bool(here.any()):
                last[here] = hidden[rows[here], ends[here]]
        assert last is not None  # every prompt has a token
        return last

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


def _check_chunk(chunk: object, compress: object) -> None:
    if chunk is None:
        return
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be an int >= 1 (tokens a prompt chunk). Received: {chunk!r}")
    if compress is None:
        raise ValueError(
            "chunk runs the prompt in pieces so that a compressed cache is cut back between "
            "them; without compress the cache holds the whole prompt anyway: pass "
            f"compress=policy, or leave chunk out. Received: chunk={chunk}, compress=None"
        )


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
    from .._machine import available_memory

    return available_memory()


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
