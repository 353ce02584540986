"""Which backends exist, how ``backend="auto"`` chooses among them, and running the choice.

Every backend is a ``Backend`` record (``protocol.py``) registered under a name: the built-in
ones at the end of this file, others through ``register``. A new backend is one file plus one
``register`` call. ``auto`` orders the backends by the ``Rank`` each one's rule gives the call
(the registry holds no list of names), skips those that cannot run it, and lets a backend that
times itself take the lead where it measured faster.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from types import MappingProxyType

import torch
from torch import Tensor

from . import flex, fused, half, reference, sdpa, tiled
from ._call import BackendUnavailable, Call, exporting
from .protocol import Backend

__all__ = ["BACKENDS", "Choice", "explain", "register", "runner", "select", "unregister"]

_registered: dict[str, Backend] = {}
BACKENDS = MappingProxyType(_registered)  # name -> Backend, read-only; change with register()


@dataclass(frozen=True)
class Choice:
    """The backend ``auto`` picked and, for every other backend, why it was not picked."""

    backend: str
    reasons: dict[str, str]

    def __str__(self) -> str:
        lines = [f"chosen: {self.backend}"]
        lines += [f"not {name}: {why}" for name, why in self.reasons.items()]
        return "\n".join(lines)


def register(name: str, backend: Backend, *, replace: bool = False) -> None:
    """Make ``backend`` available as ``attention(..., backend=name)`` and to ``auto``.

    Args:
        name: a non-empty string other than "auto".
        backend: a ``multihead.backends.Backend`` (run, rank, capabilities, unsupported,
            measured); see its docstring for the protocol.
        replace: replace a backend already registered under ``name``.

    Raises:
        TypeError: ``name`` is not a string or ``backend`` is not a ``Backend``.
        ValueError: ``name`` is empty or "auto", or taken and ``replace`` is False.
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a string. Received: name of type {type(name).__name__}")
    if not name or name == "auto":
        raise ValueError(
            f"name must be a non-empty string other than 'auto' (auto chooses among the "
            f"registered backends). Received: name={name!r}"
        )
    if not isinstance(backend, Backend):
        raise TypeError(
            "backend must be a multihead.backends.Backend record (run, rank, capabilities, "
            "unsupported, measured); wrap your functions in one. "
            f"Received: backend of type {type(backend).__name__}"
        )
    if name in _registered and not replace:
        raise ValueError(
            f"a backend named {name!r} is already registered; pass replace=True to replace it "
            f"or pick another name. Received: name={name!r}"
        )
    _registered[name] = backend


def unregister(name: str) -> None:
    """Remove the backend registered under ``name``.

    Raises:
        ValueError: no backend has that name.
    """
    if name not in _registered:
        raise ValueError(
            f"no backend named {name!r} is registered; registered: {sorted(_registered)}. "
            f"Received: name={name!r}"
        )
    del _registered[name]


def explain(call: Call, *, skip: frozenset[str] = frozenset()) -> Choice:
    """The backend ``auto`` runs for ``call`` (leaving out ``skip``) and why not the others."""
    ranks = {name: b.rank(call) for name, b in _registered.items()}
    order = sorted(_registered, key=lambda name: ranks[name].cost)  # ties: registration order
    why_not = {name: _registered[name].why_not(call) for name in order}
    for name in skip:
        why_not[name] = "it failed on this call"
    able = [name for name in order if why_not[name] is None]
    if not able:
        raise ValueError(
            "no registered backend can run this call (the reference backend runs every call; "
            f"was it unregistered?). Received: {why_not}"
        )
    chosen, why_first = able[0], ranks[able[0]].why
    # a measurement is a data-dependent branch: never while a graph is traced
    if not exporting() and not torch.compiler.is_compiling():
        # each measuring backend against the leader so far: the fastest leads, not the first
        # that beat the rule's choice
        for name in able[1:]:
            measured = _registered[name].measured
            if measured is not None and measured(call, _registered[chosen].run):
                why_first = (
                    f"it measured faster than {chosen} on this machine for calls of this "
                    "shape class"
                )
                chosen = name
    reasons = {
        name: why_not[name] or f"supported, but {chosen} is expected to be faster: {why_first}"
        for name in order
        if name != chosen
    }
    return Choice(chosen, reasons)


def select(call: Call, backend: str) -> str:
    """The name of the backend that runs ``call`` for ``backend=`` (checked)."""
    if not isinstance(backend, str) or (backend != "auto" and backend not in _registered):
        raise ValueError(
            f"backend must be 'auto' or one of {sorted(_registered)} (more can be added with "
            f"multihead.backends.register). Received: backend={backend!r}"
        )
    if backend == "auto":
        return explain(call).backend
    why = _registered[backend].why_not(call)
    if why is not None:
        hint = " Use backend='auto' or backend='reference'." if call.return_weights else ""
        raise ValueError(
            f"backend {backend!r} cannot run this call: {why}.{hint} Received: backend={backend!r}"
        )
    return backend


def runner(call: Call, backend: str) -> Callable[[Call], tuple[Tensor, Tensor | None]]:
    """A function running a call like ``call`` on the backend ``backend=`` selects.

    The backend is checked now (errors raise here). A backend that raises
    ``BackendUnavailable`` while running is replaced, with a warning, by the next backend
    ``auto`` would choose.
    """
    first = select(call, backend)

    def run(call: Call) -> tuple[Tensor, Tensor | None]:
        failed: set[str] = set()
        name = first
        while True:
            try:
                return _registered[name].run(call)
            except BackendUnavailable as e:
                failed.add(name)
                successor = explain(call, skip=frozenset(failed)).backend
                warnings.warn(
                    f"{e}; this call and later ones like it run on {successor!r}. "
                    "explain_backend() gives the reason.",
                    RuntimeWarning,
                    stacklevel=4,  # run <- run_guarded <- attention() <- its caller
                )
                name = successor

    # the NaN rule skips its own pass over q, k and v for a backend that checks as it reads
    run.checks_inputs = getattr(_registered[first].run, "checks_inputs", False)  # type: ignore[attr-defined]
    return run


for _name, _module in (
    ("tiled", tiled),
    ("half", half),
    ("sdpa", sdpa),
    ("reference", reference),
    ("flex", flex),
    ("fused", fused),
):
    register(_name, _module.BACKEND)
