"""``Mask.rows_alike``: the masks that show every query row the same keys for any number of
rows (so a call may stack more rows under them), and only those."""

from __future__ import annotations

import pytest
import torch

from multihead import masks

S = 11


def _keep(batch: int = 3) -> torch.Tensor:
    keep = torch.ones(batch, S, dtype=torch.bool)
    keep[1, :4], keep[2, 7:] = False, False
    return keep


ALIKE = {
    "key_padding": lambda: masks.key_padding(_keep()),
    "lengths": lambda: masks.lengths(torch.tensor([3, 11, 0])),
    "padding & lengths": lambda: (
        masks.key_padding(_keep()) & masks.lengths(torch.tensor([9, 5, 2]))
    ),
    "padding | padding": lambda: masks.key_padding(_keep()) | masks.key_padding(_keep().flip(1)),
}
NOT_ALIKE = {
    "causal": masks.causal,
    "sliding window": lambda: masks.sliding_window(2),
    "padding & causal": lambda: masks.key_padding(_keep()) & masks.causal(),
    "per-query lengths": lambda: masks.lengths(torch.tensor([[3, 4, 5], [1, 2, 3], [0, 0, 1]])),
    "query lengths": lambda: masks.lengths(torch.tensor([3, 11, 0]), torch.tensor([1, 2, 3])),
    "dense": lambda: masks.dense(torch.ones(3, 1, 1, S, dtype=torch.bool)),
    "predicate": lambda: masks.predicate(lambda b, h, q, k: k <= q + 5),
}


@pytest.mark.parametrize("make", ALIKE.values(), ids=ALIKE.keys())
def test_rows_alike_masks_show_every_row_the_same_keys_at_any_length(make):
    mask = make()
    assert mask.rows_alike
    one = mask.to_dense(1, S).expand(3, 1, 1, S)
    for length in (1, 3, 7):
        mask.check(3, 2, length, S)  # any number of rows is accepted
        many = mask.to_dense(length, S).expand(3, 1, length, S)
        assert torch.equal(many, one.expand(3, 1, length, S))


@pytest.mark.parametrize("make", NOT_ALIKE.values(), ids=NOT_ALIKE.keys())
def test_other_masks_do_not_claim_it(make):
    assert not make().rows_alike
