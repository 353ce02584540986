"""``multihead cache``: the models converted from GGUF files into the user's cache
(``multihead.sources.cache_root``), listed with their sizes (``list``) and removed on request
(``remove NAME ...`` or ``remove --all``). Imports nothing heavy."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .. import sources
from .._flags import argument, option

__all__ = ["RemoveOptions", "list_command", "remove_command"]


def _size(nbytes: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def list_command(*, say: Callable[[str], None] = print) -> list[sources.Cached]:
    """Print each converted model's name and size, and the total."""
    found = sources.cached()
    root = sources.cache_root()
    if not found:
        say(f"no converted models in {root}")
        return found
    width = max(len(c.name) for c in found)
    for entry in found:
        say(f"{entry.name:<{width}}  {_size(entry.nbytes):>9}")
    total = sum(c.nbytes for c in found)
    say(f"{len(found)} in {root}, {_size(total)} in all (multihead cache remove NAME frees one)")
    return found


@dataclass(frozen=True, kw_only=True)
class RemoveOptions:
    """What ``multihead cache remove`` takes."""

    names: tuple[str, ...] | None = argument(
        "converted models to remove, as multihead cache list names them", metavar="NAME"
    )
    all: bool = option(False, "remove every converted model")

    def __post_init__(self) -> None:
        if bool(self.names) == self.all:
            raise ValueError(
                "multihead cache remove takes NAME ... or --all, one of the two. "
                f"Received: NAME {list(self.names or ())}, --all {self.all}"
            )


def remove_command(
    options: RemoveOptions, *, say: Callable[[str], None] = print
) -> list[sources.Cached]:
    """Remove the named converted models (or all); a later load converts again."""
    gone = sources.remove(None if options.all else list(options.names or ()))
    for entry in gone:
        say(f"removed {entry.name} ({_size(entry.nbytes)})")
    if not gone:
        say(f"nothing to remove in {sources.cache_root()}")
    return gone
