"""``auto``'s measured choice, shared by the backends that lead only where they ran faster.

A backend whose speed depends on the machine more than on the call (the fused C++ kernel, the
half-precision kernel) does not lead from a rule about CPU flags: the first call of each shape
class times it against the backend ``auto`` would otherwise run, and the answer is kept for the
process. A shape class is (device, dtype, B * H and L, S in powers of two, GQA groups, head
dims, mask and bias kind, weights, gradients). Each side runs once to warm up, then three times
(forward only, or forward and backward when the call needs gradients); the candidate leads
where its best time is at least 10% below the rival's (closer is noise). Calls of tens of
microseconds (decoding steps) are timed in up to five such rounds, alternating, within about
5 ms (``compare``).

The timing runs on a proxy of the call (``proxy``): its middle ``PROXY_ROWS`` query rows
against the keys they can see, with the mask and the bias cropped to them, so the same kernel
paths run (the same mask kind and tile answers, the same bias lowering, the weights when the
call wants them) at a bounded cost: at L = 6144 the measurement costs a fraction of the call
it precedes, and never the memory of a rival that materializes every weight of the whole call.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Hashable
from dataclasses import replace

import torch

from ..masks import TileKind
from ._nonfinite import NonFiniteInput
from .call import Call

__all__ = [
    "MARGIN",
    "PROXY_ROWS",
    "ROUNDS",
    "SHORT_SECONDS",
    "best_time",
    "compare",
    "faster",
    "length_class",
    "proxy",
    "shape_class",
    "switched_off",
    "timed",
]

MARGIN = 0.9  # the candidate must be at least 10% faster: closer calls are noise
# query rows a measurement times: enough for every thread to get several of the kernels' row
# blocks, few enough that a long call's measurement costs a small part of the call
PROXY_ROWS = 256
# a round of both sides shorter than this is repeated, alternating, up to ROUNDS rounds that
# fit in it: a few milliseconds once per shape class, against a noisy verdict for the process
SHORT_SECONDS = 0.005
ROUNDS = 5


def switched_off(variable: str) -> bool:
    """True when the environment variable ``variable`` is "0" (measurement turned off)."""
    return os.environ.get(variable, "1") == "0"


def length_class(n: int) -> int:
    """The class of a length (or count) in a shape class: lengths in [2^(c-1), 2^c) share
    class c; 0 and 1 are class 1."""
    return max(n, 1).bit_length()


def shape_class(call: Call) -> Hashable:
    """The key a measurement is remembered under: calls with equal keys run alike."""
    b, h, h_kv, length_q, length_k, d = call.shape
    mask = None if call.mask is None else (type(call.mask).__name__, call.mask.structure_key)
    bias = None if call.bias is None else (type(call.bias).__name__, call.bias.computed)
    return (
        str(call.query.device),
        call.query.dtype,
        length_class(b * h),
        h // h_kv,
        length_class(length_q),
        length_class(length_k),
        d,
        call.value.shape[-1],
        mask,
        bias,
        call.return_weights,
        call.needs_grad,
        call.softcap is not None,
        call.sinks is not None,
        call.heads is not None,
    )


def proxy(call: Call) -> Call:
    """The call cut to its middle ``PROXY_ROWS`` query rows (itself when it has no more)
    against the keys those rows can see: what a measurement times. The mask and the bias are
    cropped to that rectangle (``Mask.crop``, ``ScoreModifier.crop``), so the same kernel
    paths run: a causal proxy's rows see about half the keys, as the whole call's rows do on
    average, and hidden tiles are still skipped. Cropping the keys too keeps the work that
    grows with the keys alone (packing them, checking them for NaN) in the same proportion
    to the rows' work as in the whole call: 256 rows of packed documents see a few documents,
    and would otherwise pay for every key of the call."""
    _, _, _, length_q, length_k, _ = call.shape
    if length_q <= PROXY_ROWS:
        return call
    q0 = (length_q - PROXY_ROWS) // 2
    q1 = q0 + PROXY_ROWS
    k0, k1 = _visible_keys(call, q0, q1)
    return replace(
        call,
        query=call.query[:, :, q0:q1],
        key=call.key[:, :, k0:k1],
        value=call.value[:, :, k0:k1],
        mask=None if call.mask is None else call.mask.crop(length_q, length_k, q0, q1, k0, k1),
        bias=None if call.bias is None else call.bias.crop(length_q, length_k, q0, q1, k0, k1),
    )


def _visible_keys(call: Call, q0: int, q1: int) -> tuple[int, int]:
    """The smallest key range holding every key query rows ``[q0, q1)`` may see in any batch
    entry (the mask's ``tile`` answers); every key without a mask, with an unstructured one,
    or where those rows see nothing."""
    _, _, _, length_q, length_k, _ = call.shape
    mask = call.mask
    if mask is None or mask.arbitrary:
        return 0, length_k
    # a mask without its own batch dimension answers alike for every batch entry
    tiles = [mask.tile(length_q, length_k, q0, q1, batch=b) for b in range(mask.batch_size or 1)]
    seen = [t for t in tiles if t.kind != TileKind.EMPTY]
    if not seen:
        return 0, length_k
    return min(t.start for t in seen), max(t.stop for t in seen)


def best_time(fn: Callable[[], object], repeats: int = 3) -> float:
    """The shortest of ``repeats`` wall-clock runs of ``fn``, in seconds."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def timed(backend: Callable[[Call], tuple], call: Call) -> Callable[[], object]:
    """One run of ``backend`` as the caller will use it: forward only, or forward and backward
    when the call needs gradients (on detached copies: the caller's .grad stays untouched)."""
    if not call.needs_grad:

        def forward() -> object:
            with torch.no_grad():
                return backend(call)

        return forward
    leaves = [t.detach().requires_grad_() for t in (call.query, call.key, call.value)]
    trial = replace(call, query=leaves[0], key=leaves[1], value=leaves[2])

    def step() -> object:
        out = backend(trial)[0]
        return torch.autograd.grad(out, leaves, torch.ones_like(out))

    return step


def compare(
    mine: Callable[[], object],
    rival: Callable[[], object],
    *,
    clock: Callable[[Callable[[], object]], float] = best_time,
) -> bool:
    """True when ``mine`` runs faster than ``rival`` by ``MARGIN``: a warm-up run each, then
    ``clock`` times ``mine`` and then ``rival``.

    Calls so short that one round of both takes less than ``SHORT_SECONDS`` (a decoding step's
    attention: tens of microseconds) get more rounds, alternating, up to ``ROUNDS`` within
    about that time; each side keeps its best. On two cores a burst of other work stalls a
    multi-threaded kernel for a millisecond or so: in a single round it could hit all of one
    side's runs and none of the other's, and the wrong backend would serve the process."""
    mine()
    rival()
    best_mine, best_rival = clock(mine), clock(rival)
    spent = best_mine + best_rival
    rounds = ROUNDS if spent <= 0 else max(1, min(ROUNDS, int(SHORT_SECONDS / spent)))
    for _ in range(rounds - 1):
        best_mine = min(best_mine, clock(mine))
        best_rival = min(best_rival, clock(rival))
    return best_mine < MARGIN * best_rival


def faster(
    cache: dict[Hashable, bool],
    call: Call,
    mine: Callable[[Call], tuple],
    rival: Callable[[Call], object] | None,
    *,
    clock: Callable[[Callable[[], object]], float] = best_time,
) -> bool | None:
    """True when ``mine`` ran faster than ``rival`` on calls of ``call``'s shape class.

    Measured on the first call of the class, on its ``proxy`` (a warm-up run each, then
    ``clock`` times ``mine`` and then ``rival``), and remembered in ``cache``. Inputs holding
    NaN or ±inf (a backend that checks as it reads raises ``NonFiniteInput``) measure nothing:
    a later, cleaner call of the class does. With ``rival=None`` nothing runs: the remembered
    answer, or None when the class has not been measured.
    """
    key = shape_class(call)
    if rival is None:
        return cache.get(key)
    if key not in cache:
        try:
            trial = proxy(call)
            cache[key] = compare(timed(mine, trial), timed(rival, trial), clock=clock)
        except NonFiniteInput:
            return False
    return cache[key]
