"""RULER-style tasks for ``multihead kv --task ruler`` (after Hsieh et al. 2024, "RULER: What's
the real context size of your long-context language models?"), generated from a seed with no
data files.

Each task hides what the question needs in a haystack of about ``length`` tokens, counted by
the model's own tokenizer. The haystack is not repeated filler: its sentences are drawn from
the tokens of the tokenizer's own vocabulary that begin a word (``vocabulary_words``), so no
two stretches of it are alike and a needle cannot be told from the rest by repetition. The
tasks:

* ``niah_single``: one key with a 7-digit value, asked for;
* ``niah_multikey``: four keys with values, one asked for;
* ``niah_multivalue``: one key with four values, all asked for;
* ``niah_multiquery``: four keys with values, two asked for;
* ``vt``: variable tracking, a chain of four assignments from one number, every variable of
  the chain asked for;
* ``cwe``: common-word extraction, a numbered list of words in which ten appear often, the
  ten asked for;
* ``fwe``: frequent-word extraction, coded words drawn from a Zipf law, the three most
  frequent asked for;
* ``qa_2hop``: a question over two facts stated apart (a person's workplace, the workplace's
  city).

Answers are scored by string match as RULER scores them (its ``string_match_all``: the share
of the expected strings found in the output, case-insensitive; ``string_match_part`` for the
question over two facts: 1 if any expected string is found).
"""

from __future__ import annotations

import itertools
import random
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["TASKS", "RulerTrial", "make", "parse_tasks", "score", "vocabulary_words"]

TASKS = (
    "niah_single",
    "niah_multikey",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "cwe",
    "fwe",
    "qa_2hop",
)
# tokens each task's answer may take
_NEW_TOKENS = {
    "niah_single": 12,
    "niah_multikey": 12,
    "niah_multivalue": 40,
    "niah_multiquery": 28,
    "vt": 30,
    "cwe": 60,
    "fwe": 24,
    "qa_2hop": 8,
}
_HEAD = (
    "Some special magic numbers are hidden inside the following text. Make sure to memorize "
    "them. I will quiz you about them afterwards.\n"
)
_WORD = re.compile(r"^[a-z]{4,9}$")
# the markers tokenizers put before a word that follows a space (byte-level BPE, SentencePiece)
_SPACE = ("\u0120", "\u2581", " ")


@dataclass(frozen=True)
class RulerTrial:
    """One generated input: ``context`` (haystack and needles), ``question`` (appended after
    it), the expected strings ``answers``, the scoring ``metric`` ("all" or "part") and the
    tokens the answer may take."""

    task: str
    context: str
    question: str
    answers: tuple[str, ...]
    metric: str
    new_tokens: int
    depth: float

    @property
    def prompt(self) -> str:
        return self.context + self.question


def parse_tasks(text: str) -> tuple[str, ...]:
    """``"niah_single,vt"`` -> ("niah_single", "vt"); ``"all"`` -> every task."""
    names = tuple(p.strip().lower() for p in str(text).split(",") if p.strip())
    if names == ("all",):
        return TASKS
    unknown = [n for n in names if n not in TASKS]
    if not names or unknown or len(set(names)) != len(names):
        raise ValueError(
            f"--tasks takes distinct names from {', '.join(TASKS)} (or 'all'). "
            f"Received: --tasks {text}"
        )
    return names


def vocabulary_words(vocabulary: Sequence[str], least: int = 200) -> list[str]:
    """The tokens of 4 to 9 lowercase letters that begin a word (marked as following a space)
    in a tokenizer's vocabulary, sorted: the haystack's and the word tasks' material.

    Raises:
        ValueError: fewer than ``least`` such words (a vocabulary without whole words).
    """
    words = sorted({t[1:] for t in vocabulary if t[:1] in _SPACE and _WORD.match(t[1:])})
    if len(words) < least:
        raise ValueError(
            f"the tokenizer's vocabulary holds {len(words)} whole lowercase words; the RULER "
            f"tasks need at least {least} to build their text. Received: a vocabulary of "
            f"{len(vocabulary)} tokens"
        )
    return words


def score(trial: RulerTrial, text: str) -> float:
    """RULER's string match: the share of ``answers`` found in ``text`` ("all"), or 1.0 if any
    is found ("part"); case-insensitive."""
    found = [a.lower() in text.lower() for a in trial.answers]
    if trial.metric == "part":
        return float(any(found))
    return sum(found) / len(found)


def make(
    task: str,
    words: Sequence[str],
    count: Callable[[str], int],
    length: int,
    rng: random.Random,
    depth: float,
) -> RulerTrial:
    """A ``task`` input of about ``length`` tokens (``count`` counts a text's tokens), its
    first needle at ``depth`` (0: start, 1: end) and the others at random places.

    Raises:
        ValueError: an unknown task.
    """
    if task not in TASKS:
        raise ValueError(f"the RULER tasks are {', '.join(TASKS)}. Received: task={task!r}")
    if task in ("cwe", "fwe"):
        context, question, answers = _WORD_TASKS[task](words, count, length, rng)
        return RulerTrial(task, context, question, answers, "all", _NEW_TOKENS[task], depth)
    needles, question, answers, metric = _NEEDLES[task](words, rng)
    fixed = count(_HEAD + question) + sum(count(n) for n in needles)
    sentences = _haystack(words, count, max(length - fixed, 8), rng)
    spots = [min(len(sentences), round(depth * len(sentences)))]
    spots += [rng.randrange(len(sentences) + 1) for _ in needles[1:]]
    for spot, needle in sorted(zip(spots, needles), key=lambda p: p[0], reverse=True):
        sentences.insert(spot, needle)
    context = _HEAD + " ".join(sentences)
    return RulerTrial(task, context, question, answers, metric, _NEW_TOKENS[task], depth)


def _haystack(words: Sequence[str], count: Callable[[str], int], tokens: int,
              rng: random.Random) -> list[str]:  # fmt: skip
    """Sentences of 6 to 12 vocabulary words, as many as ``tokens`` tokens hold (each counted
    on its own)."""
    sentences, used = [], 0
    while True:
        chosen = rng.choices(words, k=rng.randint(6, 12))
        text = chosen[0].capitalize() + " " + " ".join(chosen[1:]) + "."
        cost = count(" " + text)
        if used + cost > tokens and sentences:
            return sentences
        sentences.append(text)
        used += cost


def _number(rng: random.Random) -> str:
    return str(rng.randrange(1_000_000, 10_000_000))


def _keys(words: Sequence[str], rng: random.Random, n: int) -> list[str]:
    return [f"{a}-{b}" for a, b in zip(rng.sample(list(words), n), rng.sample(list(words), n))]


def _needle(key: str, value: str) -> str:
    return f"One of the special magic numbers for {key} is: {value}."


def _asked(keys: Sequence[str], plural: bool) -> str:
    names = " and ".join(keys)
    if plural:
        return (
            f"\nWhat are all the special magic numbers for {names} mentioned in the provided "
            f"text? The special magic numbers for {names} mentioned in the provided text are"
        )
    return (
        f"\nWhat is the special magic number for {names} mentioned in the provided text? The "
        f"special magic number for {names} mentioned in the provided text is"
    )


def _niah_single(words, rng):
    key, value = _keys(words, rng, 1)[0], _number(rng)
    return [_needle(key, value)], _asked([key], False), (value,), "all"


def _niah_multikey(words, rng):
    keys, values = _keys(words, rng, 4), [_number(rng) for _ in range(4)]
    asked = rng.randrange(4)
    needles = [_needle(k, v) for k, v in zip(keys, values)]
    return needles, _asked([keys[asked]], False), (values[asked],), "all"


def _niah_multivalue(words, rng):
    key, values = _keys(words, rng, 1)[0], [_number(rng) for _ in range(4)]
    return [_needle(key, v) for v in values], _asked([key], True), tuple(values), "all"


def _niah_multiquery(words, rng):
    keys, values = _keys(words, rng, 4), [_number(rng) for _ in range(4)]
    asked = sorted(rng.sample(range(4), 2))
    needles = [_needle(k, v) for k, v in zip(keys, values)]
    return needles, _asked([keys[i] for i in asked], True), tuple(values[i] for i in asked), "all"


def _vt(words, rng):
    letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    names: list[str] = []
    while len(names) < 4:
        name = "".join(rng.choices(letters, k=5))
        if name not in names:
            names.append(name)
    value = str(rng.randrange(10_000, 100_000))
    needles = [f"VAR {names[0]} = {value}."]
    needles += [f"VAR {b} = VAR {a}." for a, b in itertools.pairwise(names)]
    question = (
        f"\nFind all variables that are assigned the value {value} in the text above. Answer: "
        f"According to the chain of variable assignments in the text above, 4 variables are "
        f"assigned the value {value}, they are:"
    )
    return needles, question, tuple(names), "all"


def _qa_2hop(words, rng):
    person = " ".join(w.capitalize() for w in rng.sample(list(words), 2))
    place, city = rng.sample(list(words), 2)
    needles = [
        f"{person} works at the {place} office.",
        f"The {place} office is in the city of {city.capitalize()}.",
    ]
    question = (
        f"\nQuestion: In which city does {person} work? Answer: {person} works in the city of"
    )
    return needles, question, (city.capitalize(),), "part"


_NEEDLES = {
    "niah_single": _niah_single,
    "niah_multikey": _niah_multikey,
    "niah_multivalue": _niah_multivalue,
    "niah_multiquery": _niah_multiquery,
    "vt": _vt,
    "qa_2hop": _qa_2hop,
}


def _cwe(words, count, length, rng):
    """Ten common words 30 times each among words that appear 3 times (RULER's cwe: freq_cw
    30, freq_ucw 3, num_cw 10), as many rare ones as ``length`` holds (fewer repeats of the
    common ones where it holds less)."""
    chosen = rng.sample(list(words), min(len(words), 400))
    common, rare = chosen[:10], chosen[10:]
    question = (
        "\nWhat are the 10 most common words in the above list? Answer: The top 10 words that "
        "appear most often in the list are:"
    )
    head = "Below is a numbered list of words. In these words, some appear more often than "
    head += "others. Memorize the ones that appear most often.\n"
    sample = " ".join(f"{100 + i}. {w}" for i, w in enumerate(chosen[:40]))
    per = max(count(sample) / 40, 1.0)  # tokens of one numbered entry
    room = max(int((length - count(head + question)) / per), 60)
    # RULER's frequencies where the length holds them; shorter lists keep the common words
    # at half of the entries
    often = max(3, min(30, room // 20))
    items = common * often + rare[: max((room - 10 * often) // 3, 1)] * 3
    rng.shuffle(items)
    text = head + " ".join(f"{i + 1}. {w}" for i, w in enumerate(items))
    return text, question, tuple(common)


def _fwe(words, count, length, rng):
    """Coded words (a vocabulary word each) drawn from a Zipf law of exponent 2 (RULER's fwe
    uses alpha 2.0); the three most frequent asked for (ties broken by the draw)."""
    coded = rng.sample(list(words), min(len(words), 200))
    weights = [1.0 / (rank + 1) ** 2 for rank in range(len(coded))]
    question = (
        "\nQuestion: What are the three most frequently appeared coded words in the above "
        "coded text? Answer: According to the coded text above, the three most frequently "
        "appeared words are:"
    )
    head = "Read the following coded text and track the frequency of each coded word. Find "
    head += "the three most frequently appeared coded words.\n"
    per = max(count(" ".join(coded[:40])) / 40, 1.0)
    n = max(int((length - count(head + question)) / per), 50)
    drawn = rng.choices(coded, weights=weights, k=n)
    top = [w for w, _ in Counter(drawn).most_common(3)]
    return head + " ".join(drawn) + " ...", question, tuple(top)


_WORD_TASKS = {"cwe": _cwe, "fwe": _fwe}
