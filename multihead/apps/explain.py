"""``multihead explain``: what every head of a real model looks at, for one text and one word.

The model folder's ``config.json`` picks the model: the library's own families (BERT-family
encoders, the default model; decoders such as GPT-2 and Llama, whose heads are causal: a token
attends only to itself and earlier tokens), or any other architecture transformers can load
from the folder with its ``tokenizer.json`` (a decoder, an encoder, or the encoder of an
encoder-decoder), run on ``attn_implementation="multihead"`` with ``multihead.hf.capture``.

Runs the text through the model with weights on, prints each head's most attended token from the
focus word and the attention rollout, and writes the figures and the HTML head view. The
attention sinks (the first token, special tokens, keys most heads park on:
``multihead.inspect.find_sinks``) are named and set aside, each row renormalized over the other
tokens, before a head is chosen and a token ranked; ``--keep-sinks`` shows the raw weights.
"""

from __future__ import annotations

import contextlib
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from torch import Tensor

from .. import _validation as V
from .._flags import argument, option
from .._progress import stages
from ..inspect import (
    METHODS,
    SINK_SHARE,
    Attribution,
    HeadStats,
    Sinks,
    find_sinks,
    for_text,
    head_stats,
    rollout,
    top_tokens,
    without_sinks,
)
from . import attributing

__all__ = ["ExplainOptions", "Explained", "find_focus", "pick_head", "run", "supported"]

_STAGES = ("loading the model and running the text", "reading the heads", "drawing the figures")


@dataclass(frozen=True, kw_only=True)
class ExplainOptions:
    """What ``multihead explain`` takes (``multihead explain --help``)."""

    text: str = argument("the sentence to explain", metavar="TEXT")
    focus: str | None = option(None, "the word to follow (default: last)", metavar="WORD")
    out: Path = option(
        Path("explain-out"), "folder for the figures (its parent must exist)", metavar="DIR"
    )
    model: str | None = option(
        None,
        "model folder: BERT family, GPT-2 or Llama, or any architecture transformers loads "
        "with its tokenizer.json (the hf extra); or a causal LM "
        "multihead.hf.load_with_tokenizer reads: 'smollm2', 'gemma3' or a .gguf file (the llm "
        "extra) (default: all-MiniLM-L6-v2)",
        metavar="MODEL",
    )
    layer: int | None = option(
        None,
        "draw this layer in head.png and head_surface.png, counted from 0 (default: the layer "
        "of the head most fixed on one other word)",
        metavar="N",
    )
    head: int | None = option(
        None,
        "draw this head of that layer, counted from 0 (default: the head most fixed on one "
        "other word; with --layer alone, that layer's)",
        metavar="N",
    )
    rollout: bool = option(
        False,
        "also draw the attention rollout from the focus token through every layer (from each "
        "layer's mean over heads, multihead.acting.capture's head_mean statistic) as "
        "rollout.png",
    )
    keep_sinks: bool = option(
        False,
        "keep the attention sinks in: choose the head, rank the words and draw the rollout "
        "on the raw weights (by default the weight on the sinks is set aside and each row "
        "renormalized, the raw figures beside)",
    )
    method: str = option(
        "auto",
        "the token attribution printed and written to attribution.json: auto (the most "
        "faithful in multihead bench explain), " + ", ".join(METHODS),
        choices=("auto", *METHODS),
    )
    contrast: str | None = option(
        None,
        "a causal LM: explain the logit of its prediction after --focus minus this token's "
        "(one token of the vocabulary, as ' is')",
        metavar="TOKEN",
    )
    sink_share: float = option(
        SINK_SHARE,
        "a key that takes at least this share of the weight of most rows in most heads of a "
        "layer is a sink (as the first token and special tokens are), and a head with more "
        "than this share of its weight on the sinks a sink head; in (0, 1]",
        metavar="SHARE",
    )


@dataclass
class Explained:
    """What ``run`` computed, for callers and tests."""

    tokens: list[str]
    focus: int
    weights: Tensor | None  # (layers, H, L, L); None for a long text (attributing.LONG)
    stats: HeadStats | None
    rollout: Tensor | None  # (L, L), with the sinks set aside unless --keep-sinks
    head: tuple[int, int] | None  # (layer, head) drawn alone: the one most fixed on one word
    files: dict[str, Path]
    sinks: Sinks | None = None  # None with --keep-sinks
    attribution: Attribution | None = None


def find_focus(
    tokens: list[str], special: list[bool], word: str | None, pieces: list[str] | None
) -> int:
    """Position of the first word piece of ``word``, whose pieces (as the model's tokenizer
    splits it) must appear in a row among ``tokens``; default: the last word."""
    if word is None:
        return max(i for i, s in enumerate(special) if not s)
    n = len(pieces or [])
    for i in range(len(tokens) - n + 1):
        if n and not special[i] and tokens[i : i + n] == pieces:
            return i
    real = [t for t, s in zip(tokens, special) if not s]
    raise ValueError(
        f"the focus word is not among the text's tokens {real}. Received: --focus {word!r}"
    )


def supported() -> str:
    """What ``multihead explain`` takes: every model family's folders."""
    from ..models import all_families, kinds

    return (
        f"language models: {kinds.listed(all_families())}, or multihead.save folders of them, "
        "and any other architecture transformers loads, with its tokenizer (the hf extra)"
    )


def _load(source: str | Path | None) -> Any:
    """The model of ``source`` (None: the default BERT model): the library's own where
    ``kinds.opened_by_multihead`` says so (refused before loading when no model family opens
    it), else transformers' ("smollm2", a .gguf file, a folder of another architecture)."""
    from .. import folder_reading, models, sources
    from ..models import kinds
    from ..models.causal_lm import CausalLM

    if source is not None and sources.is_llm_source(source):
        return _Foreign.from_source(str(source))
    model_path = None if source is None else Path(source)
    if model_path is not None:
        folder_reading.model_folder(model_path)
    if not kinds.opened_by_multihead(model_path):
        return _Foreign.load(Path(source))
    kinds.check_family_kind(model_path, "multihead explain", supported)
    model = models.load(model_path)
    if not isinstance(model, CausalLM):
        kinds.check_encoder(model, model_path, "multihead explain")
    return model


def _attend(text: str, model: Any) -> tuple[list[str], list[bool], Tensor, bool]:
    """Run ``text`` through ``model`` (an encoder, or a causal decoder): (tokens, special
    flags, weights (layers, H, L, L), causal)."""
    import torch

    from ..models.causal_lm import CausalLM

    if isinstance(model, _Foreign):
        return model.attend(text)
    if not isinstance(model, CausalLM):  # an encoder: models.bert.Pretrained
        batch, out = model([text], return_weights=True)
        weights = for_text(out.weights, 0, int(batch.lengths[0]))
        return batch.tokens[0], batch.special[0], weights, False
    if model.tokenizer is None:
        raise FileNotFoundError(
            f"explain needs the model's tokenizer.json, which is missing from {model.path}. "
            "Received: a folder without tokenizer.json"
        )
    encoding = model.tokenizer.encode(text)
    with torch.inference_mode():
        out = model.run(torch.tensor([encoding.ids]))
    weights = torch.stack([w[0] for w in out.weights])
    special = [bool(s) for s in encoding.special_tokens_mask]
    return list(encoding.tokens), special, weights, True


@dataclass(frozen=True)
class _Foreign:
    """A model of an architecture the library has no family for, loaded by transformers on
    the multihead attention implementation, with its folder and tokenizer (what the report
    reads of a model)."""

    path: Path
    tokenizer: Any
    model: Any

    @classmethod
    def load(cls, folder: Path) -> _Foreign:
        from .._extras import require

        require("transformers", "hf", "multihead explain on this architecture")
        from ..hf.loading import open_folder

        model, tokenizer = open_folder(
            folder, "multihead explain", causal_lm=False, supports=f", which supports {supported()}"
        )
        return cls(folder, tokenizer, model)

    @classmethod
    def from_source(cls, source: str) -> _Foreign:
        """A causal LM ``multihead.hf.load_with_tokenizer`` reads ("smollm2", a .gguf file),
        with the ``tokenizers.Tokenizer`` behind its transformers tokenizer."""
        from .._extras import require

        require("transformers", "hf", "multihead explain --model " + source)
        from ..hf import loading

        model, tokenizer = loading.load_with_tokenizer(source)
        return cls(Path(source), tokenizer.backend_tokenizer, model)

    def attend(self, text: str) -> tuple[list[str], list[bool], Tensor, bool]:
        """Run ``text``, capturing every head of every self-attention layer (an
        encoder-decoder's encoder). The heads are causal when no weight lies above the
        diagonal (multihead gives hidden keys exactly 0)."""
        import torch

        from ..hf import capture

        encoding = self.tokenizer.encode(text)
        ids = torch.tensor([encoding.ids])
        config = self.model.config
        encoder = self.model.get_encoder() if config.is_encoder_decoder else self.model
        with capture(self.model) as cap, torch.inference_mode():
            encoder(input_ids=ids, attention_mask=torch.ones_like(ids))
        weights = torch.stack([cap.weights[i][0] for i in range(cap.num_layers)]).float()
        causal = bool((weights.triu(1) == 0).all()) and ids.shape[1] > 1
        special = [bool(s) for s in encoding.special_tokens_mask]
        return list(encoding.tokens), special, weights, causal


def _decodes(tokenizer: Any) -> bool:
    """Whether tokens are shown through the tokenizer's decoder: byte-level and sentencepiece
    pieces ("Ġgood", "▁good") read better decoded; WordPiece's ("##ing") are shown as they
    are."""
    decoder = getattr(tokenizer, "decoder", None)
    return decoder is not None and type(decoder).__name__ != "WordPiece"


def _focus(
    tokenizer: Any, tokens: list[str], special: list[bool], word: str | None
) -> tuple[int, int]:
    """``find_focus`` with the word split by the model's tokenizer: (position of its first
    piece, number of pieces). Byte-level and sentencepiece tokenizers (GPT-2, Llama, RoBERTa)
    mark a word inside a sentence by its leading space, so that form is tried first for
    them."""
    if word is None:
        return find_focus(tokens, special, None, None), 1

    def pieces(form: str) -> list[str]:
        return tokenizer.encode(form, add_special_tokens=False).tokens

    if _decodes(tokenizer):
        with contextlib.suppress(ValueError):
            split = pieces(" " + word)
            return find_focus(tokens, special, word, split), len(split)
    split = pieces(word)
    return find_focus(tokens, special, word, split), len(split)


def _labels(tokenizer: Any, tokens: list[str]) -> list[str]:
    """What to print and draw for each token. A byte-level BPE (GPT-2, Llama) spells a leading
    space and every non-ASCII byte in stand-in characters ("Ġgood"); its decoder gives the text
    back (" good"), shown without the space ("␣" for a token of spaces alone). A piece that is
    only part of a character keeps its raw form. WordPiece tokens ("##ing") are shown as they
    are."""
    if not _decodes(tokenizer):
        return tokens
    decoder = tokenizer.decoder
    labels = []
    for token in tokens:
        text = decoder.decode([token])
        if "\ufffd" in text:
            labels.append(token)
        else:
            labels.append(text.strip() or "␣")  # a token of spaces alone: a visible space
    return labels


def _check_index(name: str, value: int | None, count: int, what: str) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < count:
        raise ValueError(
            f"{name} must be between 0 and {count - 1}: the model has {count} {what}, counted "
            f"from 0. Received: {name} {value!r}"
        )


def pick_head(
    weights: Tensor,
    position: int,
    keys: list[int],
    *,
    layer: int | None = None,
    head: int | None = None,
) -> tuple[int, int]:
    """The (layer, head) to draw alone: among the heads ``layer`` and ``head`` allow (None: any),
    the one whose strongest weight from query ``position`` onto one of ``keys`` is largest.

    Raises:
        ValueError: ``layer`` or ``head`` outside the model (the message names the range).
    """
    layers, heads = weights.shape[:2]
    _check_index("--layer", layer, layers, "layers")
    _check_index("--head", head, heads, "heads in every layer")
    rows = list(range(layers)) if layer is None else [layer]
    cols = list(range(heads)) if head is None else [head]
    strongest = weights[rows][:, cols][:, :, position][:, :, keys].amax(-1)  # (rows, cols)
    r, c = divmod(int(strongest.flatten().argmax()), len(cols))
    return rows[r], cols[c]


def _grid(
    top: list, tokens: list[str], focus: int, say: Callable[[str], None], aside: str = ""
) -> None:
    layers, heads = len(top), len(top[0])
    width = min(attributing.WIDTH - 5, max(12, max(len(t) for t in tokens) + 6))
    cells = [[f"{top[layer][h][0].token} {100 * top[layer][h][0].weight:.0f}%"
              for h in range(heads)] for layer in range(layers)]  # fmt: skip
    attributing.fitted_grid(cells, say, f"Most attended token from '{tokens[focus]}' for every "
                            f"head (rows) and layer (columns){aside}:", width)  # fmt: skip


def _check_options(options: ExplainOptions) -> None:
    """The checks that need no model, made before it loads."""
    text, focus = options.text, options.focus
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"the text to explain is empty; give a sentence. Received: {text!r}")
    V.check_utf8_text("TEXT", text)
    if focus is not None:
        V.check_utf8_text("--focus", focus)
    for name, value in (("--layer", options.layer), ("--head", options.head)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 0
        ):
            raise ValueError(f"{name} must be a whole number >= 0. Received: {name} {value!r}")
    share = options.sink_share
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
        raise ValueError(
            "--sink-share must be in (0, 1]: the share of a row's weight that makes a key a "
            f"sink. Received: --sink-share {share!r}"
        )
    if options.keep_sinks and share != SINK_SHARE:
        raise ValueError(
            "--sink-share has no use with --keep-sinks, which finds no sinks; give one of "
            f"them. Received: --keep-sinks --sink-share {share!r}"
        )


def run(options: ExplainOptions, *, say: Callable[[str], None] = print) -> Explained:
    """Explain ``options.text``; see the module docstring. Returns what was computed and
    written.

    ``options.layer`` and ``options.head`` (counted from 0) choose the head drawn alone in
    head.png and head_surface.png; by default it is the head most fixed on one other word (the
    strongest weight from the focus word onto a word at least two positions away, once the
    weight on the sinks is set aside), searched within ``layer`` or ``head`` when only one is
    given. ``options.keep_sinks`` keeps the raw weights throughout.
    """
    _check_options(options)
    folder = V.check_out_dir("--out", options.out)
    earlier = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    if earlier:  # said before any work: the files of the same name are written over
        say(f"--out {folder} exists, holding {', '.join(earlier[:6])}"
            f"{' ...' if len(earlier) > 6 else ''}: this run writes its figures and "
            "attention.html over those of the same name")  # fmt: skip
    with stages("explain", _STAGES, say=say) as (progress, say):
        progress.begin(_STAGES[0])
        model = _load(options.model)
        if model.tokenizer is not None:  # without one, _attend says what is missing
            encoding = model.tokenizer.encode(options.text)
            _check_length(model, len(encoding.ids))
            if len(encoding.ids) >= attributing.LONG:
                return _long(options, model, encoding, folder, progress, say)
        tokens, special, weights, causal = _attend(options.text, model)
        progress.begin(_STAGES[1])
        sinks = None if options.keep_sinks else find_sinks(weights, special,
                                                           share=options.sink_share)  # fmt: skip
        explained = _report(options, model, _Run(tokens, special, weights, causal, sinks),
                            folder, progress, say)  # fmt: skip
        if options.rollout:
            _draw_rollout(options.text, model, explained, folder, say)
        return explained


def _max_positions(model: Any) -> int | None:
    """The longest input the model takes (None: no limit it says)."""
    if isinstance(model, _Foreign):
        config = model.model.config
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        return getattr(text, "max_position_embeddings", None)
    return getattr(model, "max_positions", None) or getattr(model, "max_length", None)


def _check_length(model: Any, count: int) -> None:
    """One line before anything runs: a text longer than the model's positions."""
    limit = _max_positions(model)
    if limit is not None and count > limit:
        raise ValueError(
            f"the text is {count} tokens but the model has {limit} positions; shorten it. "
            f"Received: {count} tokens"
        )


def _causal(model: Any) -> bool:
    from ..models.causal_lm import CausalLM

    if isinstance(model, _Foreign):
        return type(model.model).__name__.endswith("ForCausalLM")
    return isinstance(model, CausalLM)


def _long(options: ExplainOptions, model: Any, encoding: Any, folder: Path, progress: Any,
          say: Callable[[str], None]) -> Explained:  # fmt: skip
    """A text of ``attributing.LONG`` tokens or more: the attribution and the focus row of
    every head, in memory that grows as one layer's weights; no full-weight figure."""
    tokens, ids = list(encoding.tokens), list(encoding.ids)
    special = [bool(s) for s in encoding.special_tokens_mask]
    position, count = _focus(model.tokenizer, tokens, special, options.focus)
    labels = _labels(model.tokenizer, tokens)
    causal = _causal(model)
    progress.begin(_STAGES[1])
    found = attributing.attribution(model, ids, position, options.method,
                                    options.contrast)  # fmt: skip
    say(f"model: {model.path} ({'causal LM, ' if causal else ''}{len(ids)} tokens)")
    say(f"focus: '{labels[position]}' (position {position})"
        f"{_split(labels, position, count, options.focus)}")  # fmt: skip
    attributing.say_attribution(found, labels, model.tokenizer, say)
    progress.begin(_STAGES[2])
    files = attributing.report(_runner(options.text, model), ids, labels, position, found,
                               folder, say)  # fmt: skip
    return Explained(labels, position, None, None, None, None, files, None, found)


def _draw_rollout(
    text: str, model: Any, explained: Explained, folder: Path, say: Callable[[str], None]
) -> None:
    """rollout.png from each layer's head mean: without the sinks and raw side by side, or the
    raw one alone with --keep-sinks."""
    means = _head_means(text, model)
    raw = rollout(means[:, None])
    sinks = explained.sinks
    flow = raw if sinks is None else rollout(means[:, None], sinks=sinks.positions)
    path = _rollout_figure(flow, explained.tokens, explained.focus, folder,
                           raw=None if sinks is None else raw)  # fmt: skip
    explained.files["rollout"] = path
    focus_token = explained.tokens[explained.focus]
    both = "" if sinks is None else ", without the sinks and raw"
    say(f"  {path}  (rollout from '{focus_token}' through {means.shape[0]} layers{both})")


def _runner(text: str, model: Any) -> tuple[Any, Callable[[], object]]:
    """(the module a capture opens on, a call that runs ``text`` through it once), for a
    transformers model and for the library's own alike."""
    import torch

    from ..models.causal_lm import CausalLM

    if isinstance(model, _Foreign):
        ids = torch.tensor([model.tokenizer.encode(text).ids])
        config = model.model.config
        encoder = model.model.get_encoder() if config.is_encoder_decoder else model.model
        return model.model, partial(encoder, input_ids=ids, attention_mask=torch.ones_like(ids))
    if isinstance(model, CausalLM):
        return model, partial(model, torch.tensor([model.tokenizer.encode(text).ids]))
    return model, partial(model, [text])  # an encoder: models.bert.Pretrained, no padding


def _head_means(text: str, model: Any) -> Tensor:
    """(layers, L, L): each layer's mean over heads, from the kernel's head_mean statistic
    (``multihead.acting.capture``; no layer's heads are held), for a transformers model and
    for the library's own alike."""
    import torch

    from ..acting import capture

    captured, run = _runner(text, model)
    with capture(captured, stats=["head_mean"]) as cap, torch.inference_mode():
        run()
    return torch.stack([cap.stats[i]["head_mean"][0] for i in range(cap.num_layers)]).float()


def _rollout_figure(
    flow: Tensor, tokens: list[str], focus: int, folder: Path, *, raw: Tensor | None = None
) -> Path:
    """Bars: how much each input token flows into the focus position at the last layer; with
    ``raw``, ``flow`` is the rollout without the sinks, drawn above the raw one."""
    from .common import figure, save_figure

    n = len(tokens)
    colours = ["tab:orange" if i == focus else "tab:blue" for i in range(n)]
    title = f"attention rollout into '{tokens[focus]}' (Abnar & Zuidema 2020)"
    panels = [(flow, title)]
    if raw is not None:
        panels = [(flow, f"{title}, without the sinks"), (raw, "the same with the sinks (raw)")]
    fig = figure(figsize=(max(4.0, 0.45 * n), 3.0 * len(panels)))
    for ax, (values, heading) in zip(fig.subplots(len(panels), 1, squeeze=False)[:, 0], panels):
        ax.bar(range(n), values[focus].tolist(), color=colours)
        ax.set_xticks(range(n), tokens, rotation=60, ha="right", fontsize=8)
        ax.set_ylabel("share of the focus position")
        ax.set_title(heading, fontsize=9)
    return save_figure(fig, folder / "rollout.png")


@dataclass(frozen=True)
class _Run:
    """What the model gave for the text, and the sinks found in it (None: --keep-sinks)."""

    tokens: list[str]
    special: list[bool]
    weights: Tensor  # (layers, H, L, L)
    causal: bool
    sinks: Sinks | None


def _say_sinks(sinks: Sinks, tokens: list[str], say: Callable[[str], None]) -> None:
    """Which positions are sinks and why, and which heads are sink heads, layer by layer."""
    named = (f"'{tokens[p]}' (position {p}: {why})" for p, why in zip(sinks.positions,
             sinks.reasons))  # fmt: skip
    say(f"sinks: {', '.join(named)}")
    layers, heads = sinks.heads.shape
    say(f"sink heads, more than {100 * sinks.share:.0f}% of their weight on the sinks: "
        f"{int(sinks.heads.sum())} of {layers * heads}")  # fmt: skip
    # one layer's heads are never split over two lines: no-break spaces inside an entry
    listed = "; ".join(
        "\xa0".join(
            ["layer", f"{layer}:", *map(str, sinks.heads[layer].nonzero().flatten().tolist())]
        )
        for layer in range(layers)
        if sinks.heads[layer].any()
    )
    for line in textwrap.wrap(listed, 96):
        say(f"  {line}".replace("\xa0", " "))
    say("Below, the weight on the sinks is set aside and each row renormalized over the other "
        "tokens (--keep-sinks: the raw weights).\n")  # fmt: skip


def _say_findings(
    weights: Tensor,
    tokens: list[str],
    position: int,
    real: list[int],
    flows: tuple[Tensor, Tensor | None],
    say: Callable[[str], None],
    aside: str = "",
) -> None:
    """The printed part after the focus: every head's top token, the strongest head per word
    and the rollout, from ``weights`` (the sinks set aside unless ``aside`` is empty), and the
    raw rollout when ``flows`` holds one."""
    heads = weights.shape[1]
    _grid(top_tokens(weights, tokens, position, k=1), tokens, position, say, aside)
    # for every key: the strongest weight any head puts on it from the focus, and that head
    best, where = weights[:, :, position].flatten(0, 1).max(0)
    say(f"\nStrongest head for each word '{tokens[position]}' attends to (top 5{aside}):")
    for i in sorted(real, key=lambda i: -float(best[i]))[:5]:
        lay, hd = divmod(int(where[i]), heads)
        say(f"  {tokens[i]:>12}  {100 * float(best[i]):3.0f}%  layer {lay} head {hd}")
    for flow, name in zip(
        flows, (f"'{tokens[position]}'{aside}", f"'{tokens[position]}' with the sinks (raw)")
    ):
        if flow is None:
            continue
        ranked = flow[position].argsort(descending=True)[:5].tolist()
        say(
            f"Rollout (Abnar & Zuidema 2020) for {name}: "
            + ", ".join(f"{tokens[i]} {100 * float(flow[position, i]):.0f}%" for i in ranked)
        )


def _targets(
    tokens: list[str], special: list[bool], position: int, sinks: Sinks | None
) -> tuple[list[int], list[int]]:
    """The words the focus may look to (neither special nor a sink nor the focus itself), and
    those of them the head drawn alone is chosen by: at least two positions away (neighbour
    links come from positional heads, not meaning), or any when none is."""
    aside = () if sinks is None else sinks.positions
    real = [i for i in range(len(tokens)) if not special[i] and i != position and i not in aside]
    far = [i for i in real if abs(i - position) > 1] or real or list(range(len(tokens)))
    return real, far


def _views(weights: Tensor, sinks: Sinks | None) -> tuple[Tensor, Tensor, Tensor | None]:
    """(the weights shown, the rollout shown, the raw rollout beside it): with the sinks set
    aside, or the raw weights and rollout alone (--keep-sinks)."""
    if sinks is None:
        return weights, rollout(weights), None
    aside = sinks.positions
    return without_sinks(weights, aside), rollout(weights, sinks=aside), rollout(weights)


def _split(tokens: list[str], position: int, count: int, focus: str | None) -> str:
    """How the focus word was split, when the tokenizer split it (the heads follow one token:
    say which piece of the word that is)."""
    if count <= 1:
        return ""
    pieces = " ".join(f"'{t}'" for t in tokens[position : position + count])
    return f", the first of the {count} pieces {pieces} that --focus {focus} is split into"


def _report(options: ExplainOptions, model: Any, run: _Run, folder: Path, progress: Any,
            say: Callable[[str], None]) -> Explained:  # fmt: skip
    """Everything ``run`` prints and draws once the model has run the text."""
    layer, head, sinks = options.layer, options.head, run.sinks
    position, count = _focus(model.tokenizer, run.tokens, run.special, options.focus)
    tokens = _labels(model.tokenizer, run.tokens)
    weights = run.weights
    shown, flow, raw_flow = _views(weights, sinks)
    stats = head_stats(weights, run.special)
    layers, heads = weights.shape[:2]
    real, far = _targets(tokens, run.special, position, sinks)
    chosen = "chosen by --layer/--head" if (layer, head) != (None, None) else ""
    layer, head = pick_head(shown, position, far, layer=layer, head=head)
    chosen = chosen or f"the head most fixed on one other word from '{tokens[position]}'"

    kind = ", causal: each token sees only earlier ones" if run.causal else ""
    say(f"model: {model.path} ({layers} layers x {heads} heads{kind})")
    say(f"tokens: {' '.join(tokens)}")
    split = _split(tokens, position, count, options.focus)
    say(f"focus: '{tokens[position]}' (position {position}){split}" + ("\n" * (sinks is None)))
    if sinks is not None:
        _say_sinks(sinks, tokens, say)
    _say_findings(shown, tokens, position, real, (flow, raw_flow), say,
                  "" if sinks is None else ", sinks set aside")  # fmt: skip

    ids = list(model.tokenizer.encode(options.text).ids)
    found = attributing.attribution(model, ids, position, options.method, options.contrast)
    attributing.say_attribution(found, tokens, model.tokenizer, say)
    progress.begin(_STAGES[2])
    files = _write_figures(options.text, run, tokens, shown, (layer, head, chosen), position,
                           stats, folder, say)  # fmt: skip
    files["attribution"] = attributing.write_attribution(found, folder)
    files["attribution_figure"] = attributing.attribution_figure(found, tokens, folder)
    say(f"  {files['attribution']}  (the attribution: method, target, tokens, scores)")
    say(f"  {files['attribution_figure']}  (the attribution as bars)")
    return Explained(tokens, position, weights, stats, flow, (layer, head), files, sinks, found)


def _write_figures(text: str, run: _Run, tokens: list[str], shown: Tensor,
                   drawn: tuple[int, int, str], position: int, stats: HeadStats, folder: Path,
                   say: Callable[[str], None]) -> dict[str, Path]:  # fmt: skip
    """heads_grid.png (raw), head.png (raw) and, with the sinks set aside, head_without_sinks.png
    beside it, head_surface.png (as ``shown``) and attention.html; the list of them printed."""
    from ..viz import head_heatmap, heatmap_grid, surface
    from ..viz.html import save_head_view

    layer, head, chosen = drawn
    weights, sinks = run.weights, run.sinks
    layers, heads = weights.shape[:2]
    folder.mkdir(exist_ok=True)
    name = f"layer {layer} head {head}"
    raw, clean = weights[layer, head], shown[layer, head]
    figures: list[tuple[str, str, Callable[[], Any], str]] = [
        ("grid", "heads_grid.png", lambda: heatmap_grid(weights, tokens),
         f"every head: {layers} layers (rows) x {heads} heads (columns)"),
    ]  # fmt: skip
    if sinks is None:
        figures += [
            ("head", "head.png", lambda: head_heatmap(raw, tokens,
             title=f"{name}: attention weights"), f"{name} ({chosen})"),
            ("surface", "head_surface.png", lambda: surface(raw, tokens, title=name),
             f"{name}, as a 3-D surface"),
        ]  # fmt: skip
    else:
        set_aside = ", ".join(f"'{tokens[p]}'" for p in sinks.positions)
        figures += [
            ("head", "head.png", lambda: head_heatmap(raw, tokens, title=f"{name}: raw "
             "attention weights, sinks included"), f"{name} ({chosen}): the raw weights"),
            ("clean", "head_without_sinks.png", lambda: head_heatmap(clean, tokens, title=f"{name}"
             f" without the sinks {set_aside}, each row renormalized"),
             f"{name} without the sinks, each row renormalized"),
            ("surface", "head_surface.png", lambda: surface(clean, tokens, title=f"{name} "
             "without the sinks"), f"{name} without the sinks, as a 3-D surface"),
        ]  # fmt: skip
    files = {key: folder / file for key, file, _, _ in figures}
    for key, _, draw, _ in figures:
        draw().savefig(files[key], dpi=110)
    files["html"] = save_head_view(
        folder / "attention.html",
        weights,
        tokens,
        special=run.special,
        stats=stats,
        focus=position,
        title=f"{'causal attention' if run.causal else 'attention'}: {text}",
        sinks=sinks,
        hide_sinks=sinks is not None,
    )
    shows = {key: show for key, _, _, show in figures}
    shows["html"] = "every layer and head, clickable" + (
        "" if sinks is None else "; 'hide the sinks' sets them aside"
    )
    say("\nwrote:")
    for key, path in files.items():
        say(f"  {path}  ({shows[key]})")
    say(f"open {files['html']} in a browser (works offline) to click through every head.")
    return files
