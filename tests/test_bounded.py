"""``multihead._cache.Bounded``: the one table type for what the package remembers."""

from __future__ import annotations

import pytest

from multihead._cache import Bounded


def test_storing_past_maxsize_forgets_the_least_recently_used():
    table: Bounded[str, int] = Bounded(3)
    for i, key in enumerate("abc"):
        table[key] = i
    assert table.get("a") == 0  # a read makes "a" the most recently used: "b" is the oldest
    table["d"] = 3
    assert list(table) == ["c", "a", "d"] and "b" not in table
    assert table["c"] == 2  # [] is a use too
    table["e"] = 4
    assert list(table) == ["d", "c", "e"]
    table["d"] = 5  # storing again is a use
    table["f"] = 6
    assert list(table) == ["e", "d", "f"] and table.values() == [4, 5, 6]
    assert len(table) == 3


def test_make_keeps_what_it_made_and_none_is_a_value():
    table: Bounded[int, int | None] = Bounded(2)
    made: list[int] = []

    def make(n: int):
        made.append(n)
        return None if n == 1 else n * 10

    assert table.make(1, lambda: make(1)) is None
    assert table.make(1, lambda: make(1)) is None  # kept, even though it is None
    assert table.make(2, lambda: make(2)) == 20
    assert table.make(1, lambda: make(1)) is None  # a use: 2 is now the oldest
    assert table.make(3, lambda: make(3)) == 30
    assert made == [1, 2, 3] and list(table) == [1, 3]
    assert table.get(2, -1) == -1 and table.get(2) is None


def test_delete_and_clear():
    table: Bounded[str, int] = Bounded(4)
    table["a"], table["b"] = 1, 2
    del table["a"]
    assert list(table) == ["b"]
    with pytest.raises(KeyError):
        table["a"]
    table.clear()
    assert len(table) == 0 and repr(table) == "Bounded(maxsize=4, 0 entries)"


def test_a_table_holds_at_least_one_entry():
    with pytest.raises(ValueError, match=r"at least 1 entry. Received: maxsize=0"):
        Bounded(0)
