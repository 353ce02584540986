"""A self-contained HTML head view: every script, style and number inline, no network at all.

Open the file from disk in any browser, offline. Pick a layer and any set of heads (each in its
own colour), hover over a query token to see its attention lines, click to pin it; the weights
and each head's statistics are listed beside the drawing. A toggle hides the attention sinks
(``multihead.inspect.find_sinks``) and shows each row renormalized over the other tokens.
"""

from __future__ import annotations

import html
import json
from collections.abc import Sequence
from pathlib import Path

from torch import Tensor

from ..inspect import HeadStats, Sinks, _check, _check_tokens, find_sinks, head_stats

__all__ = ["MAX_TOKENS", "MIN_WEIGHT", "head_view", "save_head_view"]

MAX_TOKENS = 256  # layers x H x L x L numbers are embedded; beyond this the page gets too heavy
MIN_WEIGHT = 0.01  # lines below this weight are not drawn (listed weights are all exact)
_DIGITS = 5  # weights are embedded rounded to 1e-5

# 12 colours far apart from each other and from the white page (Trubetskoy's list of distinct
# colours, its palest left out: CIELAB distance at least 29 between any two), cycled for more
# heads
_COLOURS = [
    "#e6194b", "#3cb44b", "#4363d8", "#f58231", "#911eb4", "#42d4f4",
    "#f032e6", "#9a6324", "#000075", "#808000", "#469990", "#800000",
]  # fmt: skip


def head_view(
    weights: Tensor,
    tokens: Sequence[str],
    *,
    special: Sequence[bool] | None = None,
    stats: HeadStats | None = None,
    focus: int | None = None,
    title: str = "attention head view",
    sinks: Sinks | None = None,
    hide_sinks: bool = False,
) -> str:
    """The page as a string.

    Args:
        weights: (layers, H, L, L) of one sequence, L <= ``MAX_TOKENS``.
        tokens: the L token labels.
        special: (L,) flags of special tokens (for the statistics and the styling).
        stats: precomputed ``head_stats``; computed from ``weights`` when None.
        focus: query position selected when the page opens (default: none, all lines faint).
        title: page heading.
        sinks: the sinks the toggle hides; ``find_sinks(weights, special)`` when None.
        hide_sinks: open the page with the sinks hidden and the rows renormalized (the page
            does what ``multihead.inspect.without_sinks`` does, on the embedded weights).
    """
    w = _check(weights).detach().float().cpu()
    layers, heads, n, _ = w.shape
    _check_tokens(tokens, n)
    if n > MAX_TOKENS:
        raise ValueError(
            f"the head view embeds every weight; keep inputs to {MAX_TOKENS} tokens. "
            f"Received: {n} tokens"
        )
    if focus is not None and not 0 <= focus < n:
        raise ValueError(f"focus must be a position in [0, {n}). Received: focus={focus}")
    special = [False] * n if special is None else [bool(s) for s in special]
    stats = head_stats(w, special) if stats is None else stats
    sinks = find_sinks(w, special) if sinks is None else sinks
    if sinks.mass.shape != (layers, heads) or any(not 0 <= p < n for p in sinks.positions):
        raise ValueError(
            f"sinks must be those of these weights: {layers} layers x {heads} heads, positions "
            f"in [0, {n}). Received: sinks.mass.shape={tuple(sinks.mass.shape)}, "
            f"positions={list(sinks.positions)}"
        )
    table = {**stats.as_dict(), "sinks": sinks.mass.tolist()}
    data = {
        "title": title,
        "tokens": list(tokens),
        "special": special,
        "weights": w.double().round(decimals=_DIGITS).tolist(),  # short decimals in JSON
        "stats": {k: [[round(x, 4) for x in row] for row in v] for k, v in table.items()},
        "sinks": list(sinks.positions),
        "sinkReasons": list(sinks.reasons),
        "hideSinks": bool(hide_sinks),
        "focus": focus,
        "colours": [_COLOURS[h % len(_COLOURS)] for h in range(heads)],
        "minWeight": MIN_WEIGHT,
        "layers": layers,
        "heads": heads,
    }
    # "</" inside a script element would end it early
    payload = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
    return (
        _PAGE.replace("/*TITLE*/", html.escape(title))
        .replace("/*STYLE*/", _STYLE)
        .replace("/*DATA*/", payload)
        .replace("/*SCRIPT*/", _SCRIPT)
    )


def save_head_view(path: str | Path, weights: Tensor, tokens: Sequence[str], **kwargs) -> Path:
    """Write ``head_view(weights, tokens, **kwargs)`` to ``path`` (UTF-8) and return the path."""
    path = Path(path)
    path.write_text(head_view(weights, tokens, **kwargs), encoding="utf-8")
    return path


_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; \
script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:">
<title>/*TITLE*/</title>
<style>/*STYLE*/</style>
</head>
<body>
<h1>/*TITLE*/</h1>
<div id="controls">
  <label>Layer <select id="layer"></select></label>
  <span id="heads"></span>
  <button id="all-heads" type="button">all heads</button>
  <button id="no-heads" type="button">no heads</button>
  <button id="unpin" type="button">show every token</button>
  <label><input type="checkbox" id="hide-sinks"> hide the sinks (renormalize the rest)</label>
</div>
<p class="hint" id="sinks-line"></p>
<p class="hint">Hover over a token on the left to see where it looks; click to pin it.
Line opacity and width follow the weight; lines under <span id="min-weight"></span> are not
drawn. Each head's lines end in a column of its own beside the keys, at squares in its colour
filled as strongly as the weight.</p>
<div id="main">
  <svg id="view" role="img" aria-label="attention lines"></svg>
  <div id="side">
    <h2 id="weights-title">Weights</h2>
    <table id="weights"></table>
    <h2>Head statistics, layer <span id="stats-layer"></span></h2>
    <table id="stats"></table>
    <p class="hint">entropy in nats; distance in tokens; the other columns are shares of
    the raw weight (special tokens, the token itself, the previous and the next token, the
    sinks).</p>
  </div>
</div>
<script id="data" type="application/json">/*DATA*/</script>
<script>/*SCRIPT*/</script>
</body>
</html>
"""

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 1em 2em; color: #222; }
h1 { font-size: 1.3em; } h2 { font-size: 1em; margin: 1em 0 0.3em; }
#controls { display: flex; flex-wrap: wrap; gap: 0.6em; align-items: center; }
#heads label { display: inline-block; padding: 0.1em 0.4em; border-radius: 4px; color: #fff;
  font-size: 0.85em; cursor: pointer; }
#heads input { margin: 0 0.2em 0 0; vertical-align: middle; }
#main { display: flex; gap: 2em; align-items: flex-start; margin-top: 0.5em; }
svg text { font-size: 13px; cursor: pointer; dominant-baseline: middle; }
svg text.special { fill: #888; }
svg text.selected { font-weight: bold; fill: #c00; }
svg text.sink { font-style: italic; } svg text.hidden-sink { opacity: 0.25; }
table { border-collapse: collapse; font-size: 0.85em; }
td, th { padding: 0.15em 0.5em; text-align: right; border-bottom: 1px solid #eee; }
th { background: #f4f4f4; } td.tok { text-align: left; }
.hint { color: #666; font-size: 0.85em; }
.swatch { display: inline-block; width: 0.8em; height: 0.8em; border-radius: 2px; }
"""

_SCRIPT = """
"use strict";
const data = JSON.parse(document.getElementById("data").textContent);
const state = { layer: 0, heads: new Set(), query: data.focus, pinned: data.focus !== null,
  hideSinks: data.hideSinks && data.sinks.length > 0 };
for (let h = 0; h < data.heads; h++) state.heads.add(h);
const sinks = new Set(data.sinks), cleaned = new Map();

// The layer's weights as shown: raw, or with the sink columns set to 0 and each row
// renormalized over the other keys (a row that was all on sinks becomes all 0), as
// multihead.inspect.without_sinks computes them.
function layerWeights() {
  const raw = data.weights[state.layer];
  if (!state.hideSinks) return raw;
  if (!cleaned.has(state.layer)) {
    cleaned.set(state.layer, raw.map((head) => head.map((row) => {
      const kept = row.map((w, k) => (sinks.has(k) ? 0 : w));
      const total = kept.reduce((a, b) => a + b, 0);
      return kept.map((w) => (total > 0 ? w / total : 0));
    })));
  }
  return cleaned.get(state.layer);
}
const ROW = 22, LEFT = 150, GAP = 260, TOP = 10, LANE = 8, MARK = 6;
const esc = (s) => String(s).replace(/[&<>"]/g, (c) => ({"&": "&amp;", "<": "&lt;",
  ">": "&gt;", "\\"": "&quot;"}[c]));

function setup() {
  const layer = document.getElementById("layer");
  for (let l = 0; l < data.layers; l++) layer.add(new Option(String(l), String(l)));
  layer.addEventListener("change", () => { state.layer = Number(layer.value); render(); });
  const heads = document.getElementById("heads");
  heads.innerHTML = data.colours.map((c, h) => `<label style="background:${c}">` +
    `<input type="checkbox" id="head-${h}" data-head="${h}" checked>${h}</label>`).join("");
  heads.addEventListener("change", (e) => {
    const h = Number(e.target.dataset.head);
    if (e.target.checked) state.heads.add(h); else state.heads.delete(h);
    render();
  });
  const setAll = (on) => {
    for (let h = 0; h < data.heads; h++) {
      document.getElementById("head-" + h).checked = on;
      if (on) state.heads.add(h); else state.heads.delete(h);
    }
    render();
  };
  document.getElementById("all-heads").onclick = () => setAll(true);
  document.getElementById("no-heads").onclick = () => setAll(false);
  document.getElementById("unpin").onclick = () => {
    state.query = null; state.pinned = false; render();
  };
  document.getElementById("min-weight").textContent = data.minWeight;
  const hide = document.getElementById("hide-sinks");
  hide.checked = state.hideSinks;
  hide.disabled = data.sinks.length === 0;
  hide.addEventListener("change", () => { state.hideSinks = hide.checked; render(); });
  document.getElementById("sinks-line").textContent = data.sinks.length === 0 ?
    "No attention sinks found." : "Attention sinks: " + data.sinks.map((p, i) =>
      `${data.tokens[p]} (position ${p}: ${data.sinkReasons[i]})`).join(", ") + ".";
  const svg = document.getElementById("view");
  svg.setAttribute("width", LEFT * 2 + GAP);
  svg.setAttribute("height", TOP * 2 + ROW * data.tokens.length);
  svg.addEventListener("click", (e) => {
    const t = e.target.closest("text.query");
    if (!t) return;
    const q = Number(t.dataset.index);
    if (state.pinned && state.query === q) { state.pinned = false; state.query = null; }
    else { state.pinned = true; state.query = q; }
    render();
  });
  svg.addEventListener("mouseover", (e) => {
    const t = e.target.closest("text.query");
    if (!t || state.pinned || state.query === Number(t.dataset.index)) return;
    state.query = Number(t.dataset.index); render();
  });
  svg.addEventListener("mouseleave", () => {
    if (!state.pinned && state.query !== null) { state.query = null; render(); }
  });
}

// Each head's lines end in a lane of its own beside the keys, at a square outlined in the head's
// colour: lines of many heads to one key would otherwise end on one spot and blend into one.
function lines() {
  const out = [], marks = [], W = layerWeights();
  const queries = state.query === null ? data.tokens.map((_, i) => i) : [state.query];
  const heads = [...state.heads].sort((a, b) => a - b);
  const x1 = LEFT + 6;
  heads.forEach((h, lane) => {
    const x2 = LEFT + GAP - 6 - MARK - (heads.length - 1 - lane) * LANE;
    const marked = new Set();
    for (const q of queries) {
      const row = W[h][q];
      for (let k = 0; k < row.length; k++) {
        const w = row[k];
        if (w < data.minWeight) continue;
        const op = state.query === null ? w * 0.5 : Math.min(1, 0.15 + w);
        const y2 = TOP + ROW * k + ROW / 2;
        out.push(`<line class="attn" x1="${x1}" y1="${TOP + ROW * q + ROW / 2}" x2="${x2}" ` +
          `y2="${y2}" stroke="${data.colours[h]}" ` +
          `stroke-opacity="${op.toFixed(3)}" stroke-width="${(1 + 5 * w).toFixed(2)}" ` +
          `data-head="${h}" data-query="${q}" data-key="${k}" data-weight="${w}">` +
          `<title>head ${h}: ${esc(data.tokens[q])} -> ${esc(data.tokens[k])} ` +
          `${(100 * w).toFixed(1)}%</title></line>`);
        if (marked.has(k)) continue;
        marked.add(k);
        // outlined in the head's colour, filled as strongly as the (first) line's weight
        marks.push(`<rect class="mark" x="${x2 + 0.5}" y="${y2 - MARK / 2 + 0.5}" ` +
          `width="${MARK - 1}" height="${MARK - 1}" stroke="${data.colours[h]}" ` +
          `fill="${data.colours[h]}" fill-opacity="${op.toFixed(3)}" data-head="${h}" ` +
          `data-key="${k}"><title>head ${h}</title></rect>`);
      }
    }
  });
  return out.join("") + marks.join("");
}

function tokens() {
  return data.tokens.map((t, i) => {
    const cls = (data.special[i] ? " special" : "") + (state.query === i ? " selected" : "");
    const y = TOP + ROW * i + ROW / 2;
    return `<text class="token query${cls}" x="${LEFT}" y="${y}" text-anchor="end" ` +
      `data-index="${i}" id="query-${i}">${esc(t)}</text>` +
      `<text class="token key${data.special[i] ? " special" : ""}` +
      `${sinks.has(i) ? " sink" + (state.hideSinks ? " hidden-sink" : "") : ""}" ` +
      `x="${LEFT + GAP}" y="${y}" data-index="${i}" id="key-${i}">${esc(t)}</text>`;
  }).join("");
}

function weightTable() {
  const table = document.getElementById("weights");
  const title = document.getElementById("weights-title");
  const heads = [...state.heads].sort((a, b) => a - b);
  if (state.query === null || heads.length === 0) {
    title.textContent = "Weights (pick a token and at least one head)";
    table.innerHTML = ""; return;
  }
  title.textContent = `Weights from "${data.tokens[state.query]}" (position ${state.query})` +
    (state.hideSinks ? ", the sinks set aside and the rest renormalized" : "");
  const W = layerWeights();
  let s = "<tr><th>key</th>" + heads.map((h) =>
    `<th><span class="swatch" style="background:${data.colours[h]}"></span> ${h}</th>`)
    .join("") + "</tr>";
  data.tokens.forEach((t, k) => {
    if (state.hideSinks && sinks.has(k)) return;
    s += `<tr><td class="tok">${k} ${esc(t)}</td>` + heads.map((h) =>
      `<td data-head="${h}" data-key="${k}">${(100 * W[h][state.query][k]).toFixed(1)}%</td>`)
      .join("") + "</tr>";
  });
  table.innerHTML = s;
}

function statsTable() {
  document.getElementById("stats-layer").textContent = state.layer;
  const cols = ["entropy", "distance", "special", "itself", "previous", "next", "sinks"];
  let s = "<tr><th>head</th>" + cols.map((c) => `<th>${c}</th>`).join("") + "</tr>";
  for (let h = 0; h < data.heads; h++) {
    s += `<tr><td><span class="swatch" style="background:${data.colours[h]}"></span> ${h}</td>` +
      cols.map((c) => `<td>${data.stats[c][state.layer][h].toFixed(2)}</td>`).join("") + "</tr>";
  }
  document.getElementById("stats").innerHTML = s;
}

function render() {
  document.getElementById("view").innerHTML = `<g id="lines">${lines()}</g>` + tokens();
  weightTable();
  statsTable();
}

setup();
render();
"""
