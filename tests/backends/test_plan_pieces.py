"""The work list asks the mask which key blocks of a tile are empty or fully visible
(``Mask.rect_kind``) and evaluates only the others: the plan is the one that evaluating every
block gives, and a band's tile evaluates its diagonal alone, not every key it sees."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from multihead import masks
from multihead.backends import _plan
from multihead.masks import TileKind


def _unsure(mask: masks.Mask) -> masks.Mask:
    """The same mask answering "cannot tell" for every rectangle (allowed by ``rect_kind``'s
    contract): the plan then evaluates every key block of every tile."""
    mask.rect_kind = lambda *args, **kwargs: TileKind.PARTIAL  # type: ignore[method-assign]
    return mask


def _assert_same(mine: list[_plan.Item], theirs: list[_plan.Item]) -> None:
    assert len(mine) == len(theirs)
    for a, b in zip(mine, theirs, strict=True):
        assert (a.batch, a.q0, a.q1, a.stack) == (b.batch, b.q0, b.q1, b.stack)
        assert [(c.start, c.stop, c.pattern) for c in a.chunks] == [
            (c.start, c.stop, c.pattern) for c in b.chunks
        ]
        for c, d in zip(a.chunks, b.chunks, strict=True):
            for field in ("keep", "live", "seen"):
                x, y = getattr(c, field), getattr(d, field)
                assert (x is None) == (y is None), field
                if x is not None:
                    assert x.shape == y.shape, field
                    assert torch.equal(x, y), field


def _mask(kind: str, length_q: int, length_k: int, batch: int, seed: int) -> masks.Mask:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, length_k + 1, (batch,), generator=g)
    padding = torch.rand(batch, length_k, generator=g) > 0.3
    made = {
        "causal": lambda: masks.causal(),
        "causal top-left": lambda: masks.causal(align="top_left"),
        "window": lambda: masks.sliding_window(int(lens[0]) // 2 + 1, seed % 7),
        "window & lengths": lambda: masks.sliding_window(40) & masks.lengths(lens),
        "causal & padding": lambda: masks.causal() & masks.key_padding(padding),
        "padding": lambda: masks.key_padding(padding),
        "causal & knockout": lambda: (
            masks.causal() & masks.knockout([1, 5, 40, 41], [0, 3, 7], heads=[1], num_heads=2)
        ),
        "documents": lambda: (
            masks.documents(
                torch.sort(torch.randint(0, 4, (batch, length_k), generator=g), dim=1).values
            )
            & masks.causal()
        ),
        "predicate": lambda: masks.predicate(lambda b, h, q, k: (k <= q) & (k >= q - 50)),
        "dense": lambda: masks.dense(torch.rand(batch, 2, length_q, length_k, generator=g) > 0.5),
    }
    return made[kind]()


KINDS = [
    "causal", "causal top-left", "window", "window & lengths", "causal & padding", "padding",
    "causal & knockout", "documents", "predicate", "dense",
]  # fmt: skip


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    kind=st.sampled_from(KINDS),
    length_q=st.integers(1, 700),
    extra=st.integers(-300, 300),
    batch=st.integers(1, 2),
    tile=st.sampled_from([32, 64, 256]),
    seed=st.integers(0, 100),
)
def test_the_plan_is_the_one_evaluating_every_block_gives(kind, length_q, extra, batch, tile, seed):
    length_k = max(1, length_q + extra)
    if kind == "documents":
        length_k = length_q
    mine = _mask(kind, length_q, length_k, batch, seed)
    theirs = _unsure(_mask(kind, length_q, length_k, batch, seed))
    _assert_same(
        _plan._plan(mine, batch, length_q, length_k, tile, "cpu"),
        _plan._plan(theirs, batch, length_q, length_k, tile, "cpu"),
    )


@pytest.mark.parametrize("mask", [masks.causal(), masks.sliding_window(1000)])
def test_a_band_evaluates_its_diagonal_blocks_alone(mask, monkeypatch):
    length, tile = 4096, 256
    evaluated = []
    block = type(mask).block

    def counted(self, *args, **kwargs):
        found = block(self, *args, **kwargs)
        evaluated.append(found.numel())
        return found

    monkeypatch.setattr(type(mask), "block", counted)
    items = _plan._plan(mask, 1, length, length, tile, "cpu")
    monkeypatch.undo()
    # per tile: its diagonal square, and for the window the one or two squares its band's
    # first key crosses (plus a two-entry probe); evaluating whole tiles would read every key
    # a tile sees (8.9 million entries for causal, 5.1 million for the window)
    assert sum(evaluated) <= (length // tile) * (3 * tile * tile + 2)
    seen = torch.zeros(length, length, dtype=torch.bool)
    for item in items:
        for c in item.chunks:
            part = seen[item.q0 : item.q1, c.start : c.stop]
            part |= True if c.keep is None else c.keep[0, 0]
    assert torch.equal(seen, mask.to_dense(length, length)[0, 0])
