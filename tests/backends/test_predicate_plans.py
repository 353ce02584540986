"""A predicate mask costs what the built-in kind it describes costs: its work list is made
once per shape and kept on the mask (as its tile answers are), and it reads no more keys than
the built-in's."""

from __future__ import annotations

import pytest
import torch

import multihead as mh
from multihead import masks
from multihead.backends import _plan, fused

L = 1024


def _area(items) -> int:
    """(query, key) pairs the work list makes a kernel read."""
    return sum((i.q1 - i.q0) * (c.stop - c.start) for i in items for c in i.chunks)


def _visible(items, length_q: int, length_k: int) -> torch.Tensor:
    """The (L, S) pairs the work list marks visible (its keep blocks, or all of a chunk)."""
    seen = torch.zeros(length_q, length_k, dtype=torch.bool)
    for item in items:
        for c in item.chunks:
            block = torch.ones(item.q1 - item.q0, c.stop - c.start, dtype=torch.bool)
            if c.keep is not None:
                block = c.keep[0, 0].expand_as(block)
            seen[item.q0 : item.q1, c.start : c.stop] |= block
    return seen


def _documents() -> tuple[masks.Mask, masks.Mask]:
    ids = torch.tensor([[0] * 300 + [1] * 500 + [2] * 224])
    predicate = masks.predicate(
        lambda b, h, q, k: (ids[b, q] == ids[b, k]) & (k <= q), batch_size=1
    )
    return predicate, masks.documents(ids) & masks.causal()


CASES = {
    "band": lambda: (
        masks.predicate(lambda b, h, q, k: (k <= q) & (k >= q - 256)),
        masks.sliding_window(256),
    ),
    "causal": lambda: (masks.predicate(lambda b, h, q, k: k <= q), masks.causal()),
    "causal documents": _documents,
}


@pytest.mark.parametrize("tile", [64, 256])
@pytest.mark.parametrize("case", list(CASES))
def test_a_predicate_reads_no_more_than_the_built_in(case, tile):
    predicate, built_in = CASES[case]()
    mine = _plan.plan(predicate, 1, L, L, tile, "cpu")
    theirs = _plan.plan(built_in, 1, L, L, tile, "cpu")
    assert torch.equal(_visible(mine, L, L), _visible(theirs, L, L))
    assert torch.equal(_visible(mine, L, L), built_in.to_dense(L, L)[0, 0])
    assert _area(mine) <= _area(theirs)


def test_a_predicate_is_planned_once_per_shape():
    calls = []

    def band(b, h, q, k):
        calls.append(1)
        return (k <= q) & (k >= q - 64)

    mask = masks.predicate(band)
    q, k, v = (torch.randn(1, 2, 600, 16) for _ in range(3))
    first = mh.attention(q, k, v, mask, backend="fused")
    made = len(calls)
    again = mh.attention(q, k, v, mask, backend="fused")
    assert len(calls) == made  # the kept plan: the predicate is not evaluated again
    assert torch.equal(first, again)
    want = mh.attention(q, k, v, masks.sliding_window(64), backend="reference")
    torch.testing.assert_close(again, want, rtol=1e-5, atol=1e-6)
    mh.attention(q[:, :, :300], k[:, :, :300], v[:, :, :300], mask, backend="fused")
    assert len(calls) > made  # another shape: planned for it


def test_a_band_predicate_gets_the_built_in_query_tiles():
    """The kernel's query tiles: a band's built-in states its width, a predicate does not,
    so the kernel reads the widths of a few rows and takes the same tiles (a quarter of the
    band), and the same work list, row for row. A predicate whose rows see most keys keeps
    the default tiles."""
    from multihead.backends.call import prepare

    length = 4096
    q, k, v = (torch.randn(1, 1, length, 8) for _ in range(3))
    band = masks.predicate(lambda b, h, q, k: (k <= q) & (k >= q - 256))
    built_in = masks.sliding_window(256)
    calls = [prepare(q, k, v, m, None, None, 0.0, False) for m in (band, built_in)]
    tiles = [fused._query_tile(c) for c in calls]
    assert tiles == [64, 64]
    mine, theirs = (_plan.plan(m, 1, length, length, 64, "cpu") for m in (band, built_in))
    assert [(i.q0, i.q1) for i in mine] == [(i.q0, i.q1) for i in theirs]
    assert _area(mine) <= _area(theirs)
    causal = masks.predicate(lambda b, h, q, k: k <= q)
    call = prepare(q, k, v, causal, None, None, 0.0, False)
    assert fused._query_tile(call) == fused._query_tile(
        prepare(q, k, v, masks.causal(), None, None, 0.0, False)
    )


pytestmark = pytest.mark.skipif(
    fused.build_error() is not None, reason=f"fused kernel not built: {fused.build_error()}"
)
