"""The fused C++ attention kernel (``backend="fused"``), built on first use, run as one torch op.

The kernel (``kernels/csrc/fused_attention.cpp``) walks a work list made from the mask's own tile
answers (the planner in ``_plan.py``; cached per mask structure and shape), so it skips what
the mask hides without knowing any mask kind. Per block of query rows it computes scores by
GEMM, soft-caps them, adds the bias (a dense tensor read through broadcast strides, or a
relative modifier such as ALiBi or T5 buckets read from one row per head of values by
distance: never an L x S tensor), applies the keep bits and runs an online softmax, with the
sink logits joining each row's denominator; the backward pass recomputes the probabilities
from the saved log-sum-exp. The weights, when asked for, come from the same pass, each
written once, for every head or for chosen ones.

It comes from the package build (``setup.py`` compiles it when the package is installed
into an environment holding torch and a C++ compiler, the module inside the installed
package) or, where the installation has none that matches this process, from
``torch.utils.cpp_extension`` compiling it on demand into a per-user cache (the builder and
the loader in ``multihead/kernels``, the one sequence both kernels use). Where neither can run
(no compiler, no headers) the failure is remembered, ``unsupported`` reports it in one line,
the process says once that the kernel is missing and how to get it, and ``auto`` uses the
other backends. ``auto`` never starts the compile: it uses a kernel from the package or built
earlier on this machine (by ``multihead doctor``, ``multihead bench kernels`` or a call with
``backend="fused"``), and runs it only where it measured faster than the backend it would
otherwise choose (``measured_faster``). Setting ``MULTIHEAD_FUSED=0`` turns the kernel off.

The kernel is registered as ``torch.ops.multihead.fused_attention`` (and ``..._backward``,
``..._weights``) with fake kernels and an autograd formula, so ``torch.compile`` and
``torch.export`` see one op.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Hashable
from functools import partial
from pathlib import Path

import torch
from torch import Tensor

from .._cache import Bounded
from ..kernels import FUSED, Loader
from ..kernels import build as kernel_build
from . import _measure
from ._nonfinite import NonFiniteInput, run_guarded
from ._plan import KEPT_BITS, KEPT_ON_MASK, Item, plan, query_tile
from ._tensors import sink_grad, stat_dtype
from .call import Call, heads_as_rows
from .protocol import LAST, Backend, Capabilities, Rank
from .stat_names import KEY_STATS, STATS

__all__ = [
    "BACKEND",
    "build",
    "build_dir",
    "build_error",
    "measured_faster",
    "origin",
    "rank",
    "run",
    "stats",
]

_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_LOADER = Loader(FUSED, "the C++ kernel")  # the loaded module, or why there is none
_looked = False  # whether this process has looked for a build (packaged or cached) already
_told = False  # whether this process has said once that the kernel is missing
NOT_BUILT = (
    "not built on this machine yet: multihead doctor builds it (about half a minute), as does the "
    "first call with backend='fused'; auto never starts the compile"
)


def build_dir() -> Path:
    """The per-user folder the kernel is compiled into on demand (created when used)."""
    return kernel_build.cache_dir()


def origin() -> str:
    """Where the loaded kernel came from ("the package build (folder)" or "the per-user cache
    (folder)"), "" when none is loaded."""
    return _LOADER.origin


def build():
    """The compiled extension module: the package build's when it matches this process, else
    compiled on first use into the per-user cache; raises RuntimeError with the reason when it
    cannot be built (the reason is kept for ``build_error``)."""
    return _LOADER.load()


def built() -> bool:
    """True when the kernel is loaded in this process; the package build's kernel or a build
    already in the cache (from an earlier process) is loaded now, but nothing is ever compiled
    here. When there is neither, this process says so once, in one line on stderr."""
    global _looked
    if _LOADER.module is None and _LOADER.error is None and not _looked:
        _looked = True
        if _LOADER.switched_off():
            return False
        found, why = _LOADER.found()
        if found:
            build_error()  # loads it: nothing compiles
        else:
            _tell_missing(why)
    return _LOADER.module is not None


def _tell_missing(why: str) -> None:
    global _told
    if _told:
        return
    _told = True
    print(
        f"multihead: the fused C++ kernel is not available ({why}); attention runs on the "
        "other backends. `multihead doctor` compiles it (needs a C++ compiler), or reinstall "
        "as the README says",
        file=sys.stderr,
        flush=True,
    )


def _constant_when_traced(fn):
    """``torch.compiler.assume_constant_result(fn)`` without importing ``torch._dynamo``, which
    that function does (more than a second of imports, paid by the first attention call of a
    process, as this module is imported then): the same mark on the function
    (tests/backends/test_kernel_install.py checks that it is the mark torch sets)."""
    fn._dynamo_marked_constant = True
    return fn


@_constant_when_traced  # traced calls see the answer of the eager world
def build_error() -> str | None:
    """None when the kernel is built (building it now if needed), else why not, in one line."""
    return _LOADER.load_error()


# ------------------------------------------------------------------------------------------
# The ops. Plans arrive as tensors: items int64 [n, 6] (b0, b1, q0, q1, first chunk, end
# chunk; b0 = -1 for every batch entry), chunks int64 [m, 6] (k0, k1, offset of the keep block
# or -1, its strides over batch, head and row) and keep, every keep block flattened (bool).


@torch.library.custom_op("multihead::fused_attention", mutates_args=())
def _attention_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    items: Tensor,
    chunks: Tensor,
    keep: Tensor,
    bias: Tensor,
    table: Tensor,
    table_shift: int,
    scale: float,
    softcap: float,
    sinks: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    out, lse, bad = build().forward(
        q, k, v, items, chunks, keep, bias, table, table_shift, scale, softcap, sinks, False,
        torch.empty(0, dtype=torch.long),
    )  # fmt: skip
    return out, lse, bad


@torch.library.custom_op("multihead::fused_attention_weights", mutates_args=())
def _weights_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    items: Tensor,
    chunks: Tensor,
    keep: Tensor,
    bias: Tensor,
    table: Tensor,
    table_shift: int,
    scale: float,
    softcap: float,
    sinks: Tensor,
    heads: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """As ``fused_attention``, with the weights of the query heads ``heads`` (int64, in that
    order; empty for every head): (out, lse, weights [B, len(heads) or H, L, S], bad)."""
    out, lse, w, bad = build().forward(
        q, k, v, items, chunks, keep, bias, table, table_shift, scale, softcap, sinks, True, heads
    )
    return out, lse, w, bad


@torch.library.custom_op("multihead::fused_attention_backward", mutates_args=())
def _backward_op(
    grad: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    items: Tensor,
    chunks: Tensor,
    keep: Tensor,
    bias: Tensor,
    table: Tensor,
    table_shift: int,
    scale: float,
    softcap: float,
    bias_grad: bool,
    table_grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    dq, dk, dv, dbias, dtable = build().backward(
        grad, q, k, v, out, lse, items, chunks, keep, bias, table, table_shift, scale, softcap,
        bias_grad, table_grad,
    )  # fmt: skip
    return dq, dk, dv, dbias, dtable


# The fake kernels promise what the real ones return: every result is a new contiguous tensor,
# whatever the strides of the inputs (permuted, sliced or expanded q, k and v included).


def _out_shapes(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    b, h, length_q, _ = q.shape
    out = q.new_empty(b, h, length_q, v.shape[-1])
    lse = q.new_empty(b, h, length_q, dtype=stat_dtype(q.dtype))
    return out, lse, q.new_empty((), dtype=torch.bool)


@_attention_op.register_fake
def _(q, k, v, items, chunks, keep, bias, table, table_shift, scale, softcap, sinks):
    return _out_shapes(q, k, v)


@_weights_op.register_fake
def _(q, k, v, items, chunks, keep, bias, table, table_shift, scale, softcap, sinks, heads):
    out, lse, bad = _out_shapes(q, k, v)
    b, h, length_q, _ = q.shape
    chosen = heads.shape[0] if heads.numel() else h
    return out, lse, q.new_empty(b, chosen, length_q, k.shape[2]), bad


@_backward_op.register_fake
def _(grad, q, k, v, out, lse, items, chunks, keep, bias, table, table_shift, scale, cap, bg, tg):
    stat = stat_dtype(q.dtype)
    b, h, length_q, _ = q.shape
    dbias = q.new_empty((b, h, length_q, k.shape[2]) if bg else (0,), dtype=stat)
    dtable = q.new_empty((b, h, table.shape[-1]) if tg else (0,), dtype=stat)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dbias, dtable


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, items, chunks, keep, bias, table, table_shift, scale, softcap, sinks = inputs
    out, lse, bad = output
    ctx.save_for_backward(q, k, v, out, lse, items, chunks, keep, bias, table, sinks)
    ctx.table_shift, ctx.scale, ctx.softcap = table_shift, scale, softcap
    ctx.mark_non_differentiable(lse, bad)


def _backward(ctx, grad_out, grad_lse, grad_bad):
    q, k, v, out, lse, items, chunks, keep, bias, table, sinks = ctx.saved_tensors
    bias_grad = ctx.needs_input_grad[6] and bias.numel() > 0
    table_grad = ctx.needs_input_grad[7] and table.numel() > 0
    dq, dk, dv, dbias, dtable = _backward_op(
        grad_out, q, k, v, out, lse, items, chunks, keep, bias, table, ctx.table_shift,
        ctx.scale, ctx.softcap, bias_grad, table_grad,
    )  # fmt: skip
    d_bias = dbias.to(bias.dtype) if bias_grad else None
    d_table = None
    if table_grad:  # [B, H, n] -> the table's (H or 1, n)
        d_table = dtable.sum(0).sum_to_size(table.shape).to(table.dtype)
    d_sinks = None
    if ctx.needs_input_grad[11] and sinks.numel() > 0:
        d_sinks = sink_grad(sinks, grad_out, out, lse)
    return dq, dk, dv, None, None, None, d_bias, d_table, None, None, None, d_sinks


_attention_op.register_autograd(_backward, setup_context=_setup_context)


# ------------------------------------------------------------------------------------------
# From a call to the op's arguments.

# flattened plans of (L, S)-only mask structures kept for reuse
_FLAT: Bounded[Hashable, tuple[Tensor, Tensor, Tensor]] = Bounded(16)
with torch.inference_mode(False):  # usable outside inference mode too
    _NO_HEADS = torch.empty(0, dtype=torch.long)  # an eager call's heads= when every head is asked
_EMPTY: dict[torch.dtype, Tensor] = {}  # _nothing's shared empty tensors


def _flatten(items: list[Item], device) -> tuple[Tensor, Tensor, Tensor]:
    """The planner's items as the kernel's three tensors (see the ops above)."""
    rows, chunk_rows, keeps = [], [], []
    offset = 0
    for item in items:
        b0, b1 = (-1, -1) if item.batch.start is None else (item.batch.start, item.batch.stop)
        first = len(chunk_rows)
        n_rows = item.q1 - item.q0
        for chunk in item.chunks:
            if chunk.keep is None:
                chunk_rows.append((chunk.start, chunk.stop, -1, 0, 0, 0))
                continue
            cols = chunk.stop - chunk.start
            block = chunk.keep.expand(*chunk.keep.shape[:2], n_rows, cols).contiguous()
            sb = 0 if block.shape[0] == 1 else block.shape[1] * n_rows * cols
            sh = 0 if block.shape[1] == 1 else n_rows * cols
            chunk_rows.append((chunk.start, chunk.stop, offset, sb, sh, cols))
            keeps.append(block.flatten())
            offset += block.numel()
        rows.append((b0, b1, item.q0, item.q1, first, len(chunk_rows)))
    as_long = lambda x: torch.tensor(x, dtype=torch.long).reshape(-1, 6)  # noqa: E731
    keep = torch.cat(keeps) if keeps else torch.zeros(0, dtype=torch.bool)
    return as_long(rows), as_long(chunk_rows), keep.to(device)


def _plan_tensors(call: Call) -> tuple[Tensor, Tensor, Tensor]:
    """The work list for this call, reused across calls when the mask's pattern depends only
    on (L, S) (a training loop plans once). While torch.export traces, the plan is computed
    eagerly: it depends on the mask alone and enters the graph as constants. Under
    torch.compile the planner's host reads would break the graph (whether or not an eager
    call left a plan in the cache, and for every new symbolic shape): a compiled graph runs
    the device-side plan of ``_traced_plan`` instead."""
    if torch.compiler.is_compiling() and not torch.compiler.is_exporting():
        return _traced_plan(call)
    b, _, _, length_q, length_k, _ = call.shape
    args = (call.mask, b, length_q, length_k, _query_tile(call), call.query.device)
    if not torch.compiler.is_exporting():
        return _planned(*args)
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    with unset_fake_temporarily(), disable_proxy_modes_tracing():
        return _planned(*args)


def _query_tile(call: Call) -> int:
    """Query rows per tile of the kernel's plan: tiled's choice, except on a band of finite
    width (a sliding window), where a tile as tall as the band reads twice the keys it sees
    and one a quarter as tall reads 1.25 times (its tasks gather the band's pieces into one
    span of keys, see the kernel's ``attend``)."""
    tile = query_tile(call)
    if call.mask is None:
        return tile
    _, _, _, length_q, length_k, _ = call.shape
    band = call.mask.visible_distances(length_q, length_k)
    if band is None:  # a mask that does not state a band may still be one
        width = _band_width(call.mask, length_q, length_k) if length_q > tile else None
        # tile answers bound a row's keys to whole blocks of keys: round the tile down
        return tile if width is None else max(32, min(tile, width // 4 // 16 * 16))
    lo, hi = band
    if lo is None or hi is None:
        return tile
    return max(32, min(tile, (hi - lo) // 4))


# rows whose visible keys ``_band_width`` reads: a quarter, half and three quarters down
_PROBE_ROWS = (0.25, 0.5, 0.75)


def _band_width(mask, length_q: int, length_k: int) -> int | None:
    """How many keys a row of a mask that does not state its band sees at most, from the
    tile answers of a few single rows, when that is under half the keys: a predicate that
    describes a band or a window then gets the query tiles the built-in band gets (as tall as
    a quarter of the band), not tiles far taller than the band, which read keys no row of
    them sees. None for masks whose rows see most keys. Kept on the mask per (L, S)."""
    kept = mask.memo("band widths", KEPT_ON_MASK)
    key = (length_q, length_k)
    if key not in kept:
        spans = [
            mask.tile(length_q, length_k, r, r + 1, batch=0)
            for r in (int(length_q * f) for f in _PROBE_ROWS)
        ]
        width = max(t.stop - t.start for t in spans)
        kept[key] = width if 0 < width < length_k // 2 else None
    return kept[key]


def _traced_plan(call: Call) -> tuple[Tensor, Tensor, Tensor]:
    """One item over every query row and one chunk over every key, its keep block the mask
    evaluated on the device from its own rule (``Mask.to_dense``): tensor ops only, so a
    compiled graph holds it with symbolic (B, L, S) and reads nothing on the host. Nothing is
    skipped; rows that see no key still output 0 (the kernel's rule)."""
    _, _, _, length_q, length_k, _ = call.shape
    device = call.query.device
    count = lambda *xs: torch.stack(  # noqa: E731  one row of the op's int64 tables
        [torch.full((), x, dtype=torch.long) for x in xs]
    ).reshape(1, -1)
    items = count(-1, -1, 0, length_q, 0, 1)
    if call.mask is None:
        return items, count(0, length_k, -1, 0, 0, 0), torch.zeros(0, dtype=torch.bool)
    keep = call.mask.to_dense(length_q, length_k, device=device)  # [B|1, H|1, L|1, S|1]
    keep = keep.expand(keep.shape[0], keep.shape[1], length_q, length_k).contiguous()
    per_head = length_q * length_k
    stride_b = 0 if keep.shape[0] == 1 else keep.shape[1] * per_head
    stride_h = 0 if keep.shape[1] == 1 else per_head
    chunks = count(0, length_k, 0, stride_b, stride_h, length_k)
    return items, chunks, keep.flatten().to(device)


def _unmasked_plan(length_q: int, length_k: int, device) -> tuple[Tensor, Tensor, Tensor]:
    """The planner's work list for an unmasked call, without planning: one item over every
    query row, reading one chunk of every key (the kernel tiles the rows itself); nothing
    where there are no rows or no keys."""
    if length_q == 0 or length_k == 0:
        items, chunks = torch.zeros(0, 6, dtype=torch.long), torch.zeros(0, 6, dtype=torch.long)
    else:
        items = torch.tensor(((-1, -1, 0, length_q, 0, 1),), dtype=torch.long)
        chunks = torch.tensor(((0, length_k, -1, 0, 0, 0),), dtype=torch.long)
    return items, chunks, torch.zeros(0, dtype=torch.bool, device=device)


def _planned(mask, b, length_q, length_k, tile, device) -> tuple[Tensor, Tensor, Tensor]:
    if mask is None:
        return _unmasked_plan(length_q, length_k, device)
    structure = mask.structure_key
    if structure is None:  # kept on the mask, as its plan is
        kept = mask.memo("fused plans", KEPT_ON_MASK)
        key = (b, length_q, length_k, tile, str(device))
        found = kept.get(key)
        if found is not None:
            return found
        flat = _flatten(plan(mask, b, length_q, length_k, tile, device), device)
        if flat[2].numel() <= KEPT_BITS:
            kept[key] = flat
        return flat
    key = (structure, length_q, length_k, tile, str(device))
    return _FLAT.make(
        key, lambda: _flatten(plan(mask, b, length_q, length_k, tile, device), device)
    )


def _nothing(q: Tensor, dtype: torch.dtype, shared: bool) -> Tensor:
    """The kernel's "none" for a bias, a table or sinks: an empty tensor. ``shared``: one made
    once per dtype (an eager inference call on the CPU, whose arguments nothing keeps)."""
    if not shared or q.device.type != "cpu":
        return q.new_empty(0, dtype=dtype)
    empty = _EMPTY.get(dtype)
    if empty is None:
        with torch.inference_mode(False):  # usable outside inference mode too
            empty = _EMPTY[dtype] = torch.empty(0, dtype=dtype)
    return empty


def _terms(call: Call, shared: bool = False) -> tuple[Tensor, Tensor, int]:
    """(dense bias [B, H, L, S] through broadcast strides or empty, relative table (H|1, n) or
    empty, the table's shift). A modifier that depends on the distance alone becomes a table
    of L + S - 1 values per head; a tensor stays a view of itself; any other modifier is
    lowered to a dense tensor. ``shared``: as ``_nothing``."""
    q = call.query
    stat = stat_dtype(q.dtype)
    empty = _nothing(q, stat, shared)
    bias = call.bias
    if bias is None:
        return empty, empty, 0
    b, h, _, length_q, length_k, _ = call.shape
    if length_q == 0 or length_k == 0:
        return empty, empty, 0
    off = bias.offset(length_q, length_k)
    lo, hi = -(length_q - 1) - off, length_k - off
    table = bias.diagonals(length_q, length_k, lo, hi, device=q.device, dtype=stat)
    if table is not None:
        return empty, table, off + lo
    dense = call.dense_bias(stat)
    return dense.expand(b, h, length_q, length_k), empty, 0


def _args(call: Call, shared: bool = False) -> tuple:
    """The kernel's arguments; ``shared``: as ``_nothing``."""
    items, chunks, keep = _plan_tensors(call)
    bias, table, shift = _terms(call, shared)
    softcap = 0.0 if call.softcap is None else float(call.softcap)
    sinks = _nothing(call.query, call.query.dtype, shared) if call.sinks is None else call.sinks
    return (
        call.query, call.key, call.value, items, chunks, keep, bias, table, shift, call.scale,
        softcap, sinks,
    )  # fmt: skip


def rank(call: Call) -> Rank:
    # it leads only through ``measured``, where it ran faster on this machine
    return Rank(LAST + 10, "the C++ kernel leads only where it measured faster")


def _unsupported(call: Call) -> str | None:
    if call.return_weights and call.needs_grad:
        return "gradients through returned weights run on tiled"
    if call.stats is not None and (call.traced or call.needs_grad):
        return "statistics are folded into eager calls without gradients only"
    if _LOADER.error is not None:
        return _LOADER.error
    return None if built() else NOT_BUILT


def _prepare() -> None:
    build_error()  # an explicit backend="fused" builds the kernel; a failure is remembered


# query rows up to this are decoding for the kernel: keys read in place (kDecodeRows in C++)
_DECODE_ROWS = 16


def _folded(call: Call) -> Call | None:
    """A decoding call's grouped query heads as the rows of one call (``heads_as_rows``), so
    the kernel reads each key and value once per group; None where the call does not fold or
    its groups would be more rows than the kernel's decoding path takes."""
    _, h, h_kv, _, _, _ = call.shape
    return None if h // h_kv > _DECODE_ROWS else heads_as_rows(call)


def run(call: Call) -> tuple[Tensor, Tensor | None]:
    """Raises ``NonFiniteInput`` when a block the kernel read held NaN or ±inf (outside traced
    graphs): the NaN rule's careful path then runs it again on cleaned inputs. A statistics
    call (``Call.stats``) returns them in place of the weights (``stats``)."""
    if call.stats is not None:
        return stats(call)  # type: ignore[return-value]
    weights = None
    traced = call.traced
    heads = _NO_HEADS if call.heads is None else torch.tensor(call.heads, dtype=torch.long)
    if not (traced or call.needs_grad):
        # eager inference calls the kernel itself: the op's dispatch (there for graphs and
        # autograd) costs more than a decoding step's attention leaves to spare
        folded = _folded(call)
        result = build().forward(*_args(folded or call, shared=True), call.return_weights, heads)
        out, weights, bad = result[0], result[2] if call.return_weights else None, result[-1]
        if folded is not None:
            out = out.view(*call.query.shape[:3], out.shape[-1])
    elif call.return_weights:
        out, _, weights, bad = _weights_op(*_args(call), heads)
    else:
        out, _, bad = _attention_op(*_args(call))
    if not traced and bool(bad):
        raise NonFiniteInput
    return out, weights


def prepared(call: Call) -> Callable[[Tensor, Tensor, Tensor], Tensor | None] | None:
    """``Backend.prepared``: the kernel for eager inference calls alike to ``call``, with its
    arguments besides q, k and v (the mask's work list, the bias terms, the cap) made once: a
    decoding step's layers then pay the kernel and little else. For an unmasked call without
    bias it takes keys of any length, the work list made once per length.
    The function returns None where a block the kernel read held NaN or ±inf. None for a
    call ``run`` would not hand to the kernel as it is: gradients, weights, chosen heads, a
    traced graph, or grouped heads that ``run`` would fold itself. (``registry.prepared``
    asks only for a call ``select`` gave this backend: its checks have passed.)"""
    if call.traced or call.needs_grad or call.return_weights or call.heads is not None:
        return None
    if _folded(call) is not None:
        return None
    rest = _args(call, shared=True)[3:]
    forward = build().forward
    _, _, _, length_q, length_k, _ = call.shape
    if call.mask is None and call.bias is None and length_k > 0:
        # unmasked: the function takes keys of any length (a growing cache's steps), with
        # the work list of each length made once (a step's layers share it)
        after = rest[3:]
        last = (length_k, rest[:3])

        def attend_any(query: Tensor, key: Tensor, value: Tensor) -> Tensor | None:
            nonlocal last
            length, plan = last
            if key.shape[2] != length:
                length = key.shape[2]
                plan = _unmasked_plan(length_q, length, query.device)
                last = (length, plan)
            result = forward(query, key, value, *plan, *after, False, _NO_HEADS)
            return None if bool(result[-1]) else result[0]

        return attend_any

    def attend(query: Tensor, key: Tensor, value: Tensor) -> Tensor | None:
        result = forward(query, key, value, *rest, False, _NO_HEADS)
        return None if bool(result[-1]) else result[0]

    return attend


# ------------------------------------------------------------------------------------------
# auto's measurement (``_measure.py``): once per shape class, the kernel against the backend
# auto would pick otherwise, on the call itself; the faster one is remembered for the process.

_MEASURED: dict[Hashable, bool] = {}
_best_time = _measure.best_time  # the clock (tests replace it)


def measured_faster(call: Call, rival: Callable[[Call], object] | None) -> bool | None:
    """True when the kernel ran faster than ``rival`` on a call of this shape class.

    Measured once per class (device, dtype, B * H and L, S in powers of two, GQA groups, head
    dims, mask and bias kind, weights, gradients): each side runs once to warm up, then three
    times (forward only, or forward and backward when the call needs gradients; the rival
    inside the NaN rule's guard, whose pass over the inputs the kernel does not need), and
    the best times are compared; the kernel leads where it was at least 10% faster.
    ``rival=None``: only the answer already known, None when the class has not been measured.
    Nothing is measured while the automatic choice is turned off (``MULTIHEAD_FUSED_AUTO=0``)
    or the
    kernel is not built.
    """
    if _measure.switched_off("MULTIHEAD_FUSED_AUTO") or BACKEND.why_not(call) is not None:
        return False
    # the rival as a call runs it, inside the NaN rule's guard: the kernel checks its inputs
    # as it reads them, a rival that does not pays the guard's pass over q, k and v (at
    # decoding, a second read of the whole cache)
    guarded = None if rival is None else partial(run_guarded, rival)
    return _measure.faster(_MEASURED, call, run, guarded, clock=_best_time)


def _measured(call: Call, rival: Callable[[Call], object] | None) -> bool | None:
    # a stand-in GPU in tests keeps the CPU measurement out
    return measured_faster(call, rival) if call.device_type == "cpu" else False


def _state() -> object:
    loaded = _LOADER.module is not None
    return (loaded, _LOADER.error, _measure.switched_off("MULTIHEAD_FUSED_AUTO"))


BACKEND = Backend(
    run=run,
    rank=rank,
    capabilities=Capabilities(
        label="the fused kernel",
        dtypes=_DTYPES,
        devices=("cpu",),
        weights=True,
        # dropout runs on tiled
        dropout=False,
        softcap=True,
        sinks=True,
        heads=True,
        stats=True,
    ),
    unsupported=_unsupported,
    measured=_measured,
    prepare=_prepare,
    state=_state,
    checks_inputs=True,
    prepared=prepared,
)


# ------------------------------------------------------------------------------------------
# Statistics of the weights without the weights (``multihead.attention_stats``).


def stats(call: Call) -> tuple[Tensor, dict[str, Tensor]]:
    """The output of ``call`` and the statistics ``call.stats`` of the query heads
    ``call.heads`` (all by default), folded inside the kernel's pass from each row's scores,
    maximum and sum (the weights are never written): the kernel's weights path with a sum in
    place of the store. Key statistics and ``head_mean`` add to different places (a head's
    keys, a row's keys across heads), so asking for both runs the kernel twice.
    ``window_mass`` sums the rows from ``call.window_row``. Raises ``NonFiniteInput`` as
    ``run`` does (eager inference calls only: no graph, no gradient)."""
    names = call.stats
    assert names is not None
    heads = range(call.query.shape[1]) if call.heads is None else call.heads
    index = torch.tensor(list(heads), dtype=torch.long)
    args = _args(call, shared=True)
    found: dict[str, Tensor] = {}
    out = None
    for asked in _passes(names):
        result = build().forward_stats(*args, index, asked, call.window_row)
        if bool(result[-1]):
            raise NonFiniteInput
        out = result[0] if out is None else out
        found.update({n: result[2 + STATS.index(n)] for n in asked})
    assert out is not None
    return out, {n: found[n] for n in names}


def _passes(names: tuple[str, ...]) -> list[list[str]]:
    """The kernel passes that compute ``names``: key statistics and ``head_mean`` add to
    different places, so they take a pass each; entropy joins either."""
    keyed = [n for n in names if n != "head_mean"]
    if "head_mean" not in names:
        return [keyed]
    if not any(n in KEY_STATS for n in keyed):
        return [["head_mean", *keyed]]
    return [keyed, ["head_mean"]]
