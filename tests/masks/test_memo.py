"""``Mask.memo``: state derived from a mask lives on the mask, bounded per namespace, and is
collected with it."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from multihead import masks
from multihead.backends import _plan


def _predicate():
    return masks.predicate(lambda b, h, q, k: (q - k) % 3 != 1)


def test_a_namespace_keeps_its_most_recently_used_entries():
    mask = masks.causal()
    table = mask.memo("test", 2)
    assert mask.memo("test", 2) is table and mask.memo("other", 2) is not table
    table["a"], table["b"] = 1, 2
    assert table.get("a") == 1
    table["c"] = 3
    assert list(mask.memo("test", 2)) == ["a", "c"]
    assert len(mask.memo("other", 2)) == 0  # namespaces do not share entries or bounds
    assert len(masks.causal().memo("test", 2)) == 0  # nor do masks


def test_a_namespace_has_one_size():
    mask = masks.causal()
    mask.memo("test", 2)
    with pytest.raises(ValueError, match=r"'test' of this mask holds 2 entries.*Received: size=3"):
        mask.memo("test", 3)


def test_the_memo_dies_with_its_mask_even_when_a_value_refers_to_it():
    mask = _predicate()
    table = mask.memo("test", 4)
    table["self"] = mask  # a cycle: mask -> memo -> mask
    table["plan"] = _plan.plan(mask, 1, 9, 9, 4, torch.device("cpu"))
    mask_alive, table_alive = weakref.ref(mask), weakref.ref(table)
    del mask, table
    gc.collect()
    assert mask_alive() is None and table_alive() is None


def test_plans_and_summaries_are_kept_in_the_memo_within_their_bounds():
    mask = _predicate()
    for length in range(5, 5 + _plan.KEPT_ON_MASK + 2):
        first = _plan.plan(mask, 1, length, length, 4, torch.device("cpu"))
        assert _plan.plan(mask, 1, length, length, 4, torch.device("cpu")) is first  # kept
    plans = mask.memo("plans", _plan.KEPT_ON_MASK)
    assert len(plans) == _plan.KEPT_ON_MASK  # the oldest shapes were forgotten
    assert [key[1] for key in plans] == list(range(7, 11))
    summaries = mask.memo("summaries", 8)
    assert 0 < len(summaries) <= 8
