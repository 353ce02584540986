"""``multihead explain``: what every head of a real model looks at, for one text and one word.

The model folder's ``config.json`` picks the model: the library's own families (BERT-family
encoders, the default model; decoders such as GPT-2 and Llama, whose heads are causal: a token
attends only to itself and earlier tokens), or any other architecture transformers can load
from the folder with its ``tokenizer.json`` (a decoder, an encoder, or the encoder of an
encoder-decoder), run on ``attn_implementation="multihead"`` with ``multihead.hf.capture``.

Runs the text through the model with weights on, prints each head's most attended token from the
focus word and the attention rollout, and writes the figures and the HTML head view.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor

from .. import _validation as V
from .._flags import argument, option
from .._progress import stages
from ..inspect import HeadStats, for_text, head_stats, rollout, top_tokens

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
    model: Path | None = option(
        None,
        "model folder: BERT family, GPT-2 or Llama, or any architecture transformers loads "
        "with its tokenizer.json (the hf extra) (default: all-MiniLM-L6-v2)",
        metavar="PATH",
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
        "layer's mean over heads, multihead.hf.capture's head_mean on a transformers folder) "
        "as rollout.png",
    )


@dataclass
class Explained:
    """What ``run`` computed, for callers and tests."""

    tokens: list[str]
    focus: int
    weights: Tensor  # (layers, H, L, L)
    stats: HeadStats
    rollout: Tensor  # (L, L)
    head: tuple[int, int]  # (layer, head) drawn alone: the one most fixed on one other word
    files: dict[str, Path]


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


def _load(model_path: Path | None) -> Any:
    """The model in ``model_path`` (None: the default BERT model), refused before loading
    when no model family opens the folder."""
    from .. import hf_folders, models
    from ..models import kinds
    from ..models.causal_lm import CausalLM

    if model_path is not None:
        hf_folders.model_folder(model_path)
    found = kinds.folder_kind(model_path)
    foreign = found is not None and found.kind not in (None, kinds.SAVED)
    if foreign and models.family(found.kind) is None:  # no family of ours: transformers
        return _Foreign.load(found.folder)
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
        from ..hf.folders import load_folder

        model, tokenizer = load_folder(
            folder, "multihead explain", supports=f", which supports {supported()}"
        )
        return cls(folder, tokenizer, model)

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


def _grid(top: list, tokens: list[str], focus: int, say: Callable[[str], None]) -> None:
    layers, heads = len(top), len(top[0])
    width = max(12, max(len(t) for t in tokens) + 6)
    say(f"Most attended token from '{tokens[focus]}' for every head (rows) and layer (columns):")
    say("head " + "".join(f"{'layer ' + str(layer):>{width}}" for layer in range(layers)))
    for h in range(heads):
        cells = [f"{top[layer][h][0].token} {100 * top[layer][h][0].weight:.0f}%" for layer in
                 range(layers)]  # fmt: skip
        say(f"{h:>4} " + "".join(f"{c:>{width}}" for c in cells))


def run(options: ExplainOptions, *, say: Callable[[str], None] = print) -> Explained:
    """Explain ``options.text``; see the module docstring. Returns what was computed and
    written.

    ``options.layer`` and ``options.head`` (counted from 0) choose the head drawn alone in
    head.png and head_surface.png; by default it is the head most fixed on one other word (the
    strongest weight from the focus word onto a word at least two positions away), searched
    within ``layer`` or ``head`` when only one is given.
    """
    text, focus, layer, head = options.text, options.focus, options.layer, options.head
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"the text to explain is empty; give a sentence. Received: {text!r}")
    V.check_utf8_text("TEXT", text)
    if focus is not None:
        V.check_utf8_text("--focus", focus)
    folder = V.check_out_dir("--out", options.out)
    earlier = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    if earlier:  # said before any work: the files of the same name are written over
        say(f"--out {folder} exists, holding {', '.join(earlier[:6])}"
            f"{' ...' if len(earlier) > 6 else ''}: this run writes its figures and "
            "attention.html over those of the same name")  # fmt: skip
    for name, value in (("--layer", layer), ("--head", head)):  # before the model loads
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 0
        ):
            raise ValueError(f"{name} must be a whole number >= 0. Received: {name} {value!r}")
    with stages("explain", _STAGES, say=say) as (progress, say):
        progress.begin(_STAGES[0])
        model = _load(options.model)
        tokens, special, weights, causal = _attend(text, model)
        progress.begin(_STAGES[1])
        explained = _report(text, model, tokens, special, weights, causal, focus, layer, head,
                            folder, progress, say)  # fmt: skip
        if options.rollout:
            means = _head_means(text, model, weights)
            explained.files["rollout"] = _rollout_figure(
                rollout(means[:, None]), explained.tokens, explained.focus, folder
            )
            focus_token = explained.tokens[explained.focus]
            say(f"  {explained.files['rollout']}  (rollout from '{focus_token}' through "
                f"{means.shape[0]} layers)")  # fmt: skip
        return explained


def _head_means(text: str, model: Any, weights: Tensor) -> Tensor:
    """(layers, L, L): each layer's mean over heads; a transformers model's from the kernel's
    head_mean statistic (no layer's heads are held), the library's own from its weights."""
    if not isinstance(model, _Foreign):
        return weights.mean(1)
    import torch

    from ..hf import capture

    ids = torch.tensor([model.tokenizer.encode(text).ids])
    encoder = model.model.get_encoder() if model.model.config.is_encoder_decoder else model.model
    with capture(model.model, stats=["head_mean"]) as cap, torch.inference_mode():
        encoder(input_ids=ids, attention_mask=torch.ones_like(ids))
    return torch.stack([cap.stats[i]["head_mean"][0] for i in range(cap.num_layers)]).float()


def _rollout_figure(flow: Tensor, tokens: list[str], focus: int, folder: Path) -> Path:
    """Bars: how much each input token flows into the focus position at the last layer."""
    from .common import figure, save_figure

    row = flow[focus].tolist()
    fig = figure(figsize=(max(4.0, 0.45 * len(tokens)), 3.0))
    ax = fig.subplots()
    ax.bar(range(len(tokens)), row, color=["tab:orange" if i == focus else "tab:blue"
                                            for i in range(len(tokens))])  # fmt: skip
    ax.set_xticks(range(len(tokens)), tokens, rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("share of the focus position")
    ax.set_title(f"attention rollout into '{tokens[focus]}' (Abnar & Zuidema 2020)", fontsize=9)
    return save_figure(fig, folder / "rollout.png")


def _say_findings(
    weights: Tensor,
    tokens: list[str],
    position: int,
    real: list[int],
    flow: Tensor,
    say: Callable[[str], None],
    split: str = "",
) -> None:
    """The printed part: tokens, focus (``split``: how the focus word was split), every head's
    top token, the strongest head per word and the rollout."""
    heads = weights.shape[1]
    say(f"tokens: {' '.join(tokens)}")
    say(f"focus: '{tokens[position]}' (position {position}){split}\n")
    _grid(top_tokens(weights, tokens, position, k=1), tokens, position, say)
    # for every key: the strongest weight any head puts on it from the focus, and that head
    best, where = weights[:, :, position].flatten(0, 1).max(0)
    say(f"\nStrongest head for each word '{tokens[position]}' attends to (top 5):")
    for i in sorted(real, key=lambda i: -float(best[i]))[:5]:
        lay, hd = divmod(int(where[i]), heads)
        say(f"  {tokens[i]:>12}  {100 * float(best[i]):3.0f}%  layer {lay} head {hd}")
    ranked = flow[position].argsort(descending=True)[:5].tolist()
    say(
        f"Rollout (Abnar & Zuidema 2020) for '{tokens[position]}': "
        + ", ".join(f"{tokens[i]} {100 * float(flow[position, i]):.0f}%" for i in ranked)
    )


def _report(text, model, tokens, special, weights, causal, focus, layer, head, folder,
            progress, say) -> Explained:  # fmt: skip
    """Everything ``run`` prints and draws once the model has run the text."""
    from ..viz import head_heatmap, heatmap_grid, surface
    from ..viz.html import save_head_view

    position, count = _focus(model.tokenizer, tokens, special, focus)
    tokens = _labels(model.tokenizer, tokens)
    split = ""
    if count > 1:  # the heads follow one token: say which piece of the word that is
        pieces = " ".join(f"'{t}'" for t in tokens[position : position + count])
        split = f", the first of the {count} pieces {pieces} that --focus {focus} is split into"
    stats = head_stats(weights, special)
    flow = rollout(weights)
    layers, heads = weights.shape[:2]
    real = [i for i in range(len(tokens)) if not special[i] and i != position]
    # the head drawn alone: strongest link to a real token at least two positions away
    # (neighbour links come from positional heads, not meaning)
    far = [i for i in real if abs(i - position) > 1] or real
    chosen = "chosen by --layer/--head" if (layer, head) != (None, None) else ""
    layer, head = pick_head(weights, position, far, layer=layer, head=head)
    chosen = chosen or f"the head most fixed on one other word from '{tokens[position]}'"

    kind = ", causal: each token sees only earlier ones" if causal else ""
    say(f"model: {model.path} ({layers} layers x {heads} heads{kind})")
    _say_findings(weights, tokens, position, real, flow, say, split)

    progress.begin(_STAGES[2])
    folder.mkdir(exist_ok=True)
    title = f"layer {layer} head {head}: attention weights"
    files = {
        "grid": folder / "heads_grid.png",
        "head": folder / "head.png",
        "surface": folder / "head_surface.png",
        "html": folder / "attention.html",
    }
    for name, fig in (
        ("grid", heatmap_grid(weights, tokens)),
        ("head", head_heatmap(weights[layer, head], tokens, title=title)),
        ("surface", surface(weights[layer, head], tokens, title=f"layer {layer} head {head}")),
    ):
        fig.savefig(files[name], dpi=110)
    save_head_view(
        files["html"],
        weights,
        tokens,
        special=special,
        stats=stats,
        focus=position,
        title=f"{'causal attention' if causal else 'attention'}: {text}",
    )
    shows = {
        "grid": f"every head: {layers} layers (rows) x {heads} heads (columns)",
        "head": f"layer {layer} head {head} ({chosen})",
        "surface": f"layer {layer} head {head}, as a 3-D surface",
        "html": "every layer and head, clickable",
    }
    say("\nwrote:")
    for name, path in files.items():
        say(f"  {path}  ({shows[name]})")
    say(f"open {files['html']} in a browser (works offline) to click through every head.")
    return Explained(tokens, position, weights, stats, flow, (layer, head), files)
