"""Which backends exist, what each can do, and how ``backend="auto"`` chooses among them.

A new backend is one file plus one ``Backend`` entry in ``BACKENDS``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from . import reference, sdpa
from ._call import Call


@dataclass(frozen=True)
class Backend:
    name: str
    run: Callable[[Call], tuple[Tensor, Tensor | None]]
    unsupported: Callable[[Call], str | None]  # why this call cannot run here, or None
    preference: int  # lower runs first among backends that can honour a call


@dataclass(frozen=True)
class Choice:
    """The backend ``auto`` picked and, for every other backend, why it was not picked."""

    backend: str
    reasons: dict[str, str]

    def __str__(self) -> str:
        lines = [f"chosen: {self.backend}"]
        lines += [f"not {name}: {why}" for name, why in self.reasons.items()]
        return "\n".join(lines)


def _always(call: Call) -> str | None:
    return None


BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend("sdpa", sdpa.run, sdpa.unsupported, preference=0),
        Backend("reference", reference.run, _always, preference=9),
    )
}


def explain(call: Call) -> Choice:
    ranked = sorted(BACKENDS.values(), key=lambda b: b.preference)
    reasons: dict[str, str] = {}
    chosen = None
    for b in ranked:
        why = b.unsupported(call)
        if why is not None:
            reasons[b.name] = why
        elif chosen is None:
            chosen = b.name
        else:
            reasons[b.name] = f"supported, but {chosen} is expected to be faster for this call"
    assert chosen is not None, "the reference backend supports every call"
    return Choice(chosen, reasons)


def select(call: Call, backend: str) -> Backend:
    if not isinstance(backend, str) or (backend != "auto" and backend not in BACKENDS):
        raise ValueError(
            f"backend must be 'auto' or one of {sorted(BACKENDS)}. Received: backend={backend!r}"
        )
    if backend == "auto":
        return BACKENDS[explain(call).backend]
    chosen = BACKENDS[backend]
    why = chosen.unsupported(call)
    if why is not None:
        hint = " Use backend='auto' or backend='reference'." if call.return_weights else ""
        raise ValueError(
            f"backend {backend!r} cannot run this call: {why}.{hint} Received: backend={backend!r}"
        )
    return chosen
