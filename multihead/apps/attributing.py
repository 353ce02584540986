"""The token attribution of ``multihead explain``: ``multihead.inspect.attribute`` for the
focus word, printed with its method and the share on the sinks, written as attribution.json
and drawn as attribution.png; and the long-input report, where the heads' full weights, the
heatmaps and the head view are not made (``LONG`` tokens and more).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .. import acting
from ..inspect import Attribution, NextToken, Representation, attribute

__all__ = ["CITATIONS", "LONG", "WIDTH", "attribution", "fitted_grid", "focus_rows", "report"]

LONG = 256  # tokens from which explain draws no full-weight figure and no head view
WIDTH = 100  # terminal columns every table fits in

CITATIONS = {
    "attention": "last layer's weights, mean over heads",
    "rollout": "Abnar & Zuidema 2020",
    "norm": "Kobayashi et al. 2020",
    "alti": "ALTI, Ferrando et al. 2022",
    "alti_logit": "ALTI-Logit, Ferrando et al. 2023",
    "grad_input": "gradient x input",
    "integrated_gradients": "Sundararajan et al. 2017",
    "occlusion": "occlusion by [MASK] or the pad token",
}


def _model_and_tokenizer(model: Any) -> tuple[Any, Any]:
    """What ``attribute`` takes for explain's model: a transformers model with its tokenizer,
    or the library's own model (which holds its tokenizer)."""
    inner = getattr(model, "model", None)
    if type(model).__name__ == "_Foreign":
        if getattr(inner.config, "is_encoder_decoder", False):  # explain reads its encoder
            inner = inner.get_encoder()
        return inner, model.tokenizer
    return model, None


def attribution(model: Any, ids: list[int], focus: int, method: str,
                contrast: str | None) -> Attribution:  # fmt: skip
    """The attribution explain prints: an encoder's focus token, or a causal LM's prediction
    after the focus token (against ``contrast``)."""
    from ..inspect.subjects import CAUSAL, open_subject

    inner, tokenizer = _model_and_tokenizer(model)
    # a decoder without its output layer (a transformers base model) has no next token to
    # explain: its focus token's last hidden state is the target, as an encoder's
    predicts = open_subject(inner, tokenizer).kind == CAUSAL
    if contrast is not None and not predicts:
        raise ValueError(
            "--contrast explains a causal LM's prediction against another token; this model "
            f"has no output layer to predict with. Received: --contrast {contrast!r}"
        )
    target = NextToken(focus) if predicts else Representation(focus)
    return attribute(inner, ids, target=target, method=method, contrast=contrast,
                     tokenizer=tokenizer)  # fmt: skip


def _spell(tokenizer: Any, token: int) -> str:
    return repr(tokenizer.decode([token]))


def say_attribution(found: Attribution, labels: list[str], tokenizer: Any,
                    say: Callable[[str], None]) -> None:  # fmt: skip
    """Two lines: what is explained (and predicted), then the method and its top tokens."""
    name = found.method
    citation = CITATIONS["alti_logit" if name == "alti" and found.prediction is not None
                         else name]  # fmt: skip
    position = found.position if found.position is not None else 0
    if found.prediction is not None:
        against = (
            "" if found.contrast is None else f" (against {_spell(tokenizer, found.contrast)})"
        )
        say(f"\n'{labels[position]}' predicts {_spell(tokenizer, found.prediction)}{against}; "
            f"what the prediction depends on, by {name} ({citation}):")  # fmt: skip
    else:
        say(f"\nWhat the last hidden state of '{labels[position]}' depends on, by {name} "
            f"({citation}):")  # fmt: skip
    top = ", ".join(f"{labels[i]} {100 * share:.0f}%" for i, share in found.top(5))
    say(f"  {top}")
    sinks = ", ".join(f"'{labels[i]}'" for i in found.sinks[:4])
    say(f"  on the sinks ({sinks}{' ...' if len(found.sinks) > 4 else ''}): "
        f"{100 * found.sink_share:.1f}% of the attribution, with no sink rule")  # fmt: skip


def write_attribution(found: Attribution, folder: Path) -> Path:
    """attribution.json: ``{"method", "target", "contrast", "tokens", "scores", "sink_share"}``
    and the ids, the tokens as the tokenizer splits the input, one score each in input order."""
    folder.mkdir(exist_ok=True)
    path = folder / "attribution.json"
    path.write_text(json.dumps(found.as_dict(), indent=1))
    return path


def attribution_figure(found: Attribution, labels: list[str], folder: Path,
                       top: int = 30) -> Path:  # fmt: skip
    """attribution.png: the ``top`` highest-scoring tokens as bars (the whole input when it
    is short), the figure's size capped whatever L."""
    from .common import figure, save_figure

    n = len(labels)
    shown = list(range(n)) if n <= top else sorted(i for i, _ in found.top(top))
    values = [float(found.scores[i]) for i in shown]
    fig = figure(figsize=(min(16.0, max(4.0, 0.4 * len(shown) + 1)), 3.4))
    ax = fig.subplots()
    colours = ["tab:orange" if i == found.position else "tab:blue" for i in shown]
    ax.bar(range(len(shown)), values, color=colours)
    names = [labels[i] if n <= top else f"{labels[i]} @{i}" for i in shown]
    ax.set_xticks(range(len(shown)), names, rotation=60, ha="right", fontsize=7)
    which = "every token" if n <= top else f"the {len(shown)} highest of {n} tokens, in order"
    ax.set_title(f"{found.method}: {found.target} ({which})", fontsize=9)
    ax.set_ylabel("score")
    return save_figure(fig, folder / "attribution.png")


def fitted_grid(cells: list[list[str]], say: Callable[[str], None], heading: str,
                width: int | None = None) -> None:  # fmt: skip
    """A heads (rows) x layers (columns) table of ``cells[layer][head]``, ``width`` columns a
    cell, its layer columns split into blocks so that no line is wider than ``WIDTH``."""
    layers, heads = len(cells), len(cells[0])
    if width is None:
        width = max(12, max(len(c) for row in cells for c in row) + 2)
    per_block = max(1, (WIDTH - 5) // width)
    say(heading)
    for start in range(0, layers, per_block):
        block = range(start, min(layers, start + per_block))
        say("head " + "".join(f"{'layer ' + str(layer):>{width}}" for layer in block))
        for h in range(heads):
            say(f"{h:>4} " + "".join(f"{cells[layer][h]:>{width}}" for layer in block))


@dataclass(eq=False)
class _FocusRows(acting.Capture):
    """A capture that keeps only the focus query's row of each layer's weights."""

    focus: int = 0

    def record(self, layer: int, weights: Tensor, values: Tensor | None = None) -> None:
        self.weights[layer] = weights[:, :, self.focus].detach().float()


def focus_rows(captured: Any, run: Callable[[], object], focus: int) -> Tensor:
    """(layers, H, L): every head's weights from the focus query while ``run()`` runs
    ``captured``, one layer's full weights at a time (never all layers' at once)."""
    reader, found = acting.find(captured, "multihead explain")
    cap = _FocusRows(None, len(found), focus=focus)
    with acting.open_block(captured, cap, reader, found), torch.inference_mode():
        run()
    return torch.stack([cap.weights[i][0] for i in range(len(found))])


def report(runner: tuple[Any, Callable[[], object]], ids: list[int], labels: list[str],
           focus: int, found: Attribution, folder: Path,
           say: Callable[[str], None]) -> dict[str, Path]:  # fmt: skip
    """The long-input report: every head's top token from the focus (from its row alone),
    the attribution, attribution.json and attribution.png; no full-weight figure."""
    rows = focus_rows(*runner, focus)
    layers, heads = rows.shape[:2]
    values, where = rows.max(-1)
    cells = [[f"{labels[int(where[l_, h])]} {100 * float(values[l_, h]):.0f}%"
              for h in range(heads)] for l_ in range(layers)]  # fmt: skip
    fitted_grid(cells, say, f"Most attended token from '{labels[focus]}' for every head "
                "(rows) and layer (columns), raw weights:")  # fmt: skip
    files = {"attribution": write_attribution(found, folder),
             "attribution_figure": attribution_figure(found, labels, folder)}  # fmt: skip
    import textwrap

    note = (f"the input has {len(ids)} tokens: the heatmaps, the 3-D surface and the head view "
            f"are drawn up to {LONG - 1} tokens (their size follows L); the focus row above "
            "and the attribution are what this run shows")  # fmt: skip
    say("\n" + "\n".join(textwrap.wrap(note, WIDTH)))
    say("\nwrote:")
    say(f"  {files['attribution']}  (the attribution: method, target, tokens, scores)")
    say(f"  {files['attribution_figure']}  (its highest tokens as bars)")
    return files
