"""Which backends exist, how ``backend="auto"`` chooses among them, and running the choice.

Every backend is a ``Backend`` record (``protocol.py``) registered under a name: the built-in
ones at the end of this file, others through ``register``. A new backend is one file plus one
``register`` call. ``auto`` orders the backends by the ``Rank`` each one's rule gives the call
(the registry holds no list of names), skips those that cannot run it, and lets a backend that
times itself take the lead where it measured faster. Choosing (``select``) only ranks and
checks, and remembers its answer per shape class; explaining (``explain``) builds the reasons
and runs nothing; running (``run``) chooses, applies the NaN rule and falls back to the next
choice when a backend turns out unable. ``run`` is the one way into the backends: a call for
the weights of chosen heads (``Call.heads``) or for statistics of the weights (``Call.stats``)
goes through it as a plain call does, and ``route`` gives a decoding step's layers the choice
and the prepared kernel they share (``multihead/decoding_routes.py``).
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable, Hashable
from dataclasses import dataclass, replace
from types import MappingProxyType

from torch import Tensor

from .._cache import Bounded
from . import _nonfinite, flex, fused, half, reduce, reference, sdpa, tiled
from ._measure import shape_class
from ._nonfinite import NonFiniteInput
from .call import Call, plain_causal, select_heads
from .protocol import Backend, BackendUnavailable, Rank

__all__ = [
    "BACKENDS",
    "Choice",
    "explain",
    "prepared",
    "register",
    "route",
    "run",
    "select",
    "unregister",
]

_registered: dict[str, Backend] = {}
BACKENDS = MappingProxyType(_registered)  # name -> Backend, read-only; change with register()
_STATES: list[Callable[[], Hashable]] = []  # the registered backends' state functions
_CHOICES: Bounded[Hashable, str] = Bounded(4096)  # auto's choice per _key


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
    _changed()


def _changed() -> None:
    """The backends changed: their state functions are read anew, remembered choices forgotten."""
    _STATES[:] = [b.state for b in _registered.values() if b.state is not None]
    _CHOICES.clear()


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
    _changed()


def _ranked(call: Call) -> list[tuple[str, Rank]]:
    """Every backend with its rank for ``call``, lowest cost first (ties: registration order)."""
    ranks = [(name, b.rank(call)) for name, b in _registered.items()]
    return sorted(ranks, key=lambda pair: pair[1].cost)


def _none_able(call: Call) -> ValueError:
    why_not = {name: b.why_not(call) for name, b in _registered.items()}
    return ValueError(
        "no registered backend can run this call (the reference backend runs every call; "
        f"was it unregistered?). Received: {why_not}"
    )


def _choose(call: Call, skip: frozenset[str] = frozenset()) -> str:
    """``auto``'s choice, leaving out ``skip``: the cheapest backend that can run the call,
    unless a later one measures faster than it (measured here, on the first call of a shape
    class). Builds no reason for the others: that is ``explain``'s."""
    order = [name for name, _ in _ranked(call) if name not in skip]
    leader = next((name for name in order if _registered[name].why_not(call) is None), None)
    if leader is None:
        raise _none_able(call)
    if call.traced:  # a measurement is a data-dependent branch
        return leader
    # each self-timing backend against the leader so far: the fastest leads, not the first
    # that beat the rules' choice
    for name in order[order.index(leader) + 1 :]:
        backend = _registered[name]
        measured = backend.measured
        if measured is None or backend.why_not(call) is not None:
            continue
        rival = _rival(call, order, leader, name)
        if rival is not None and measured(call, _registered[rival].run):
            leader = name
    return leader


def _rival(call: Call, order: list[str], leader: str, name: str) -> str | None:
    """The backend ``name`` is timed against: the leader so far, unless the leader compiles a
    kernel per shape (``Backend.compiles``), whose compile for the measurement's proxy would
    cost many calls; then the first able backend of ``order`` that does not compile (the one
    the compiling leader's rule was chosen over). None when there is no such backend."""
    if not _registered[leader].compiles:
        return leader
    return next(
        (
            other
            for other in order
            if other != name
            and not _registered[other].compiles
            and _registered[other].why_not(call) is None
        ),
        None,
    )


def _key(call: Call) -> Hashable | None:
    """What ``auto``'s choice for ``call`` depends on: the shape class (``_measure``), what the
    ranking rules read of the mask beyond it, and each backend's own state. None while a
    graph is traced (the choice is made anew then)."""
    if call.traced:
        return None
    _, _, _, length_q, length_k, _ = call.shape
    mask = call.mask
    band = None if mask is None else mask.visible_distances(length_q, length_k)
    traits = (
        call.device_type,
        call.dropout_p > 0.0,
        plain_causal(call),
        None if mask is None else mask.arbitrary,
        # a band's width, not its offset (which moves with every decoding step)
        None if band is None or None in band else band[1] - band[0],
        length_q == 0 or length_k == 0,
        call.softcap is not None,  # backends without a cap or sinks refuse those calls
        call.sinks is not None,
        call.heads is not None,  # chosen heads' weights in one pass: backends that can
        call.stats is not None,  # statistics folded into the pass: backends that can
    )
    return (shape_class(call), traits, tuple(state() for state in _STATES))


def select(call: Call, backend: str) -> str:
    """The name of the backend that runs ``call`` for ``backend=`` (checked). ``auto``'s
    choice is remembered per ``_key``: a later call of the class pays one lookup."""
    _check_name(backend)
    if backend != "auto":
        return _explicit(call, backend)
    key = _key(call)
    chosen = None if key is None else _CHOICES.get(key)
    if chosen is None:
        chosen = _choose(call)
        if key is not None:
            _CHOICES[key] = chosen
    return chosen


def _check_name(backend: object) -> None:
    if not isinstance(backend, str) or (backend != "auto" and backend not in _registered):
        raise ValueError(
            f"backend must be 'auto' or one of {sorted(_registered)} (more can be added with "
            f"multihead.backends.register). Received: backend={backend!r}"
        )


def _explicit(call: Call, name: str) -> str:
    chosen = _registered[name]
    if chosen.prepare is not None:
        chosen.prepare()
    why = chosen.why_not(call)
    if why is not None:
        hint = " Use backend='auto' or backend='reference'." if call.return_weights else ""
        raise ValueError(
            f"backend {name!r} cannot run this call: {why}.{hint} Received: backend={name!r}"
        )
    return name


def explain(call: Call) -> Choice:
    """The backend ``auto`` runs for ``call`` and why not each of the others. Nothing is
    compiled, run or timed: a backend that leads only where it measured faster is judged by
    what is known of this shape class, and said to be untimed when nothing is. For a
    statistics call: the backend that folds them into its pass, or where none can, the one
    whose weights the registry reduces (the reasons then say why none folds them)."""
    if call.stats is not None and _folding(call, "auto") is None:
        swept = explain(replace(call, stats=None, window=None, return_weights=True, heads=None))
        reasons = {
            name: why
            for name, b in _registered.items()
            if b.capabilities.stats and (why := b.why_not(call)) is not None
        }
        return Choice(swept.backend, {**swept.reasons, **reasons})
    ranks = dict(_ranked(call))
    why_not = {name: _registered[name].why_not(call) for name in ranks}
    able = [name for name in ranks if why_not[name] is None]
    if not able:
        raise _none_able(call)
    chosen, why_first, notes = _measured_lead(call, able, ranks)
    reasons = {
        name: why_not[name]
        or notes.get(name)
        or f"supported, but {chosen} is expected to be faster: {why_first}"
        for name in ranks
        if name != chosen
    }
    return Choice(chosen, reasons)


def _measured_lead(
    call: Call, able: list[str], ranks: dict[str, Rank]
) -> tuple[str, str, dict[str, str]]:
    """(the chosen backend, why it leads, what each measured backend that does not lead says)
    from what is already known: the first of ``able`` leads unless a later one measured faster
    for this shape class."""
    leader = able[0]
    why = ranks[leader].why
    notes: dict[str, str] = {}
    if call.traced:
        return leader, why, notes
    for name in able[1:]:  # as _choose: each against the leader so far
        measured = _registered[name].measured
        rival = None if measured is None else _rival(call, able, leader, name)
        if measured is None or rival is None:
            continue
        known = measured(call, None)
        if known:
            why = f"it measured faster than {rival} on this machine for calls of this shape class"
            leader = name
            continue
        notes[name] = f"{ranks[name].why}; " + (
            f"calls of this shape class have not been timed yet (the first one times it "
            f"against {rival})"
            if known is None
            else f"it did not measure faster than {rival} for calls of this shape class"
        )
    return leader, why, notes


def run(call: Call, backend: str) -> tuple[Tensor | None, Tensor | None]:
    """``call`` run on the backend ``backend=`` selects (checked first: errors raise here),
    under the NaN rule (docs/design.md, "The NaN rule"). A backend that raises
    ``BackendUnavailable`` while running is replaced, with a warning, by the next one ``auto``
    would choose, and the call runs again there.

    A call for chosen heads' weights runs in one pass where the backend that leads the plain
    call computes them alone (``Capabilities.heads``), else as the plain call and a call of
    those heads alone. A statistics call (``Call.stats``) runs on a backend that folds them
    into its pass (``Capabilities.stats``); where none can, or its inputs hold NaN or ±inf,
    the statistics are reduced from weights, one slice of query rows at a time
    (``reduce.sweep``), each slice a call of this function. Either returns the statistics
    ``{name: Tensor}`` in place of the weights.
    """
    if call.stats is not None:
        return _statistics(call, backend)
    if call.heads is None:
        name = select(call, backend)
    else:  # chosen heads' weights: in one pass where the plain call's backend can
        one_pass = _one_pass(call, backend)
        if one_pass is None:
            return _two_passes(call, backend)
        name = one_pass
    failed: set[str] = set()
    while True:
        chosen = _registered[name]
        try:
            if call.traced or (
                not chosen.checks_inputs and _nonfinite.finite(call.query, call.key, call.value)
            ):
                return chosen.run(call)
            if chosen.checks_inputs:
                try:
                    return chosen.run(call)
                except NonFiniteInput:
                    pass
            return _nonfinite.careful(chosen.run, call)
        except BackendUnavailable as e:
            failed.add(name)
            name = _successor(call, frozenset(failed), e)


def _one_pass(call: Call, backend: str) -> str | None:
    """The backend that computes the output and the weights of ``call.heads`` in one pass:
    the one chosen for the call without weights, where it can (``Capabilities.heads``); None
    where it cannot or dropout asks for a pass of its own. That pass is the plain call's with
    a few heads' weights written too, so the backend that leads the plain call leads it (a
    model's other layers have measured that class already, and its measurement never writes
    every head's weights, as a measurement of the all-heads weights call would)."""
    plain = replace(call, return_weights=False, heads=None)
    name = select(plain, backend)
    runner = _registered[name]
    one = call.return_weights and call.dropout_p == 0.0 and runner.capabilities.heads
    return name if one and runner.why_not(call) is None else None


def _two_passes(call: Call, backend: str) -> tuple[Tensor | None, Tensor | None]:
    """The output of every head from the call without weights, then the weights of
    ``call.heads`` from a call of those heads alone (before dropout)."""
    assert call.heads is not None
    plain = replace(call, return_weights=False, heads=None)
    if not call.return_weights:  # heads name nothing to compute
        return run(plain, backend)
    out = run(plain, backend)[0]
    part = select_heads(replace(plain, dropout_p=0.0, return_weights=True), list(call.heads))
    return out, run(part, backend)[1]


def _statistics(call: Call, backend: str) -> tuple[Tensor | None, dict[str, Tensor]]:
    """A statistics call: on the backend that folds them into its pass (``_folding``), else,
    or where that backend met NaN or ±inf or turned out unable, reduced from the weights of
    slices of query rows (``reduce.sweep``, each slice through ``run`` on ``backend``, so the
    NaN rule's careful path covers it)."""
    name = _folding(call, backend)
    if name is not None:
        chosen = _registered[name]
        try:
            if (
                chosen.checks_inputs
                or call.traced
                or _nonfinite.finite(call.query, call.key, call.value)
            ):
                return chosen.run(call)  # type: ignore[return-value]
        except (NonFiniteInput, BackendUnavailable):
            pass
    return reduce.sweep(call, lambda part: run(part, backend))


def _folding(call: Call, backend: str) -> str | None:
    """The backend that folds ``call``'s statistics into its own pass: ``backend`` itself when
    it can, for ``auto`` the first in ``auto``'s order that can; None when none can."""
    _check_name(backend)
    names = [name for name, _ in _ranked(call)] if backend == "auto" else [backend]
    return next((name for name in names if _registered[name].why_not(call) is None), None)


def route(call: Call) -> tuple[str, Callable[[Tensor, Tensor, Tensor], Tensor | None] | None]:
    """A decoding step's route for calls alike to ``call`` (checked, without requests): the
    backend ``auto`` runs them on, and that backend prepared for them (``prepared``) or None.
    Worked out once per step and kept by ``multihead/decoding_routes.py`` for every layer."""
    name = select(call, "auto")
    return name, prepared(call, name)


def prepared(call: Call, backend: str) -> Callable[[Tensor, Tensor, Tensor], Tensor | None] | None:
    """The backend named ``backend`` (a name ``select`` returned for ``call``) prepared for calls
    alike to ``call`` (``Backend.prepared``): a function of (query, key, value) that returns
    the output, or None where it met NaN or ±inf and the call must go through ``run``. None
    where the backend prepares nothing for such a call."""
    chosen = _registered[backend]
    if call.traced or not chosen.checks_inputs or chosen.prepared is None:
        return None
    return chosen.prepared(call)


def _successor(call: Call, failed: frozenset[str], error: BackendUnavailable) -> str:
    """The backend that runs ``call`` after the ones in ``failed`` raised, said in a warning
    that points at the caller's line."""
    _CHOICES.clear()  # the failed one's rules answer differently from now on
    successor = _choose(call, skip=failed)
    warnings.warn(
        f"{error}; this call and later ones like it run on {successor!r}. "
        "explain_backend() gives the reason.",
        RuntimeWarning,
        stacklevel=_outside(),
    )
    return successor


def _outside() -> int:
    """The ``stacklevel`` of the first frame outside this package, as seen from its caller."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    return level


for _name, _module in (
    ("tiled", tiled),
    ("half", half),
    ("sdpa", sdpa),
    ("reference", reference),
    ("flex", flex),
    ("fused", fused),
):
    register(_name, _module.BACKEND)
