"""The NaN rule, applied in one place around every backend.

NaN or ±Inf in a query row, or in a key or value that the row may see, makes that row's output
(and weights) NaN: corrupt data never looks healthy. Non-finite values that no query may see
never reach any result. Backends cannot be trusted to agree on this by themselves (torch's CPU
flash kernel returns 0 for a NaN query row; a matmul turns 0 * NaN into NaN for rows that never
saw the key), so the common case pays one cheap check per tensor and the rare case runs the
backend on zeroed inputs and marks the dependent rows afterwards.

``registry.run`` applies the rule to every attention call, the common case inline (one frame
between ``attention`` and a backend's ``run``); the rare careful path is ``careful`` here, and
``run_guarded`` applies the whole rule to any other ``run`` (a rival timed against a backend).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
from torch import Tensor

from ..masks import TileKind
from ._tensors import repeat_kv
from .call import Call

__all__ = ["NonFiniteInput", "careful", "finite", "run_guarded"]

_ROWS = 256  # query rows per visibility block when finding the rows that see a bad key

Result = tuple[Tensor | None, Tensor | None]


class NonFiniteInput(Exception):
    """Raised by a backend that checks its inputs as it reads them (``Backend.checks_inputs``)
    when it met NaN or ±inf: the careful path takes over."""


def finite(*tensors: Tensor) -> bool:
    """True when every entry of every tensor is finite. One reduction per tensor and one read
    on the host for all of them, no bool copy; a sum that overflows only sends finite tensors
    down the careful path, which is still exact."""
    tensors = tuple(t for t in tensors if t.numel())
    if not tensors:
        return True
    acc = torch.float64 if tensors[0].dtype == torch.float64 else torch.float32
    with torch.no_grad():
        total = tensors[0].sum(dtype=acc)
        for t in tensors[1:]:
            total = total + t.sum(dtype=acc)
        return bool(torch.isfinite(total))


def run_guarded(run: Callable[[Call], Result], call: Call) -> Result:
    """``run(call)`` under the NaN rule, for a ``run`` that does not check its inputs: the
    cheap check, then ``run`` itself or the careful path. Inside a traced graph, which cannot
    branch on data (under torch.compile the check would be a graph break in every attention
    call), ``run`` computes the plain formula."""
    if call.traced or finite(call.query, call.key, call.value):
        return run(call)
    return careful(run, call)


def careful(run: Callable[[Call], Result], call: Call) -> Result:
    """``run`` on ``call`` with the non-finite query rows and key/value positions zeroed, then
    NaN in every output (and weights) row that reads one of them: the rare path of the NaN
    rule, taken when the inputs hold NaN or ±inf."""
    q, k, v = call.query, call.key, call.value
    with torch.no_grad():
        q_bad = ~torch.isfinite(q).all(-1)  # [B, H, L]
        kv_bad = ~torch.isfinite(k).all(-1) | ~torch.isfinite(v).all(-1)  # [B, H_kv, S]
    zero = torch.zeros((), dtype=q.dtype, device=q.device)
    clean = replace(
        call,
        query=torch.where(q_bad[..., None], zero, q),
        key=torch.where(kv_bad[..., None], zero, k),
        value=torch.where(kv_bad[..., None], zero, v),
    )
    out, weights = run(clean)
    row_bad = q_bad | _rows_seeing(call, repeat_kv(kv_bad[..., None], q.shape[1] // k.shape[1]))
    nan = torch.tensor(float("nan"), device=q.device)
    if out is not None:
        out = torch.where(row_bad[..., None], nan.to(out.dtype), out)
    if weights is not None:
        rows = row_bad if call.heads is None else row_bad[:, list(call.heads)]
        weights = torch.where(rows[..., None], nan.to(weights.dtype), weights)
    return out, weights


def _rows_seeing(call: Call, bad: Tensor) -> Tensor:
    """bool [B, H, L]: query rows that may see at least one key marked in ``bad`` [B, H, S, 1].

    Only the key range between the first and the last bad key is lowered, one block of query
    rows at a time, and tiles the mask reports as not reaching that range are skipped.
    """
    b, h, _, length_q, length_k, _ = call.shape
    bad = bad[..., 0]  # [B, H, S]
    if call.mask is None:
        return bad.any(-1, keepdim=True).expand(b, h, length_q)
    seen = torch.zeros(b, h, length_q, dtype=torch.bool, device=bad.device)
    for i in range(b):
        cols = torch.nonzero(bad[i].any(0)).flatten()
        if cols.numel() == 0:
            continue
        first, last = int(cols[0]), int(cols[-1]) + 1
        for q0 in range(0, length_q, _ROWS):
            q1 = min(q0 + _ROWS, length_q)
            answer = call.mask.tile(length_q, length_k, q0, q1, batch=i)
            lo, hi = max(first, answer.start), min(last, answer.stop)
            if answer.kind == TileKind.EMPTY or lo >= hi:
                continue
            keep = call.mask.block(length_q, length_k, q0, q1, lo, hi, batch=i, device=bad.device)
            hit = keep & bad[i, :, None, lo:hi]  # [1, H, rows, cols]
            seen[i, :, q0:q1] = hit.any(-1)[0].expand(h, q1 - q0)
    return seen
