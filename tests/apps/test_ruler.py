"""The RULER-style suite of ``multihead kv --task ruler`` (``multihead.apps.ruler``): each task
holds what its question needs at about the length asked, from a seed; answers are scored by
RULER's string match."""

from __future__ import annotations

import itertools
import random
import re
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from multihead.apps import ruler

# a vocabulary as byte-level BPE marks it: words after a space carry "Ġ"
NAMED = [
    "amber", "basil", "cedar", "delta", "ember", "fjord", "granite", "harbor", "indigo",
    "juniper", "kettle", "lantern", "meadow", "nickel", "orchid", "pepper", "quartz", "raven",
    "saffron", "timber", "umber", "velvet", "willow", "yonder", "zephyr", "anchor", "bottle",
    "candle", "desert", "engine", "forest", "garden", "hammer", "island", "jacket", "ladder",
]  # fmt: skip
# and 400 made-up words of five letters, so that the word tasks have words enough
_GEN = random.Random(0)
WORDS = sorted(set(NAMED) | {"".join(_GEN.choices("abcdefghijklmnopqrstuvwxyz", k=5))
                             for _ in range(400)})  # fmt: skip


def count(text: str) -> int:
    """A stand-in tokenizer: a token per word, number or punctuation mark."""
    return len(re.findall(r"\w+|[^\w\s]", text))


def vocabulary() -> list[str]:
    return ["\u0120" + w for w in WORDS] + ["the", "\u0120A", "\u01201234", "ing"]


def test_vocabulary_words_are_the_lowercase_tokens_that_begin_a_word():
    words = ruler.vocabulary_words(vocabulary(), least=10)
    assert words == WORDS
    spm = ruler.vocabulary_words(["\u2581" + w for w in WORDS], least=10)
    assert spm == words
    with pytest.raises(ValueError, match=r"holds 0 whole lowercase words.*at least 200"):
        ruler.vocabulary_words(["a", "b", "\u0120A"])


def test_tasks_by_name():
    assert ruler.parse_tasks("all") == ruler.TASKS and len(ruler.TASKS) == 8
    assert ruler.parse_tasks("vt, CWE") == ("vt", "cwe")
    for bad in ("", "niah", "vt,vt"):
        with pytest.raises(ValueError, match="--tasks takes distinct names from niah_single"):
            ruler.parse_tasks(bad)
    with pytest.raises(ValueError, match="Received: task='nope'"):
        ruler.make("nope", WORDS, count, 500, random.Random(0), 0.5)


def _trial(answers, metric="all"):
    return ruler.RulerTrial("t", "context", "?", tuple(answers), metric, 8, 0.5)


def test_scores_are_rulers_string_match():
    four = _trial(["1234567", "Amber", "x9", "q"])
    # string_match_all: the share of the references found, case-insensitive
    assert ruler.score(four, "... 1234567 and amber ...") == 0.5
    assert ruler.score(four, "") == 0.0
    assert ruler.score(four, "1234567 AMBER x9 Q") == 1.0
    # string_match_part: any reference found
    part = _trial(["Paris", "Lyon"], "part")
    assert ruler.score(part, "in lyon") == 1.0 and ruler.score(part, "in Nice") == 0.0


@settings(derandomize=True, max_examples=60, deadline=None)
@given(
    task=st.sampled_from(ruler.TASKS),
    length=st.sampled_from([600, 1500, 4000]),
    seed=st.integers(0, 10_000),
    depth=st.floats(0.0, 1.0),
)
def test_each_task_holds_its_answers_at_about_its_length(task, length, seed, depth):
    trial = ruler.make(task, WORDS, count, length, random.Random(seed), depth)
    again = ruler.make(task, WORDS, count, length, random.Random(seed), depth)
    assert trial == again  # from the seed alone
    assert trial.task == task and trial.prompt == trial.context + trial.question
    # the haystack's sentences are whole; the count comes out within 15% under the length
    assert 0.85 * length <= count(trial.prompt) <= 1.02 * length
    assert trial.answers and trial.new_tokens > 0
    if task == "cwe":
        entries = Counter(re.findall(r"\d+\. ([a-z]+)", trial.context))
        least_common = min(entries[w] for w in trial.answers)
        assert len(trial.answers) == 10
        assert all(n < least_common for w, n in entries.items() if w not in trial.answers)
    elif task == "fwe":
        drawn = Counter(trial.context.split("\n", 1)[1].split()[:-1])
        assert [w for w, _ in drawn.most_common(3)] == list(trial.answers)
    else:
        for answer in trial.answers:  # in the context, not given away by the question
            assert answer in trial.context
            assert task == "vt" or answer.lower() not in trial.question.lower()
    if task.startswith("niah"):
        asked = {"niah_single": 1, "niah_multikey": 1, "niah_multivalue": 4, "niah_multiquery": 2}
        assert len(trial.answers) == asked[task]
        needles = trial.context.count("One of the special magic numbers for")
        assert needles == {"niah_single": 1}.get(task, 4)
    if task == "vt":  # a chain: the first is assigned the number, each next the one before
        names = trial.answers
        value = re.search(r"VAR " + names[0] + r" = (\d+)\.", trial.context).group(1)
        assert f"the value {value}" in trial.question
        for a, b in itertools.pairwise(names):
            assert f"VAR {b} = VAR {a}." in trial.context
    if task == "qa_2hop":
        city = trial.answers[0]
        person = re.search(r"does (.+) work\?", trial.question).group(1)
        place = re.search(re.escape(person) + r" works at the (\w+) office", trial.context)
        assert place and f"The {place.group(1)} office is in the city of {city}." in trial.context


def test_depth_places_the_first_needle():
    spots = []
    for depth in (0.05, 0.5, 0.95):
        trial = ruler.make("niah_single", WORDS, count, 3000, random.Random(5), depth)
        spots.append(trial.context.index("One of the special magic") / len(trial.context))
    assert spots == sorted(spots) and spots[0] < 0.15 and spots[2] > 0.85
