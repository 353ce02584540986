"""``multihead kv``: how well a causal LM finds what a long input hides when its KV cache is
compressed, per policy, keep and length.

Tasks are generated from a seed (no data files): ``passkey`` hides one 5-digit key in repeated
filler text at depths spread over the input (Mohtashami & Jaggi 2023); ``multikey`` hides
several keys with values and asks for one (RULER's niah_multikey, Hsieh et al. 2024);
``ruler`` runs the RULER-style suite of ``multihead.apps.ruler`` (``--tasks`` picks some),
scored by string match as RULER scores it. ``--query-agnostic`` compresses the context alone
and appends the question after (compress once, ask many questions); by default the question is
part of the prompt the policies see.

Each trial's prompt runs once, on the full cache, with the statistics every policy ranks by
computed in the same kernel passes (``window_mass`` of the last rows, ``key_mass`` of all
rows, the last row's weights); each policy and keep then compresses its own copy of that
cache with ``multihead.kv``'s selection (the one ``multihead.hf.compress`` runs inside the
prompt's call) and decodes the answer greedily under ``compress``, which evicts as H2O, TOVA
and StreamingLLM do while decoding. Keep 1.0 is the full cache, the same for every policy.
``--budget`` adds cells of a fixed number of keys per layer. With ``--chunk N`` each
compressed cell runs its own prompt N tokens at a time under ``compress(chunk=N)``, the cache
cut back after each chunk (a long document's memory then grows with the budget, not the
prompt), and its prefill seconds are its own.
Writes ``OUT/kv.json`` and ``OUT/kv.png`` (accuracy against keep, a line per policy, a panel
per length).
"""

from __future__ import annotations

import functools
import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from .._flags import option, positive_int
from . import ruler
from .kvpress_runner import PRESSES as KVPRESS_PRESSES
from .ruler import TASKS, parse_tasks

__all__ = [
    "POLICIES", "KvOptions", "Trial", "make_task", "parse_budgets", "parse_keeps", "parse_lengths",
    "run",
]  # fmt: skip

_FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)
_WORDS = (
    "amber", "basil", "cedar", "delta", "ember", "fjord", "granite", "harbor", "indigo",
    "juniper", "kettle", "lantern", "meadow", "nickel", "orchid", "pepper", "quartz", "raven",
    "saffron", "timber", "umber", "velvet", "willow", "yonder", "zephyr",
)  # fmt: skip
# where the ms per decoding step come from (printed beside them and kept in kv.json)
_DECODING = (
    "one forward of transformers' model per token on attn_implementation='multihead', float32 "
    "(not multihead.hf.fast_decoding's path, which the README's decoding figures time)"
)
# multihead.kv.POLICIES' names, here so that parsing the flags imports no torch
POLICIES = (
    "snapkv",
    "h2o",
    "tova",
    "streaming",
    "chunkkv",
    "spankv",
    "pyramidkv",
    "reconstruction",
)
_NEW_TOKENS = {"passkey": 8, "multikey": 10}
_WINDOW = 32  # SnapKV's observation window: the policies run with their defaults


def parse_lengths(text: str) -> tuple[int, ...]:
    """``"1000,2000"`` -> (1000, 2000): prompt lengths in tokens, each >= 64."""
    values = _numbers(text, "--lengths", int)
    bad = [v for v in values if v < 64]
    if bad:
        raise ValueError(f"--lengths must be token counts >= 64. Received: --lengths {text}")
    return tuple(values)


def parse_keeps(text: str) -> tuple[float, ...]:
    """``"1.0,0.25"`` -> (1.0, 0.25): fractions of the prompt kept, in (0, 1]."""
    values = _numbers(text, "--keep", float)
    bad = [v for v in values if not 0 < v <= 1]
    if bad:
        raise ValueError(f"--keep takes fractions in (0, 1]. Received: --keep {text}")
    return tuple(values)


def parse_budgets(text: str) -> tuple[int, ...]:
    """``"512,1024"`` -> (512, 1024): token budgets, ints >= 1; ``""`` -> () (none)."""
    if not str(text).strip():
        return ()
    values = _numbers(text, "--budget", int)
    if any(v < 1 for v in values):
        raise ValueError(f"--budget takes token counts >= 1. Received: --budget {text}")
    return tuple(values)


def _numbers(text: str, name: str, kind: Callable[[str], Any]) -> list[Any]:
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    try:
        values = [kind(p) for p in parts]
    except ValueError:
        raise ValueError(f"{name} takes comma-separated numbers. Received: {name} {text}") from None
    if not values or len(set(values)) != len(values):
        raise ValueError(f"{name} takes distinct comma-separated numbers. Received: {name} {text}")
    return values


def _names(text: str, flag: str, choices: tuple[str, ...]) -> tuple[str, ...]:
    """``"a,B"`` -> ("a", "b"), each one of ``choices`` (the flag ``flag`` named otherwise)."""
    names = tuple(p.strip().lower() for p in str(text).split(",") if p.strip())
    if not names or any(n not in choices for n in names):
        raise ValueError(f"{flag} takes names from {', '.join(choices)}. Received: {flag} {text}")
    return names


def _policies(text: str) -> tuple[str, ...]:
    return _names(text, "--policies", POLICIES)


def _kvpress_presses(text: str) -> tuple[str, ...]:
    return _names(text, "--kvpress-presses", KVPRESS_PRESSES)


@dataclass(frozen=True, kw_only=True)
class KvOptions:
    """What ``multihead kv`` takes (``multihead kv --help``)."""

    model: str = option(
        "smollm2",
        "the causal LM: 'smollm2', 'gemma3', a .gguf file or a transformers folder "
        "(multihead.hf.load_with_tokenizer)",
        metavar="MODEL",
    )
    task: Literal["passkey", "multikey", "ruler"] = option(
        "passkey",
        "passkey: one 5-digit key in filler; multikey: several keys, one asked for; ruler: the "
        "RULER-style suite (--tasks)",
    )
    tasks: tuple[str, ...] = option(
        TASKS, "--task ruler: the tasks, separated by commas, or 'all'", parse=parse_tasks,
        metavar="NAMES",
    )  # fmt: skip
    query_agnostic: bool = option(
        False, "compress the context alone, then append the question (default: the question is "
        "in the prompt the policies score)",
    )  # fmt: skip
    lengths: tuple[int, ...] = option(
        (1000, 2000, 4000), "prompt lengths in tokens, separated by commas", parse=parse_lengths,
        metavar="N,N",
    )  # fmt: skip
    keep: tuple[float, ...] = option(
        (1.0, 0.5, 0.25, 0.125), "fractions of the prompt the cache keeps, separated by commas",
        parse=parse_keeps, metavar="F,F",
    )  # fmt: skip
    policies: tuple[str, ...] = option(
        ("snapkv", "h2o", "tova", "streaming"),
        f"policies, separated by commas, from {', '.join(POLICIES)}",
        parse=_policies, metavar="NAMES",
    )  # fmt: skip
    budget: tuple[int, ...] = option(
        (), "token budgets (keys kept per layer, whatever the length), separated by commas: "
        "cells beside --keep's", parse=parse_budgets, metavar="N,N",
    )  # fmt: skip
    chunk: int | None = option(
        None, "run each compressed prompt N tokens at a time, the cache cut back to the budget "
        "after each chunk (compress(chunk=N)); the full cache's prompt runs whole",
        parse=positive_int, metavar="N",
    )  # fmt: skip
    trials: int = option(20, "trials per length (depths spread over the input)", parse=positive_int)
    keys: int = option(4, "multikey: keys hidden in the text", parse=positive_int)
    seed: int = option(0, "seed of the keys, values and depths")
    kvpress_python: Path | None = option(
        None, "a Python interpreter with kvpress installed (an environment of its own: kvpress "
        "pins transformers < 5.3): the same prompts through kvpress's own pipeline, its presses "
        "at the same shares kept, their rows added to the table", metavar="PATH",
    )  # fmt: skip
    kvpress_presses: tuple[str, ...] = option(
        KVPRESS_PRESSES, f"--kvpress-python's presses, from {', '.join(KVPRESS_PRESSES)}",
        parse=_kvpress_presses, metavar="NAMES",
    )  # fmt: skip
    out: Path = option(Path("kv-out"), "folder for kv.json and kv.png", metavar="DIR")

    def __post_init__(self) -> None:
        # "1000,2000" and "1000 2000" alike: the parser gives one tuple per word
        for name, parse in (
            ("lengths", parse_lengths), ("keep", parse_keeps), ("policies", _policies),
            ("budget", parse_budgets), ("tasks", parse_tasks),
            ("kvpress_presses", _kvpress_presses),
        ):  # fmt: skip
            value = getattr(self, name)
            words = [value] if isinstance(value, (str, int, float)) else list(value)
            flat = ",".join(
                ",".join(map(str, w)) if isinstance(w, (tuple, list)) else str(w) for w in words
            )
            object.__setattr__(self, name, parse(flat))
        if self.chunk is not None and "reconstruction" in self.policies:
            raise ValueError(
                "--chunk runs each prompt under compress(chunk=N), and reconstruction scores the "
                "prompt by a second reading of it whole (multihead.hf.compress_context): drop "
                "one of them. Received: --chunk with --policies reconstruction"
            )


@dataclass
class Trial:
    """One generated input: the prompt text, the answer, where the needle sits, and the
    question that ends the prompt (what ``--query-agnostic`` appends after compression)."""

    prompt: str
    answer: str
    depth: float
    question: str = ""


def make_task(
    task: str, tokenizer: Any, length: int, depth: float, rng: random.Random, keys: int = 4
) -> Trial:
    """A ``task`` input of about ``length`` tokens with its needle at ``depth`` (0: start, 1:
    end of the filler)."""
    if task == "passkey":
        key = f"{rng.randrange(10000, 100000)}"
        head = (
            "There is an important piece of information hidden inside a lot of irrelevant "
            "text. Find it and memorize it. I will quiz you about it.\n"
        )
        needles = [f"The pass key is {key}. Remember it. {key} is the pass key. "]
        question = "\nWhat is the pass key? The pass key is"
        answer = key
    elif task == "multikey":
        names = rng.sample(_WORDS, keys)
        values = [f"{rng.randrange(1000000, 10000000)}" for _ in names]
        head = (
            "Some special magic numbers are hidden inside the following text. Make sure to "
            "memorize them. I will quiz you about one of them afterwards.\n"
        )
        needles = [
            f"One of the special magic numbers for {n} is: {v}. " for n, v in zip(names, values)
        ]
        asked = rng.randrange(keys)
        question = (
            f"\nWhat is the special magic number for {names[asked]} mentioned in the provided "
            f"text? The special magic number for {names[asked]} mentioned in the provided text is"
        )
        answer = values[asked]
    else:
        raise ValueError(f"--task must be passkey or multikey. Received: --task {task!r}")
    fixed = _count(tokenizer, head + question) + sum(_count(tokenizer, n) for n in needles)
    per = max(_count(tokenizer, _FILLER), 1)
    sentences = max((length - fixed) // per, 1)
    filler = [_FILLER] * sentences
    # the (first) needle at the depth; multikey's others at random places
    spots = [min(sentences, round(depth * sentences))]
    spots += [rng.randrange(sentences + 1) for _ in needles[1:]]
    for spot, needle in sorted(zip(spots, needles), key=lambda p: p[0], reverse=True):
        filler.insert(spot, needle)
    return Trial(head + "".join(filler) + question, answer, depth, question)


def _count(tokenizer: Any, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


@dataclass
class Row:
    """One (task, length, policy, keep) cell of the grid; ``keep`` a fraction (float) or a
    token budget (int); ``correct`` the sum of the trials' scores (1 or 0 a passkey or
    multikey trial, RULER's string match, a share, a suite's)."""

    length: int
    policy: str
    keep: float | int
    task: str = ""
    correct: float = 0
    trials: int = 0
    answers: list[str] = field(default_factory=list)
    cache_mib: list[float] = field(default_factory=list)
    prefill_s: list[float] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        def median(values: list[float]) -> float | None:
            return statistics.median(values) if values else None

        return {
            "task": self.task,
            "length": self.length,
            "policy": self.policy,
            "keep": self.keep,
            "correct": self.correct,
            "trials": self.trials,
            "accuracy": self.correct / self.trials if self.trials else None,
            "cache_mib": median(self.cache_mib),
            "prefill_s": median(self.prefill_s),
            "step_ms": median(self.step_ms),
            "answers": self.answers,
        }


def run(options: KvOptions, *, say: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the grid of ``options``; returns what ``kv.json`` holds."""
    import torch

    from .. import _validation as V
    from .._extras import require

    folder = V.check_out_dir("--out", options.out)
    require("transformers", "hf", "multihead kv")
    from ..hf import loading

    model, tokenizer = loading.load_with_tokenizer(options.model)
    rng = random.Random(options.seed)
    rows: dict[tuple[str, int, str, float | int], Row] = {}
    tasks = _tasks_of(options)
    words = ruler.vocabulary_words(list(tokenizer.get_vocab())) if options.task == "ruler" else []
    count = functools.partial(_count, tokenizer)
    bar = _bar(len(tasks) * len(options.lengths) * options.trials)
    asked: list[tuple[str, int, Any]] = []  # (task, length, trial), for kvpress's side
    try:
        for task in tasks:
            for length in options.lengths:
                for t in range(options.trials):
                    depth = (t + 0.5) / options.trials
                    if options.task == "ruler":
                        trial: Trial | ruler.RulerTrial = ruler.make(
                            task, words, count, length, rng, depth
                        )
                    else:
                        trial = make_task(task, tokenizer, length, depth, rng, options.keys)
                    with torch.inference_mode():
                        _one_trial(model, tokenizer, trial, length, options, rows)
                    asked.append((task, length, trial))
                    bar(1)
    finally:
        bar(0, close=True)
    kvpress = None
    if options.kvpress_python is not None:
        del model  # its memory, before kvpress's interpreter loads its own copy
        kvpress = _kvpress(options, asked, rows, folder, say)
    result = _write(options, rows, folder, say)
    if kvpress is not None:
        result["kvpress"] = kvpress
        (folder / "kv.json").write_text(json.dumps(result, indent=2), encoding="utf-8")
    return result


def _kvpress(options: KvOptions, asked: list[tuple[str, int, Any]],
             rows: dict[tuple[str, int, str, float | int], Row], folder: Path,
             say: Callable[[str], None]) -> dict[str, Any]:  # fmt: skip
    """The same trials through kvpress's pipeline in ``--kvpress-python``'s interpreter
    (``kvpress_runner``, run as a script), scored as multihead's cells are: rows named
    ``kvpress:PRESS`` (``kvpress:none``: its full cache) added to ``rows``. kvpress compresses
    the context alone and asks the question after (query-agnostic) and applies the model's
    chat template; its rows are therefore compared with its own full cache first. Returns the
    versions and the presses that could not run, with their reasons.

    Raises:
        ValueError: the interpreter is missing, has no kvpress, or its run fails.
    """
    import subprocess
    import tempfile

    from ..sources import converted_folder, resolve

    python = Path(options.kvpress_python or "")
    if not python.is_file():
        raise ValueError(f"--kvpress-python names no file. Received: --kvpress-python {python}")
    where = resolve(options.model)
    model_folder = converted_folder(where) if where.gguf_file is not None else where.folder
    keeps = [k for k in options.keep if k < 1.0]
    request = {
        "model": str(model_folder), "presses": list(options.kvpress_presses), "keeps": keeps,
        "threads": None,
        "trials": [{"context": t.prompt[: len(t.prompt) - len(t.question)],
                    **_asking(t.question), "new_tokens": _new_tokens(options, t)}
                   for _, _, t in asked],
    }  # fmt: skip
    runner = Path(__file__).with_name("kvpress_runner.py")
    log = folder / "kvpress.log"  # the runner's stderr; its stdout (a line a cell) shows
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="multihead-kvpress-") as tmp:
        ask, answer = Path(tmp) / "request.json", Path(tmp) / "answer.json"
        ask.write_text(json.dumps(request), encoding="utf-8")
        say(f"multihead kv: {len(asked)} trials through kvpress in {python} (log: {log})")
        with open(log, "w", encoding="utf-8") as errors:
            code = subprocess.run([str(python), str(runner), str(ask), str(answer)],
                                  stderr=errors, check=False).returncode  # fmt: skip
        if code != 0 or not answer.is_file():
            lines = log.read_text(encoding="utf-8").strip().splitlines() or ["(no output)"]
            raise ValueError(
                f"kvpress's run in {python} failed (exit {code}): {lines[-1]}. "
                f"Received: --kvpress-python {python}"
            )
        found = json.loads(answer.read_text(encoding="utf-8"))
    for cell in found["rows"]:
        name, keep = f"kvpress:{cell['press']}", cell["keep"]
        for (task, length, trial), text, seconds in zip(asked, cell["answers"], cell["seconds"]):
            row = rows.setdefault((task, length, name, keep), Row(length, name, keep, task))
            row.trials += 1
            row.correct += _score(trial, text)
            row.answers.append(text)
            row.prefill_s.append(seconds)  # kvpress's whole answer: prefill and decoding
    for cell, reason in found["errors"].items():
        say(f"multihead kv: kvpress's {cell} did not run: {reason}")
    return {k: found[k] for k in ("kvpress", "transformers", "torch", "errors")}


def _asking(question: str) -> dict[str, str]:
    """A trial's question as kvpress's pipeline takes it: the question itself, and the start of
    the answer (``answer_prefix``), which the pipeline puts after the chat template's turn to
    answer. Each task's question ends in the start of its answer after "Answer:" or after its
    question mark ("... mentioned in the provided text? The special magic number ... is")."""
    cut = question.rfind("Answer:")
    if cut >= 0:
        return {"question": question[:cut].rstrip(), "answer_prefix": question[cut:]}
    mark = question.find("? ")
    if mark >= 0:
        return {"question": question[: mark + 1], "answer_prefix": question[mark + 2 :]}
    return {"question": question, "answer_prefix": ""}


def _new_tokens(options: KvOptions, trial: Any) -> int:
    return trial.new_tokens if isinstance(trial, ruler.RulerTrial) else _NEW_TOKENS[options.task]


def _tasks_of(options: KvOptions) -> tuple[str, ...]:
    """The tasks a run goes through: the suite's (``--tasks``) or the one ``--task``."""
    return options.tasks if options.task == "ruler" else (options.task,)


def _ids(tokenizer: Any, trial: Any, query_agnostic: bool) -> tuple[Any, Any]:
    """(what the prompt's pass runs, the question run after compression or None): the whole
    prompt by default; with ``query_agnostic`` the context alone, then the question's tokens
    (without special tokens)."""
    if not query_agnostic or not trial.question:
        return tokenizer(trial.prompt, return_tensors="pt")["input_ids"], None
    context = trial.prompt[: len(trial.prompt) - len(trial.question)]
    question = tokenizer(trial.question, add_special_tokens=False, return_tensors="pt")
    return tokenizer(context, return_tensors="pt")["input_ids"], question["input_ids"]


# what Reconstruction's second reading of the prompt follows (after KVzip's repeat request)
_REPEAT = "\n\nRepeat the text above exactly.\n"


def _repeat_ids(tokenizer: Any) -> Any:
    return tokenizer(_REPEAT, add_special_tokens=False, return_tensors="pt")["input_ids"]


def _score(trial: Any, text: str) -> float:
    """A trial's score: RULER's string match for a suite trial, else 1.0 where the answer is
    in the text."""
    if isinstance(trial, ruler.RulerTrial):
        return ruler.score(trial, text)
    return float(trial.answer in text)


def _bar(total: int) -> Callable[..., None]:
    """A tqdm bar over the trials on a terminal's stderr (nothing drawn otherwise)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return lambda n, close=False: None
    import sys

    bar = tqdm(total=total, desc="kv trials", unit="trial", file=sys.stderr, disable=None)

    def step(n: int, close: bool = False) -> None:
        bar.update(n)
        if close:
            bar.close()

    return step


def _prefill(model: Any, ids: Any, window: int, *, stats: bool = True
             ) -> tuple[Any, Any, dict[str, list[Any]]]:  # fmt: skip
    """The prompt on the full cache with every policy's scores: (logits of the last row, the
    cache, {"window_mass" | "key_mass" | "last": per layer (B, H, S)}). The prompt but its
    last token runs under ``capture(stats=[key_mass, window_mass])``, the last token under
    ``capture`` of its weights, one row: their sums are the scores of the whole prompt.
    ``stats=False``: the prompt alone, no scores."""
    import torch
    import transformers as tf

    from ..hf import capture

    cache = tf.DynamicCache()
    if not stats:
        out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1], cache, {}
    with capture(model, stats=["key_mass", "window_mass"], window=max(window - 1, 1)) as head:
        model(input_ids=ids[:, :-1], past_key_values=cache, use_cache=True, logits_to_keep=1)
    with capture(model) as tail:
        out = model(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True)
    scores: dict[str, list[Any]] = {"window_mass": [], "key_mass": [], "last": []}
    for layer in range(head.num_layers):
        last = tail.weights[layer][:, :, -1].double()  # (B, H, S)
        for name in ("window_mass", "key_mass"):
            early = head.stats[layer][name].double()
            if name == "window_mass" and window == 1:
                early = torch.zeros_like(early)
            scores[name].append(torch.nn.functional.pad(early, (0, 1)) + last)
        scores["last"].append(last)
    return out.logits[:, -1], cache, scores


def _one_trial(model: Any, tokenizer: Any, trial: Trial, length: int, options: KvOptions,
               rows: dict[tuple[str, int, str, float | int], Row]) -> None:  # fmt: skip
    """Prefill once; decode the answer with the full cache and with each policy and keep (with
    ``chunk``, each compressed cell runs its own prompt in chunks)."""
    from .. import kv

    ids, question = _ids(tokenizer, trial, options.query_agnostic)
    chunked = options.chunk is not None
    started = time.perf_counter()
    logits, cache, scores = _prefill(model, ids, _WINDOW, stats=not chunked)
    prefill = time.perf_counter() - started
    prompt_kv = [(layer.keys, layer.values) for layer in cache.layers]
    full_mib = sum(k.nbytes + v.nbytes for k, v in prompt_kv) / 2**20
    first = logits.argmax(-1)
    new = _new_tokens(options, trial)
    full_text, full_step = _decode(model, tokenizer, _cache_of(prompt_kv), first, new, None,
                                   question)  # fmt: skip
    full_ok = _score(trial, full_text)
    task = getattr(trial, "task", options.task)
    for keep in (*options.keep, *options.budget):
        for name in options.policies:
            row = rows.setdefault((task, length, name, keep), Row(length, name, keep, task))
            row.trials += 1
            if isinstance(keep, float) and keep >= 1.0:
                row.correct += full_ok
                row.prefill_s.append(prefill)
                row.cache_mib.append(full_mib)
                row.step_ms.append(full_step)
                row.answers.append(full_text)
                continue
            policy = kv.POLICIES[name](keep)
            if chunked:
                started = time.perf_counter()
                own, cut = _chunked_prefill(model, ids, policy, options.chunk)
                row.prefill_s.append(time.perf_counter() - started)
                row.cache_mib.append(_nbytes(cut) / 2**20)
                text, step = _decode(model, tokenizer, cut, own.argmax(-1), new, policy, question)
            elif policy.name == "reconstruction":  # its own second reading of the prompt
                from ..hf import compress_context

                started = time.perf_counter()
                cut = compress_context(model, ids, policy, repeat_ids=_repeat_ids(tokenizer))
                row.prefill_s.append(time.perf_counter() - started)
                row.cache_mib.append(_nbytes(cut) / 2**20)
                text, step = _decode(model, tokenizer, cut, first, new, policy, question)
            else:
                layered = _compressed(policy, prompt_kv, scores)
                row.prefill_s.append(prefill)
                row.cache_mib.append(sum(s.nbytes for s in layered) / 2**20)
                text, step = _decode(model, tokenizer, _cache_of(prompt_kv, layered), first, new,
                                     policy, question)  # fmt: skip
            row.correct += _score(trial, text)
            row.step_ms.append(step)
            row.answers.append(text)


def _chunked_prefill(model: Any, ids: Any, policy: Any, chunk: int) -> tuple[Any, Any]:
    """The prompt in chunks of ``chunk`` tokens under ``compress(chunk=)`` on a cache made from
    the model's config (a mixed model's sliding layers keep their window): (logits of the last
    row, the compressed cache)."""
    import transformers as tf

    from ..hf import compress

    cache = tf.DynamicCache(config=model.config)
    with compress(model, policy, chunk=chunk):
        out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1], cache


def _nbytes(cache: Any) -> int:
    """The bytes a transformers cache holds: kept keys and values of compressed layers, the
    window of sliding ones, everything else."""
    from ..hf.kv_cache import CompressedLayer

    total = 0
    for layer in cache.layers:
        if isinstance(layer, CompressedLayer) and layer.state is not None:
            total += layer.state.nbytes
        else:
            total += layer.keys.nbytes + layer.values.nbytes
    return total


def _compressed(policy: Any, prompt_kv: list[tuple[Any, Any]], scores: dict[str, list[Any]]):
    """Each layer's ``LayerState`` for ``policy`` from the shared prefill's scores."""
    import torch

    from ..kv import LayerState, grouped

    # TOVA ranks by the last row's attention, the others by the statistic they name
    stat = "last" if policy.name == "tova" else policy.prompt_stat
    states = []
    for layer, (keys, values) in enumerate(prompt_kv):
        kv_scores = None if stat is None else grouped(scores[stat][layer], keys.shape[1])
        valid = torch.ones(keys.shape[0], keys.shape[2], dtype=torch.bool)
        place = (layer, len(prompt_kv))
        states.append(LayerState.from_prompt(policy, keys, values, kv_scores, valid, place=place))
    return states


def _cache_of(prompt_kv: list[tuple[Any, Any]], states: list[Any] | None = None) -> Any:
    """A transformers cache holding the prompt: its full keys and values, or the compressed
    layers."""
    import transformers as tf

    from ..hf.kv_cache import CompressedLayer

    cache = tf.DynamicCache()
    if states is None:
        for index, (keys, values) in enumerate(prompt_kv):
            cache.update(keys, values, index)
        return cache
    cache.layers = [CompressedLayer(state, False) for state in states]
    return cache


def _decode(model: Any, tokenizer: Any, cache: Any, first: Any, new: int, policy: Any,
            question: Any = None) -> tuple[str, float]:  # fmt: skip
    """Greedy decoding of ``new`` tokens after ``first``: (the text, median ms per step). With
    ``question`` (its token ids), the question runs first on the (compressed) cache, under the
    policy as any later chunk does, and its last row gives the first token instead."""
    import contextlib

    from ..hf import compress

    times = []
    block = compress(model, policy) if policy is not None else contextlib.nullcontext()
    with block:
        if question is not None:
            out = model(input_ids=question, past_key_values=cache, use_cache=True)
            first = out.logits[:, -1].argmax(-1)
        tokens = [int(first[0])]
        token = first[:, None]
        for _ in range(new - 1):
            started = time.perf_counter()
            out = model(input_ids=token, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            times.append(time.perf_counter() - started)
            tokens.append(int(token[0, 0]))
    return tokenizer.decode(tokens), 1000 * statistics.median(times) if times else 0.0


def _write(options: KvOptions, rows: dict[tuple[str, int, str, float | int], Row], folder: Path,
           say: Callable[[str], None]) -> dict[str, Any]:  # fmt: skip
    """kv.json, kv.png and the printed table."""
    from .._machine import cpu_info

    summaries = [row.summary() for row in rows.values()]
    result = {
        "model": str(options.model),
        "task": options.task,
        "trials": options.trials,
        "seed": options.seed,
        "cpu": cpu_info()[0],
        "decoding": _DECODING,
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(options).items()},
        "query_agnostic": options.query_agnostic,
        "rows": summaries,
    }
    if options.task == "ruler":
        result["tasks"] = list(options.tasks)
        result["averages"] = _averages(summaries)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "kv.json").write_text(json.dumps(result, indent=2), encoding="utf-8")
    asked = "question after compression" if options.query_agnostic else "question in the prompt"
    say(f"{options.task}, {options.trials} trials per length, model {options.model}, {asked} "
        f"(CPU: {result['cpu']})")  # fmt: skip
    _table(options, summaries, say)
    say(f"ms/step: {_DECODING}")
    figure = _figure(options, summaries, folder / "kv.png")
    if figure is not None:
        say(f"wrote {folder / 'kv.json'} and {figure}")
    else:
        say(f"wrote {folder / 'kv.json'} (no figure: matplotlib is not installed)")
    return result


def _keep_label(keep: float | int) -> str:
    return f"{keep:.3f}" if isinstance(keep, float) else f"{keep}t"


def _table(options: KvOptions, summaries: list[dict[str, Any]], say: Callable[[str], None]) -> None:
    """The printed rows: one per cell; for the suite a task column, the score as RULER's
    string match in percent, and each (length, policy, keep)'s average over the tasks."""
    suite = options.task == "ruler"
    first = f"{'task':>16} " if suite else ""
    say(f"{first}{'length':>7} {'policy':>10} {'keep':>6} {'correct':>8} {'cache MiB':>10} "
        f"{'prefill s':>10} {'ms/step':>8}")  # fmt: skip
    for s in summaries:
        lead = f"{s['task']:>16} " if suite else ""
        correct = (
            f"{100 * s['accuracy']:>7.1f}%" if suite else f"{s['correct']:>4g}/{s['trials']:<3}"
        )
        say(f"{lead}{s['length']:>7} {s['policy']:>10} {_keep_label(s['keep']):>6} {correct} "
            f"{_num(s['cache_mib'], 10, 2)} {_num(s['prefill_s'], 10, 2)} "
            f"{_num(s['step_ms'], 8, 1)}")  # fmt: skip
    if suite:
        say(f"average over the {len(options.tasks)} tasks:")
        for a in _averages(summaries):
            say(f"{'':>16} {a['length']:>7} {a['policy']:>10} {_keep_label(a['keep']):>6} "
                f"{100 * a['accuracy']:>7.1f}%")  # fmt: skip


def _num(value: float | None, width: int, digits: int) -> str:
    """A table figure, or "-" where the cell has none (kvpress's rows: no cache bytes or ms
    per step; their seconds are the whole answer's)."""
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.{digits}f}"


def _averages(summaries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each (length, policy, keep)'s accuracy averaged over the tasks (each task's weight
    one), in the rows' order."""
    groups: dict[tuple[Any, ...], list[float]] = {}
    for s in summaries:
        groups.setdefault((s["length"], s["policy"], s["keep"]), []).append(s["accuracy"])
    return [
        {"length": length, "policy": policy, "keep": keep, "accuracy": statistics.fmean(v),
         "tasks": len(v)}
        for (length, policy, keep), v in groups.items()
    ]  # fmt: skip


def _figure(options: KvOptions, summaries: list[dict[str, Any]], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    panels = [(task, length) for task in _tasks_of(options) for length in options.lengths]
    fig, axes = _panels(plt, len(panels))
    for ax, (task, length) in zip(axes.flat, panels):
        _panel(ax, options, summaries, task, length)
    for row in axes:
        row[0].set_ylabel(f"accuracy ({options.trials} trials)")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _panel(ax: Any, options: KvOptions, summaries: list[dict[str, Any]], task: str,
           length: int) -> None:  # fmt: skip
    """One task and length: accuracy against keep, a line per policy (kvpress's rows too)."""
    for name in dict.fromkeys(s["policy"] for s in summaries):
        points = sorted(  # a token budget at the share of this length it keeps
            (_share(s["keep"], length), s["accuracy"]) for s in summaries
            if s["length"] == length and s["policy"] == name and s["task"] == task
        )  # fmt: skip
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ticks = sorted({_share(k, length) for k in (*options.keep, *options.budget)})
    ax.set_xticks(ticks, [f"{k:.3g}" for k in ticks])
    ax.set_ylim(-0.05, 1.05)
    ax.set_xlabel("keep (share of the prompt's keys; a budget as its share)")
    ax.set_title(f"{task}, {length} tokens")
    ax.grid(alpha=0.3)


def _panels(plt: Any, count: int) -> tuple[Any, Any]:
    """A figure of ``count`` panels, at most four a row (the unused ones hidden)."""
    columns = min(count, 4)
    grid_rows = -(-count // columns)
    fig, axes = plt.subplots(grid_rows, columns, figsize=(4.2 * columns, 3.4 * grid_rows),
                             squeeze=False)  # fmt: skip
    for ax in axes.flat[count:]:
        ax.set_visible(False)
    return fig, axes


def _share(keep: float | int, length: int) -> float:
    """A keep as a share of a ``length``-token prompt (a token budget divided by it)."""
    return keep if isinstance(keep, float) else min(keep / length, 1.0)
