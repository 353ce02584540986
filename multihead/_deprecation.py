"""Names kept for one release after they were replaced: calling one warns, once per call site,
with ``MultiheadDeprecationWarning`` and goes on working.

The category subclasses both ``DeprecationWarning`` (what tools and ``-W error::DeprecationWarning``
look for) and ``FutureWarning`` (what Python shows a user by default): the warning points at
the caller's line, so a script calling an old name sees it without any flag.
"""

from __future__ import annotations

import warnings

__all__ = ["MultiheadDeprecationWarning", "deprecated"]


class MultiheadDeprecationWarning(DeprecationWarning, FutureWarning):
    """A multihead name that is kept for one release after its replacement landed."""


def deprecated(old: str, new: str, *, stacklevel: int = 3) -> None:
    """Warn that ``old`` is deprecated in favour of ``new`` (at the caller's caller, the user's
    line, by default)."""
    warnings.warn(
        f"{old} is deprecated and will be removed in the next release; use {new} instead",
        MultiheadDeprecationWarning,
        stacklevel=stacklevel,
    )
