"""Deterministic English-like sentences for throughput runs and tests (no data files needed)."""

from __future__ import annotations

import random

__all__ = ["sentences"]

_VOCAB = (
    "the a an this that some every no one two three many few cat dog mouse animal street house "
    "river city school teacher child friend doctor market window garden road car train book "
    "letter question answer idea reason story morning night winter summer rain sun wind light "
    "water food music paper money time year day week people family country world problem "
    "crossed saw found took gave made said asked told thought knew wanted needed liked moved "
    "opened closed wrote read built broke carried followed watched heard became remained "
    "quickly slowly quietly carefully suddenly often never always almost perhaps together again "
    "small large old new young long short tired happy busy quiet bright dark warm cold heavy "
    "because although while when after before since until and but or so if then it he she "
    "they we you I them her him his their our its in on at over under through across between "
    "with without from into near behind beyond during"
)
_WORDS = _VOCAB.split()
_PUNCT = (",", ",", ";", "")


def sentences(count: int, *, min_words: int = 3, max_words: int = 200, seed: int = 0) -> list[str]:
    """``count`` sentences with a uniform random number of words in [min_words, max_words]."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        n = rng.randint(min_words, max_words)
        words = []
        for i in range(n):
            word = rng.choice(_WORDS)
            if i and rng.random() < 0.08:
                word = rng.choice(_PUNCT) + " " + word if words else word
            words.append(word)
        text = " ".join(words).replace(" ,", ",").replace(" ;", ";")
        out.append(text[0].upper() + text[1:] + rng.choice((".", ".", "?", "!")))
    return out
