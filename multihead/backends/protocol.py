"""What a backend is: a run function, what it can do, and its rule for ``auto``'s ranking.

A backend is a ``Backend`` record handed to ``multihead.backends.register(name, backend)``.
The registry never asks which backend it holds: it refuses calls outside the backend's
``Capabilities`` (one message per capability), then asks the backend's own ``unsupported``
rule, and orders the backends that remain by the ``Rank`` each one's ``rank`` rule gives the
call (lowest cost first). A backend that can time itself against the leader (``measured``)
takes the lead where it ran faster on this machine.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch
from torch import Tensor

from .call import Call

__all__ = ["Backend", "BackendUnavailable", "Capabilities", "Rank"]

# what the built-in rules agree on; any number works, these name the usual tiers. They are
# ints: under torch.compile(dynamic=True) dynamo turns float constants into symbolic floats,
# which the registry could not sort without breaking the graph
LEADS = 0  # a backend that is clearly best for this call
FAVOURED = 5  # ahead of the usual choice where this machine favours it
PREFERRED = 10  # the usual choice for this kind of call
FALLBACK = 20  # honours the call, but another is expected to be faster
LAST = 30  # runs only what no other backend can


class BackendUnavailable(RuntimeError):
    """Raised by a backend's ``run`` when it finds only on trying that it cannot run the call
    (a compile that fails). The registry catches it and runs the next backend ``auto`` would
    choose; the backend's ``unsupported`` should report the reason from then on."""


@dataclass(frozen=True)
class Rank:
    """A backend's place for one call: lower ``cost`` runs first; ``why`` says why it is
    expected to be fast (shown by ``explain_backend`` when it is chosen)."""

    cost: float
    why: str


@dataclass(frozen=True)
class Capabilities:
    """What a backend can run at all; calls outside it never reach the backend.

    Attributes:
        label: how messages name the backend ("FlexAttention", "the fused kernel").
        dtypes: input dtypes it takes; None for every floating dtype.
        devices: device types it runs on ("cpu", "cuda", ...); None for every device.
        weights: returns the softmax weights when the call asks for them.
        dropout: applies dropout on the weights.
        softcap: applies ``bias.softcap`` (tanh capping of the scores).
        sinks: applies ``bias.sinks`` (sink logits in the softmax denominator).
        heads: honours ``Call.heads`` (the weights of chosen query heads only, from the same
            pass as every head's output); ``attention_with_weights(..., heads=)`` runs other
            backends twice (the output, then those heads alone with their weights).
        stats: honours ``Call.stats`` (statistics of the weights of the heads ``Call.heads``
            names, all by default, folded into its own pass and returned as
            ``{name: Tensor}`` in place of the weights). A statistics call that
            the backend ``auto`` picks cannot take is reduced by the registry from weights,
            one slice of query rows at a time, so a backend without it still serves
            ``attention_stats`` through its weights.
    """

    label: str = "this backend"
    dtypes: tuple[torch.dtype, ...] | None = None
    devices: tuple[str, ...] | None = None
    weights: bool = False
    dropout: bool = False
    softcap: bool = False
    sinks: bool = False
    heads: bool = False
    stats: bool = False

    def unsupported(self, call: Call) -> str | None:
        """Why ``call`` is outside these capabilities, or None."""
        dtype, device = call.query.dtype, call.query.device.type
        if self.devices is not None and device not in self.devices:
            where = _listed(self.devices, str.upper)
            return f"{self.label} runs on {where}; received device {device}"
        if self.dtypes is not None and dtype not in self.dtypes:
            names = _listed(self.dtypes, lambda d: str(d).removeprefix("torch."))
            return f"{self.label} takes {names}; received {dtype}"
        asked = (
            (call.return_weights, self.weights, "does not return attention weights"),
            (call.dropout_p > 0.0, self.dropout, "has no dropout"),
            (call.softcap is not None, self.softcap, "has no soft-capping"),
            (call.sinks is not None, self.sinks, "has no attention sinks"),
            (
                call.stats is not None,
                self.stats,
                "folds no statistics into its pass",
            ),
            # chosen heads' statistics come with the stats capability
            (
                call.heads is not None and call.stats is None,
                self.heads,
                "computes the weights of every head or none",
            ),
        )
        missing = next((why for wanted, able, why in asked if wanted and not able), None)
        return None if missing is None else f"{self.label} {missing}"


def _listed(items, name: Callable) -> str:
    names = [name(i) for i in items]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def _nothing_more(call: Call) -> str | None:
    return None


@dataclass(frozen=True)
class Backend:
    """One attention backend, as ``multihead.backends.register`` takes it.

    Attributes:
        run: ``run(call) -> (output, weights or None)``; output (B, H, L, D_v) in the
            query's dtype, weights (B, H, L, S) when ``call.return_weights``, the
            statistics ``{name: Tensor}`` in their place when ``call.stats``
            (``Capabilities.stats``). ``call`` is a validated ``Call``
            (``multihead.backends.Call``): query (B, H, L, D), key (B, H_kv, S, D), value
            (B, H_kv, S, D_v), mask (a ``Mask`` or None), bias (a score modifier or None),
            scale, dropout_p, return_weights, heads, stats. Raise
            ``BackendUnavailable`` when the call turns out impossible only once tried (a
            compile that fails): the registry then runs the next backend ``auto`` would pick.
        rank: ``rank(call) -> Rank``, the ranking rule ``auto`` orders backends by.
        capabilities: what the backend can run at all.
        unsupported: ``unsupported(call) -> reason or None`` for what capabilities cannot
            say (sizes, a kernel not built or whose build failed, mask shapes...). It must
            not compile or time anything: ``explain_backend`` asks it.
        measured: ``measured(call, rival_run) -> bool | None``, optional: True when this
            backend ran faster than ``rival_run`` (the backend ``auto`` would otherwise lead
            with) on calls like this one, measured on this machine. With ``rival_run=None``
            nothing is run: the answer already known, or None when this shape class has not
            been measured yet. Never asked while tracing.
        prepare: ``prepare()``, optional: get ready to run (compile a kernel), called before
            an explicit ``backend=name`` call is checked; ``auto`` never calls it.
        state: ``state() -> hashable``, optional: what the backend's rules read besides the
            call (a kernel built since, a compile that failed, a setting). ``auto`` remembers
            its choice per shape class and per state.
        checks_inputs: ``run`` checks q, k and v for NaN and ±inf as it reads them and raises
            ``multihead.backends._nonfinite.NonFiniteInput`` when it meets one, so the NaN
            rule skips its own pass over them (at decode that pass reads the whole cache).
        prepared: ``prepared(call) -> run or None``, optional, for a backend that checks its
            inputs as it reads them: a function of (query, key, value) that runs calls alike
            to ``call`` (the same mask object, bias, shapes, dtypes and scale; for a call
            without mask or bias, keys and values of any length S >= 1, as a growing cache's
            decoding steps give) with everything else worked out once, returning the output,
            or None where a block it read held NaN or ±inf (the caller then runs the call
            through ``registry.run``, whose careful path applies the NaN rule). None where the
            call cannot run so. A decoding step's layers make such calls
            (``multihead/decoding_routes.py``).
        compiles: the first call of each shape compiles a kernel (seconds, many times the
            call). ``auto`` times no backend against it: a backend that times itself is timed
            against the first able backend that does not compile (the one this backend's rule
            was chosen over), so a measurement never pays a compile it would then discard.
    """

    run: Callable[[Call], tuple[Tensor, Tensor | None]]
    rank: Callable[[Call], Rank]
    capabilities: Capabilities = Capabilities()
    unsupported: Callable[[Call], str | None] = _nothing_more
    measured: Callable[[Call, Callable[[Call], object] | None], bool | None] | None = None
    prepare: Callable[[], None] | None = None
    state: Callable[[], Hashable] | None = None
    checks_inputs: bool = False
    prepared: Callable[[Call], Callable[[Tensor, Tensor, Tensor], Tensor | None] | None] | None = (
        None
    )
    compiles: bool = False

    def why_not(self, call: Call) -> str | None:
        """Why this backend cannot run ``call``, or None when it can."""
        return self.capabilities.unsupported(call) or self.unsupported(call)
