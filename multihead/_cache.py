"""``Bounded``: the one table type for what the package remembers, process-wide or on a mask
(``Mask.memo``): at most ``maxsize`` entries, the least recently used forgotten first."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

__all__ = ["Bounded"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

_MISSING = object()


class Bounded(Generic[K, V]):
    """A table of at most ``maxsize`` entries. Reading an entry (``get``, ``[]``, ``make``)
    makes it the most recently used; storing one past ``maxsize`` forgets the least recently
    used. Stored values may be None.

    Raises:
        ValueError: ``maxsize`` below 1.
    """

    __slots__ = ("__weakref__", "_entries", "maxsize")

    def __init__(self, maxsize: int) -> None:
        if maxsize < 1:
            raise ValueError(f"a Bounded table holds at least 1 entry. Received: maxsize={maxsize}")
        self.maxsize = maxsize
        self._entries: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K, default: V | None = None) -> V | None:
        """The value kept under ``key`` (now the most recently used), else ``default``."""
        value = self._entries.get(key, _MISSING)
        if value is _MISSING:
            return default
        self._entries.move_to_end(key)
        return value  # type: ignore[return-value]

    def make(self, key: K, make: Callable[[], V]) -> V:
        """The value kept under ``key``; made by ``make()`` and kept when there is none."""
        value = self._entries.get(key, _MISSING)
        if value is _MISSING:
            value = self[key] = make()
            return value
        self._entries.move_to_end(key)
        return value  # type: ignore[return-value]

    def __getitem__(self, key: K) -> V:
        value = self._entries[key]
        self._entries.move_to_end(key)
        return value

    def __setitem__(self, key: K, value: V) -> None:
        self._entries[key] = value
        self._entries.move_to_end(key)
        if len(self._entries) > self.maxsize:
            self._entries.popitem(last=False)

    def __delitem__(self, key: K) -> None:
        del self._entries[key]

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[K]:
        """The keys, least recently used first (iterating does not count as a use)."""
        return iter(self._entries)

    def values(self) -> list[V]:
        """The values, least recently used first."""
        return list(self._entries.values())

    def clear(self) -> None:
        self._entries.clear()

    def __repr__(self) -> str:
        return f"Bounded(maxsize={self.maxsize}, {len(self._entries)} entries)"
