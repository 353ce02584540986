"""A decoding step's attention calls on a short path: one query row over a KV cache, every
layer of the step with the same mask object.

At a decoding step the model calls attention once per layer with L = 1 and the one mask made
for the step (transformers' ``make_mask``, a ``KVCache``'s step mask). What such a call needs
besides its tensors (the mask as the kernel runs it, whether its heads fold, the backend
``auto`` picks, that backend prepared for the call) depends only on that mask object and the
call's shapes, dtypes, devices and scale: it is worked out on the step's first call, after the
whole validation of ``multihead.attention``, and kept on the mask for the calls of the other
layers. Calls without a mask keep theirs by signature, with the key length's class in
place of the length: a growing cache's steps share one route, worked out once per doubling
of the cache. The route is the registry's (``registry.route``: ``auto``'s choice and that
backend prepared for the call). Those calls go straight to the chosen backend prepared for them
(``Backend.prepared``: the fused kernel with its work list and other arguments made once), or
where it prepares nothing to ``registry.run``; a prepared kernel that meets NaN or ±inf hands
the call to ``registry.run``, whose careful path applies the NaN rule. A new step (a longer
cache, other padding) brings a new mask, so nothing kept can be stale.

Grouped-query heads fold into query rows: at L = 1 the H / H_kv query heads of a group read
the same key/value head and (where the mask is the same for every head) see the same keys,
so they are the rows of one (B, H_kv, H / H_kv, D) call whose mask shows every row the keys
the single row saw. The kernel then reads each key once per group, in a matrix product
instead of H / H_kv vector products. A mask whose rows are alike (padding) is that mask
already; a band that shows the row every key needs none; any other is lowered once per step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from . import bias as mb
from ._cache import Bounded
from .backends import registry
from .backends._measure import length_class
from .backends.call import Call, heads_as_rows, prepare, single_row_mask, traced
from .masks import Mask

__all__ = ["applies", "attend", "run"]


@dataclass(frozen=True)
class _Route:
    """How the calls of one signature run. ``folded``: the query's shape as (B, H_kv,
    H / H_kv, D) rows, or None to run it as it is; the call's mask is its own (``own_mask``)
    or ``mask``; ``backend`` runs it; the output comes back as ``out_shape`` (B, 1, H, D_v).
    A route is kept in the memo of the mask it runs with (``_routes``)."""

    folded: tuple[int, int, int, int] | None
    own_mask: bool
    mask: Mask | None
    backend: str
    scale: float
    softcap: float | None
    out_shape: tuple[int, int, int, int]
    # the backend prepared for the route's calls (``registry.prepared``), or None
    direct: Callable[[Tensor, Tensor, Tensor], Tensor | None] | None = None

    def rows(self, query: Tensor) -> Tensor:
        """The query (B, H, 1, D) as the route runs it: folded into rows, or as it is."""
        return query if self.folded is None else query.reshape(self.folded)


# signatures whose routes a step's mask keeps in its memo (``Mask.memo``: they die with it)
_ROUTES_KEPT = 64
# the routes of unmasked calls, by signature with the key length's class in place of the
# length (``_unmasked_signature``: a growing cache's steps share one)
_UNMASKED: Bounded[tuple, _Route] = Bounded(64)


def applies(query: Tensor, key: Tensor, value: Tensor) -> bool:
    """Whether ``attend`` may take a call as a decoding step's: one query row (B, H, 1, D), no
    gradient wanted and no graph being traced (torch.compile, torch.export and both ONNX
    exporters, the TorchScript one through torch.jit: a graph takes the whole path). The
    caller adds what its own call may carry besides (a bias, dropout)."""
    return (
        query.dim() == 4
        and query.shape[2] == 1
        and not (
            torch.is_grad_enabled()
            and (query.requires_grad or key.requires_grad or value.requires_grad)
        )
        and not traced()
        and not torch.jit.is_tracing()
    )


def attend(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Mask | None,
    scale: float | None,
    softcap: float | None,
) -> Tensor:
    """``multihead.attention(query, key, value, mask, bias=softcap, scale=scale)`` for one
    query row, in transformers' layout.

    Args:
        query: (B, H, 1, D).
        key: (B, H_kv, S, D).
        value: (B, H_kv, S, D_v).
        mask: a multihead ``Mask`` (what ``make_mask`` made) or None.
        scale: multiplies the scores; None is 1 / sqrt(D).
        softcap: Gemma 2's logit cap, or None.

    Returns:
        The output (B, 1, H, D_v), contiguous: the same checks (errors included), choice, NaN
        rule and fallback as ``multihead.attention``, with the checks and the choice made once
        per mask object and call signature.
    """
    return _follow(query, key, value, mask, scale, softcap, None)


def run(call: Call) -> Tensor:
    """``attend`` for a one-row call already prepared (``backends.call.prepare``: checked, its
    mask and soft-cap as the kernel runs them), without a bias, sinks or dropout: the route
    is kept by the call's signature as ``attend``'s is, and made from the call without its
    checks again. Returns (B, 1, H, D_v), contiguous."""
    return _follow(call.query, call.key, call.value, call.mask, call.scale, call.softcap, call)


def _follow(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Mask | None,
    scale: float | None,
    softcap: float | None,
    prepared: Call | None,
) -> Tensor:
    """The call on the route kept under its signature, made where there is none (from the
    ``prepared`` call, or with every check)."""
    kept = _routes(mask)
    if mask is None:
        signature = _unmasked_signature(query, key, value, scale, softcap)
    else:
        signature = (
            query.shape, key.shape, value.shape, query.dtype, key.dtype, value.dtype,
            query.device, key.device, value.device, scale, softcap,
        )  # fmt: skip
    route = kept.get(signature)
    fresh = route is None
    while True:
        if route is None:
            route = kept[signature] = (
                _route(query, key, value, mask, scale, softcap) if prepared is None
                else _route_of(prepared)
            )  # fmt: skip
        rows = route.rows(query)
        if route.direct is not None:
            out = route.direct(rows, key, value)
            if out is not None:
                return out.reshape(route.out_shape)
            # NaN or ±inf in what the kernel read: the NaN rule's careful path, through the
            # registry
        call = Call(
            rows, key, value, mask if route.own_mask else route.mask, None, route.scale, 0.0,
            False, softcap=route.softcap, traced=False, exported=False,
        )  # fmt: skip
        try:
            out = registry.run(call, route.backend)[0]
        except ValueError:
            if fresh:
                raise
            # the chosen backend refuses what it ran until now (its kernel was turned off):
            # choose again, with every check, which raises if the call itself is at fault
            del kept[signature]
            route, fresh = None, True
            continue
        if out is None:
            raise RuntimeError(f"the attention backend {route.backend!r} returned no output")
        return out.reshape(route.out_shape)


def _unmasked_signature(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    scale: float | None,
    softcap: float | None,
) -> tuple:
    """What the route of an unmasked call is kept under: its signature, with the key length's
    class in place of the length (``_measure.length_class``) where keys and values have one
    length, so a growing cache's steps share one route until the length reaches the next
    class. That route serves them all: the checks ``multihead.attention`` makes read S only
    to compare the key's with the value's (compared here), ``auto``'s choice depends on S only
    through its class, and a backend prepares an unmasked call for keys of any length
    (``Backend.prepared``)."""
    k: tuple[int, ...] = key.shape
    v: tuple[int, ...] = value.shape
    if len(k) == len(v) == 4 and k[2] == v[2] > 0:
        k, v = (k[0], k[1], -length_class(k[2]), k[3]), (v[0], v[1], v[3])
    return (
        query.shape, k, v, query.dtype, key.dtype, value.dtype,
        query.device, key.device, value.device, scale, softcap,
    )  # fmt: skip


def _routes(mask: Mask | None) -> Bounded[tuple, _Route]:
    """The routes kept for calls with ``mask``, by signature: in the mask's memo, or for
    unmasked calls the process's table."""
    return _UNMASKED if mask is None else mask.memo("decoding routes", _ROUTES_KEPT)


def _route(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Mask | None,
    scale: float | None,
    softcap: float | None,
) -> _Route:
    """The route of a call: checked as ``multihead.attention`` checks it, folded where its
    mask is the same for every head, with ``auto``'s choice for the call as run and that
    backend prepared for it where it prepares calls."""
    cap = None if softcap is None else mb.softcap(float(softcap))
    return _route_of(prepare(query, key, value, mask, cap, scale, 0.0, False))  # every check


def _route_of(call: Call) -> _Route:
    """The route of a prepared call (see ``_route``)."""
    query, value, mask = call.query, call.value, call.mask
    b, h, h_kv, _, length_k, d = call.shape
    grouped, rows = heads_as_rows(call), mask
    if grouped is None and h_kv < h and mask is not None:  # a mask whose rows may differ
        rows = single_row_mask(mask, b, length_k)
        if rows is not mask:
            grouped = dataclasses.replace(
                call, query=query.reshape(b, h_kv, h // h_kv, d), mask=rows
            )
    folded = None if grouped is None else (b, h_kv, h // h_kv, d)
    call = grouped or call  # the same call, its checks passed, as rows of the groups
    # the registry's choice, and the chosen backend prepared for the calls where it prepares
    # them: every layer's call of the step is alike
    backend, direct = registry.route(call)
    own = rows is mask
    out_shape = (b, 1, h, value.shape[-1])
    mask_kept = None if own else rows
    return _Route(folded, own, mask_kept, backend, call.scale, call.softcap, out_shape, direct)
