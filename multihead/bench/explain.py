"""``multihead bench explain``: how faithful each attribution method of
``multihead.inspect.attribute`` is, and what it costs.

* **Faithfulness** (ERASER, DeYoung et al. 2020): on VADER test texts with a MiniLM sentiment
  model (a ``multihead train sentiment`` folder given by ``--sentiment-model``, or trained here
  for ``--train-epochs`` on the VADER training halves), the tokens a method ranks highest are
  replaced by [MASK] at 1, 5, 10, 20 and 50% of the words. Comprehensiveness is the score's
  drop with them replaced, sufficiency its drop with only them kept, both toward the sign of the
  model's own score and averaged over the five fractions (AOPC). Captum's
  ``LayerIntegratedGradients`` (50 steps, [PAD] as the baseline of every word) is the
  independent contender.
* **Subject-verb agreement** on SmolLM2: prompts "<prefix> the <subject> <preposition> the
  <attractor>" built from a seed, the subject and attractor of opposite number, kept where
  the model prefers the right verb; the target is the logit of the right verb (" is"/" are",
  " was"/" were", " has"/" have") against the wrong one. Scored: the subject ranked first, its
  mean reciprocal rank, the attractor ranked above it.
* **Cost**: seconds and peak memory growth per method at 128, 512 and 4,096 tokens on
  SmolLM2, each in a fresh process, beside one forward and backward.

Prints a table per part and the goals, writes explain.json and explain.png into ``--out``.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import _validation as V
from .._flags import option, positive_int
from .options import Results, goal_line

__all__ = ["ExplainBenchOptions", "agreement_prompts", "aopc", "run_explain_bench"]

FRACTIONS = (0.01, 0.05, 0.10, 0.20, 0.50)
METHODS = ("attention", "rollout", "norm", "alti", "grad_input", "integrated_gradients",
           "occlusion")  # fmt: skip
PARTS = ("faithfulness", "agreement", "cost")


@dataclass(frozen=True, kw_only=True)
class ExplainBenchOptions(Results):
    """What ``multihead bench explain`` takes (``multihead bench explain --help``)."""

    parts: tuple[str, ...] = option(PARTS, "which parts to run", choices=PARTS)
    methods: tuple[str, ...] = option(METHODS, "the methods", choices=METHODS)
    data: Path | None = option(
        None, "folder of the VADER ground truth (default: downloaded into the user cache, as "
        "multihead train sentiment does)", metavar="DIR",
    )  # fmt: skip
    sentiment_model: Path | None = option(
        None, "a multihead train sentiment folder (default: one trained here)", metavar="DIR"
    )  # fmt: skip
    train_epochs: int = option(1, "epochs of the sentiment model trained here", parse=positive_int)
    texts: int = option(1000, "VADER test texts of the faithfulness part", parse=positive_int)
    prompts: int = option(200, "agreement prompts on SmolLM2", parse=positive_int)
    lengths: tuple[int, ...] = option((128, 512, 4096), "token counts of the cost part",
                                      parse=positive_int, metavar="N")  # fmt: skip
    steps: int = option(50, "integrated gradients' steps (ours and Captum's)", parse=positive_int)
    seed: int = option(0, "seed of the texts' sample and the prompts", parse=int)
    llm: str = option("smollm2", "the causal LM of the agreement and cost parts", metavar="MODEL")


# -- subject-verb agreement --------------------------------------------------------------------

_NOUNS = [("key", "keys"), ("author", "authors"), ("dog", "dogs"), ("teacher", "teachers"),
          ("picture", "pictures"), ("girl", "girls"), ("boy", "boys"), ("doctor", "doctors"),
          ("painting", "paintings"), ("manager", "managers"), ("road", "roads"),
          ("student", "students"), ("letter", "letters"), ("farmer", "farmers"),
          ("window", "windows"), ("car", "cars"), ("player", "players"), ("house", "houses"),
          ("tree", "trees"), ("friend", "friends")]  # fmt: skip
_PLACES = [("cabinet", "cabinets"), ("table", "tables"), ("garden", "gardens"),
           ("office", "offices"), ("river", "rivers"), ("museum", "museums"),
           ("village", "villages"), ("company", "companies"), ("hill", "hills"),
           ("school", "schools"), ("book", "books"), ("room", "rooms")]  # fmt: skip
_PREPOSITIONS = ["to", "near", "behind", "next to", "from", "by", "of", "beside", "in"]
_PREFIXES = ["I heard that the", "Everyone agrees that the", "Yesterday the",
             "She told me that the", "It seems that the", "We know that the"]  # fmt: skip
_VERBS = [(" is", " are"), (" was", " were"), (" has", " have")]


@dataclass(frozen=True)
class Prompt:
    """One agreement prompt: its text, the subject's and the attractor's words, the right
    verb and the wrong one."""

    text: str
    subject: str
    attractor: str
    right: str
    wrong: str


def agreement_prompts(count: int, seed: int) -> list[Prompt]:
    """``count`` prompts from ``seed``: the subject and the attractor of opposite number, the
    subject never the first word."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        noun, place = rng.choice(_NOUNS), rng.choice(_PLACES)
        plural = rng.random() < 0.5
        subject, attractor = noun[int(plural)], place[int(not plural)]
        prefix, prep = rng.choice(_PREFIXES), rng.choice(_PREPOSITIONS)
        verbs = rng.choice(_VERBS)
        right, wrong = verbs[int(plural)], verbs[int(not plural)]
        out.append(Prompt(f"{prefix} {subject} {prep} the {attractor}", subject, attractor,
                          right, wrong))  # fmt: skip
    return out


def _word_positions(tokenizer: Any, ids: list[int], word: str) -> list[int]:
    """The positions of the pieces of `` word`` in ``ids`` (its last occurrence)."""
    pieces = tokenizer.encode(" " + word, add_special_tokens=False).ids
    for start in range(len(ids) - len(pieces), -1, -1):
        if ids[start : start + len(pieces)] == pieces:
            return list(range(start, start + len(pieces)))
    return []


def _agreement(model: Any, tokenizer: Any, options: ExplainBenchOptions, say: Callable) -> dict:
    from ..inspect import NextToken, attribute

    backend = tokenizer.backend_tokenizer
    rows: dict[str, dict[str, list[float]]] = {m: {"top": [], "rr": [], "attr": []}
                                               for m in options.methods}  # fmt: skip
    asked = agreement_prompts(options.prompts * 3, options.seed)
    kept = 0
    for prompt in _progress(asked, "agreement prompts"):
        if kept >= options.prompts:
            break
        ids = backend.encode(prompt.text, add_special_tokens=False).ids
        right = backend.encode(prompt.right, add_special_tokens=False).ids
        wrong = backend.encode(prompt.wrong, add_special_tokens=False).ids
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
        if logits[right[0]] <= logits[wrong[0]]:
            continue  # the model is wrong on this prompt
        subject = _word_positions(backend, ids, prompt.subject)
        attractor = _word_positions(backend, ids, prompt.attractor)
        if not subject or not attractor or min(subject) <= 1:
            continue
        kept += 1
        target = NextToken(len(ids) - 1, right[0])
        for method in options.methods:
            found = attribute(model, ids, target=target, method=method, contrast=wrong[0],
                              steps=options.steps)  # fmt: skip
            order = found.scores.argsort(descending=True).tolist()
            rank = min(order.index(p) for p in subject) + 1
            other = min(order.index(p) for p in attractor) + 1
            rows[method]["top"].append(float(rank == 1))
            rows[method]["rr"].append(1.0 / rank)
            rows[method]["attr"].append(float(other < rank))
    table = {m: {"subject_top1": _mean(r["top"]), "mrr": _mean(r["rr"]),
                 "attractor_above": _mean(r["attr"])} for m, r in rows.items()}  # fmt: skip
    say(f"\nSubject-verb agreement, {options.llm}: {kept} prompts the model gets right "
        f"(seed {options.seed}); target: the right verb's logit minus the wrong one's")  # fmt: skip
    say(f"{'method':>22} {'subject top-1':>14} {'MRR':>6} {'attractor above':>16}")
    for method, row in table.items():
        say(f"{method:>22} {100 * row['subject_top1']:13.1f}% {row['mrr']:6.3f} "
            f"{100 * row['attractor_above']:15.1f}%")  # fmt: skip
    return {"prompts": kept, "methods": table}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _progress(items: list, what: str) -> Any:
    """``items`` with a progress bar on stderr when it is a terminal."""
    import sys

    from tqdm import tqdm

    return tqdm(items, desc=what, disable=not sys.stderr.isatty(), leave=False)


# -- faithfulness ------------------------------------------------------------------------------


def aopc(score: Callable[[list[list[int]]], torch.Tensor], ids: list[int], order: list[int],
         mask_id: int, words: list[int]) -> tuple[float, float]:  # fmt: skip
    """(comprehensiveness, sufficiency) of one ranking, as AOPC over ``FRACTIONS``.

    Args:
        score: batches of id lists -> the model's score oriented toward its prediction.
        ids: the text's ids.
        order: ``words`` positions ranked, most important first.
        mask_id: the replacement token.
        words: the positions that may be replaced (not [CLS]/[SEP]).
    """
    variants = [ids]
    for fraction in FRACTIONS:
        k = max(1, round(fraction * len(words)))
        top = set(order[:k])
        removed = [mask_id if i in top else t for i, t in enumerate(ids)]
        kept = [t if (i in top or i not in words) else mask_id for i, t in enumerate(ids)]
        variants += [removed, kept]
    values = score(variants)
    full = float(values[0])
    comp = [full - float(values[1 + 2 * i]) for i in range(len(FRACTIONS))]
    suff = [full - float(values[2 + 2 * i]) for i in range(len(FRACTIONS))]
    return sum(comp) / len(comp), sum(suff) / len(suff)


def _sentiment_model(options: ExplainBenchOptions, say: Callable) -> Any:
    """The sentiment model: the folder given, or ``multihead train sentiment`` run here (in
    its own process, on the VADER training halves) into ``--out``/sentiment."""
    import subprocess
    import sys

    from .. import io

    if options.sentiment_model is not None:
        return io.load(options.sentiment_model)
    folder = V.check_out_dir("--out", options.out) / "sentiment"
    if not (folder / "model").is_dir():
        say(f"training a MiniLM sentiment model ({options.train_epochs} epoch(s), the VADER "
            f"training halves) into {folder}")  # fmt: skip
        args = [
            "train",
            "sentiment",
            "--out",
            str(folder),
            "--epochs",
            str(options.train_epochs),
            "--no-baselines",
            "--no-progress",
            "--overwrite",
            "--seed",
            str(options.seed),
        ]
        if options.data is not None:
            args += ["--data", str(options.data)]
        done = subprocess.run([sys.executable, "-m", "multihead.cli", *args],
                              capture_output=True, text=True)  # fmt: skip
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no message"])[-1]
            raise ValueError(f"training the sentiment model failed: {last}")
    return io.load(folder / "model")


def _test_texts(options: ExplainBenchOptions) -> list[str]:
    from ..apps import sentiment

    texts = []
    for corpus in sentiment.read_corpora(options.data):
        _, test = sentiment.split(corpus, options.seed)
        texts += [corpus.texts[i] for i in test]
    rng = random.Random(options.seed)
    rng.shuffle(texts)
    return texts[: options.texts]


def _captum_lig(
    model: Any, ids: list[int], pad: int, special: set[int], steps: int
) -> torch.Tensor:
    from captum.attr import LayerIntegratedGradients

    encoder = model.encoder

    def forward(batch: torch.Tensor) -> torch.Tensor:
        lengths = torch.full((batch.shape[0],), batch.shape[1])
        return model(batch, lengths).reshape(batch.shape[0], -1)[:, 0]

    lig = LayerIntegratedGradients(forward, encoder.embeddings.word)
    inputs = torch.tensor([ids])
    baseline = torch.tensor([[t if t in special else pad for t in ids]])
    found = lig.attribute(inputs, baselines=baseline, n_steps=steps, internal_batch_size=steps)
    return found.sum(-1)[0].detach()


def _one_text(model: Any, ids: list[int], words: list[int], names: list[str],
              tokens: tuple[int, int, set[int]],
              steps: int) -> dict[str, tuple[float, ...]]:  # fmt: skip
    """{method: (comprehensiveness, sufficiency, share on the sinks)} for one text."""
    from .. import inspect

    mask_id, pad, special = tokens
    with torch.no_grad():
        sign = 1.0 if float(model(torch.tensor([ids]), torch.tensor([len(ids)]))) >= 0 else -1.0

    def score(batch: list[list[int]]) -> torch.Tensor:
        with torch.no_grad():
            t = torch.tensor(batch)
            return sign * model(t, torch.full((len(batch),), t.shape[1])).reshape(-1)

    out = {}
    for method in names:
        if method == "captum_integrated_gradients":
            scores = _captum_lig(model, ids, pad, special, steps)
            sinks = [i for i, t in enumerate(ids) if t in special or i == 0]
            sink = float(scores[sinks].abs().sum()) / (float(scores.abs().sum()) or 1.0)
        else:
            answer = inspect.attribute(model, ids, target=inspect.ClassLogit(0), method=method,
                                       steps=steps)  # fmt: skip
            scores, sink = answer.scores, answer.sink_share
        if method not in ("attention", "rollout", "norm", "alti"):
            scores = sign * scores  # signed methods: toward the prediction
        order = sorted(words, key=lambda i: -float(scores[i]))
        out[method] = (*aopc(score, ids, order, mask_id, words), sink)
    return out


def _faithfulness(options: ExplainBenchOptions, say: Callable) -> dict:
    require_captum()
    model = _sentiment_model(options, say)
    model.eval()
    tokenizer = model.tokenizer
    mask_id = tokenizer.token_to_id("[MASK]")
    pad = tokenizer.token_to_id("[PAD]") or 0
    special = {tokenizer.token_to_id(t) for t in ("[CLS]", "[SEP]")}
    texts = _test_texts(options)
    names = [*options.methods, "captum_integrated_gradients"]
    found: dict[str, dict[str, list[float]]] = {m: {"comp": [], "suff": [], "sink": []}
                                                for m in names}  # fmt: skip

    for text in _progress(texts, "faithfulness texts"):
        ids = tokenizer.encode(text).ids[: model.max_tokens]
        words = [i for i, t in enumerate(ids) if t not in special]
        if words:
            for method, (comp, suff, sink) in _one_text(model, ids, words, names,
                                                         (mask_id, pad, special),
                                                         options.steps).items():  # fmt: skip
                found[method]["comp"].append(comp)
                found[method]["suff"].append(suff)
                found[method]["sink"].append(sink)
    table = {m: {"comprehensiveness": _mean(r["comp"]), "sufficiency": _mean(r["suff"]),
                 "sink_share": _mean(r["sink"])} for m, r in found.items()}  # fmt: skip
    say(f"\nFaithfulness (ERASER AOPC over {', '.join(f'{100 * f:g}%' for f in FRACTIONS)} of "
        f"the words replaced by [MASK]), {len(found[names[0]]['comp'])} VADER test texts; "
        "higher comprehensiveness and lower sufficiency are better")  # fmt: skip
    say(f"{'method':>28} {'comprehensiveness':>18} {'sufficiency':>12} {'on sinks':>9}")
    for method, row in table.items():
        say(f"{method:>28} {row['comprehensiveness']:18.4f} {row['sufficiency']:12.4f} "
            f"{100 * row['sink_share']:8.1f}%")  # fmt: skip
    return {"texts": len(found[names[0]]["comp"]), "methods": table}


def require_captum() -> None:
    from .._extras import require

    require("captum", "bench", "multihead bench explain's contender")


# -- cost ----------------------------------------------------------------------------------------


def _cost_child(model: str, method: str, length: int, steps: int) -> dict:
    """One method at one length in this (fresh) process: seconds and the peak growth of the
    resident memory above the loaded model."""
    import resource

    from ..hf import loading
    from ..inspect import attribute

    loaded, _ = loading.load_with_tokenizer(model)
    ids = torch.randint(100, loaded.config.vocab_size - 100, (length,),
                        generator=torch.Generator().manual_seed(0)).tolist()  # fmt: skip
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if method == "forward_backward":
        start = time.perf_counter()
        embeds = loaded.get_input_embeddings()(torch.tensor([ids])).detach().requires_grad_(True)
        loaded(inputs_embeds=embeds).logits[0, -1].max().backward()
    else:
        start = time.perf_counter()
        attribute(loaded, ids, target=length - 1, method=method, steps=steps)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"seconds": seconds, "peak_growth": max(0, peak - before)}


def _cost(options: ExplainBenchOptions, say: Callable) -> dict:
    import subprocess
    import sys

    rows: dict[str, dict[str, Any]] = {}
    code = (
        "import json, sys; from multihead.bench import explain as e; print(json.dumps("
        "e._cost_child(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))"
    )
    say(f"\nCost on {options.llm} (each in a fresh process; peak growth of resident memory "
        "above the loaded model)")  # fmt: skip
    say(f"{'method':>22} " + " ".join(f"{str(n) + ' tokens':>22}" for n in options.lengths))
    for method in ("forward_backward", *options.methods):
        rows[method] = {}
        cells = []
        for length in options.lengths:
            done = subprocess.run(
                [sys.executable, "-c", code, options.llm, method, str(length),
                 str(options.steps)], capture_output=True, text=True, timeout=3600,
            )  # fmt: skip
            if done.returncode != 0:
                last = (done.stderr.strip().splitlines() or ["no message"])[-1]
                rows[method][str(length)] = {"refused": last}
                cells.append(f"{'refused':>22}")
                continue
            row = json.loads(done.stdout.strip().splitlines()[-1])
            rows[method][str(length)] = row
            cells.append(f"{row['seconds']:9.2f} s {row['peak_growth'] / 2**20:7.0f} MiB")
        say(f"{method:>22} " + " ".join(cells))
    return rows


def run_explain_bench(options: ExplainBenchOptions, *, say: Callable[[str], None] = print) -> dict:
    """Run the parts; print the tables and goals; write explain.json and explain.png."""
    from .._extras import require
    from .._machine import cpu_info
    from .measuring import matmul_peaks

    out = V.check_out_dir("--out", options.out)
    peaks = matmul_peaks(1024)
    cpu = cpu_info()[0]
    say(f"CPU: {cpu}; {torch.get_num_threads()} threads; torch {torch.__version__}; matmul "
        f"peak fp32 {peaks['float32']:.0f}, bf16 {peaks['bfloat16']:.0f} GFLOP/s")  # fmt: skip
    result: dict[str, Any] = {"cpu": cpu, "threads": torch.get_num_threads(),
                              "peaks_gflops": peaks, "steps": options.steps}  # fmt: skip
    if "faithfulness" in options.parts:
        result["faithfulness"] = _faithfulness(options, say)
    if "agreement" in options.parts:
        require("transformers", "hf", "multihead bench explain's agreement part")
        from ..hf import loading

        model, tokenizer = loading.load_with_tokenizer(options.llm)
        result["agreement"] = _agreement(model, tokenizer, options, say)
        del model
    if "cost" in options.parts:
        require("transformers", "hf", "multihead bench explain's cost part")
        result["cost"] = _cost(options, say)
    result["goals"] = _goals(result)
    for goal in result["goals"]:
        say(goal_line(goal))
    out.mkdir(parents=True, exist_ok=True)
    (out / "explain.json").write_text(json.dumps(result, indent=2))
    result["figure"] = str(_figure(result, out / "explain.png"))
    say(f"wrote {out / 'explain.json'} and {result['figure']}")
    return result


def _goals(result: dict) -> list[dict]:
    from ..inspect.attribution import AUTO

    goals = []
    default = AUTO["classifier"]  # the default of the faithfulness part's target
    faith = result.get("faithfulness", {}).get("methods", {})
    if default in faith and "captum_integrated_gradients" in faith:
        ig = faith["captum_integrated_gradients"]
        mine = faith[default]
        ratio = mine["comprehensiveness"] / ig["comprehensiveness"] if ig[
            "comprehensiveness"] > 0 else float("inf")  # fmt: skip
        goals.append({"text": f"{default} comprehensiveness / Captum IG's >= 1.2",
                      "figure": ratio, "met": ratio >= 1.2})  # fmt: skip
        goals.append({"text": f"{default} sufficiency - Captum IG's <= 0",
                      "figure": mine["sufficiency"] - ig["sufficiency"],
                      "met": mine["sufficiency"] <= ig["sufficiency"]})  # fmt: skip
        if "rollout" in faith and faith["rollout"]["comprehensiveness"] > 0:
            r = mine["comprehensiveness"] / faith["rollout"]["comprehensiveness"]
            goals.append({"text": f"{default} comprehensiveness / rollout's >= 3", "figure": r,
                          "met": r >= 3})  # fmt: skip
        goals.append({"text": f"{default} share on [CLS]/[SEP] <= 5%",
                      "figure": 100 * mine["sink_share"],
                      "met": mine["sink_share"] <= 0.05})  # fmt: skip
    agree = result.get("agreement", {}).get("methods", {})
    causal = AUTO["causal LM"]  # the default of the agreement part's target
    if causal in agree:
        row = agree[causal]
        goals.append({"text": f"{causal} subject first, % >= 90",
                      "figure": 100 * row["subject_top1"],
                      "met": row["subject_top1"] >= 0.9})  # fmt: skip
        goals.append({"text": f"{causal} attractor above the subject, % <= 10",
                      "figure": 100 * row["attractor_above"],
                      "met": row["attractor_above"] <= 0.1})  # fmt: skip
    return goals


def _figure(result: dict, path: Path) -> Path:
    from ..apps.common import figure, save_figure

    panels = [p for p in ("faithfulness", "agreement", "cost") if p in result]
    fig = figure(figsize=(5.0 * max(1, len(panels)), 4.0))
    axes = fig.subplots(1, max(1, len(panels)), squeeze=False)[0]
    for ax, part in zip(axes, panels):
        if part == "faithfulness":
            rows = result[part]["methods"]
            names = list(rows)
            ax.barh(names, [rows[n]["comprehensiveness"] for n in names], label="comprehensiveness")
            ax.barh(names, [-rows[n]["sufficiency"] for n in names], label="- sufficiency")
            ax.set_title(f"ERASER AOPC, {result[part]['texts']} VADER texts", fontsize=9)
            ax.legend(fontsize=7)
        elif part == "agreement":
            rows = result[part]["methods"]
            names = list(rows)
            ax.barh(names, [100 * rows[n]["subject_top1"] for n in names], label="subject first")
            ax.barh(names, [100 * rows[n]["attractor_above"] for n in names], height=0.4,
                    label="attractor above")  # fmt: skip
            ax.set_xlabel("% of prompts")
            ax.set_title(f"agreement, {result[part]['prompts']} prompts", fontsize=9)
            ax.legend(fontsize=7)
        else:
            for method, row in result[part].items():
                xs = [int(n) for n, c in row.items() if "seconds" in c]
                ax.plot(xs, [row[str(n)]["seconds"] for n in xs], marker="o", label=method)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("tokens")
            ax.set_ylabel("seconds")
            ax.set_title("cost", fontsize=9)
            ax.legend(fontsize=6)
        ax.tick_params(labelsize=7)
    return save_figure(fig, path)
