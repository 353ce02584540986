"""FlexAttention built from the masks' own answers, compiled once per structure and shape.

The mask lowers itself: per block of query rows ``tile`` names the key range worth looking at,
and ``rect_kind`` says whether each (query block, key block) pair inside it is empty, full or
partial. That gives FlexAttention's ``BlockMask`` directly (``create_block_mask`` would
evaluate the predicate on all L x S pairs instead); the mask's ``mask_mod`` decides the partial
blocks and the score modifier's ``score_mod`` adds the bias inside the generated kernel.

``torch.compile`` turns ``flex_attention`` into one fused kernel per mask structure, bias
structure, shape and dtype; each is compiled on first use (seconds to tens of seconds on a small
CPU, listed by ``compile_log``) and cached for the process. A structure Inductor cannot compile
is remembered and raised as ``BackendUnavailable``: the registry runs the call on the next
backend ``auto`` would pick, and later calls report the failure through ``unsupported`` (and
so ``explain_backend``). On CPU, Inductor compiles FlexAttention for inference only.
"""

from __future__ import annotations

import functools
import itertools
import math
import sys
import sysconfig
import time
import types
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch
from torch import Tensor

from .._cache import Bounded
from ..masks import Mask, TileKind
from ._tensors import stat_dtype
from .call import Call, structured
from .protocol import LAST, LEADS, Backend, BackendUnavailable, Capabilities, Rank

__all__ = [
    "BACKEND",
    "BLOCK",
    "CompileRecord",
    "block_mask",
    "clear_cache",
    "compile_log",
    "measured_faster",
    "rank",
    "run",
]

BLOCK = 128  # query rows and keys per sparse block: FlexAttention's default (64 ran no faster)
_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # Inductor's CPU template
_CUDA_MIN_HEAD_DIM = 16
_KERNELS_KEPT = 32  # compiled kernels kept per process (least recently used dropped first)
_BLOCK_MASKS_KEPT = 16  # block masks of (L, S)-only structures kept for reuse

# where auto leads with it on CPU (docs/guides/backends.md, "FlexAttention backend"): float32
# sliding windows this narrow over at least this many query rows
_CPU_MIN_ROWS = 4096
_CPU_MAX_SPAN = 512  # before + after of the window


@dataclass(frozen=True)
class CompileRecord:
    """One compile of the FlexAttention kernel: what it was for and how long it took.

    ``seconds`` covers tracing, Inductor's code generation and C++/Triton compilation and the
    first call; ``error`` is None when it succeeded, else the first line of the failure.
    """

    what: str
    seconds: float
    error: str | None


@dataclass
class _Kernel:
    fn: Callable
    compiled: bool = False  # set after the first successful call


_kernels: Bounded[Hashable, _Kernel] = Bounded(_KERNELS_KEPT)
_block_masks: Bounded[Hashable, object] = Bounded(_BLOCK_MASKS_KEPT)
_failures: dict[Hashable, str] = {}
_log: list[CompileRecord] = []
_tags = itertools.count()


def compile_log() -> list[CompileRecord]:
    """Every compile this process ran, oldest first (a copy)."""
    return list(_log)


def clear_cache() -> None:
    """Forget compiled kernels, cached block masks, remembered failures and the log."""
    _kernels.clear()
    _block_masks.clear()
    _failures.clear()
    _log.clear()


@functools.cache
def _compile_supported() -> bool:
    """torch.compile's check of the Python it runs on (``torch._dynamo.is_dynamo_supported``),
    without importing dynamo to ask: that import takes 1.5 s, and the first call of a process
    that ``auto`` merely ranks flex for would pay it. The same rule as torch 2.13's: Python
    below 3.15, and not a free-threaded build below 3.13.3 (a test compares the two)."""
    if "torch._dynamo" in sys.modules:
        return bool(torch._dynamo.is_dynamo_supported())
    free_threaded = sysconfig.get_config_var("Py_GIL_DISABLED") == 1
    return sys.version_info < (3, 15) and not (free_threaded and sys.version_info < (3, 13, 3))


def _unsupported(call: Call) -> str | None:
    """What the capabilities cannot say: tracing, sizes, CPU limits, earlier failures."""
    if call.exported:
        return "an exported graph needs plain ops; FlexAttention needs torch.compile"
    if call.traced:
        return (
            "inside torch.compile the surrounding graph is compiled as a whole; the flex "
            "backend's own compiled kernels are for eager callers"
        )
    _, _, _, length_q, length_k, _ = call.shape
    if length_q == 0 or length_k == 0:
        return f"FlexAttention needs L > 0 and S > 0; received L={length_q}, S={length_k}"
    if not _compile_supported():
        return "torch.compile is not supported on this Python version"
    dtype = call.query.dtype
    d, d_v = call.query.shape[-1], call.value.shape[-1]
    if call.device_type == "cuda" and min(d, d_v) < _CUDA_MIN_HEAD_DIM:
        # Inductor refuses to lower it ("NYI: embedding dimension ... must be at least 16"):
        # say so here instead of failing a compile
        return (
            f"Inductor's CUDA FlexAttention kernel needs head dims of at least "
            f"{_CUDA_MIN_HEAD_DIM}; received D={d}, D_v={d_v}"
        )
    if call.query.device.type == "cpu":
        if dtype not in _CPU_DTYPES:
            return (
                "Inductor's CPU FlexAttention kernel takes float32, bfloat16 or float16; "
                f"received {dtype}"
            )
        if call.needs_grad:
            return (
                "FlexAttention has no CPU backward (Inductor compiles it on CPU for inference "
                "only); call under torch.no_grad() or use tiled for training"
            )
    failure = _failures.get(_structure(call)) if _failures else None
    if failure is not None:
        return (
            f"Inductor failed to compile FlexAttention for this mask and bias earlier ({failure})"
        )
    return None


def rank(call: Call) -> Rank:
    # the registry skips this rank when the call is unsupported: no need to ask here
    if call.device_type == "cuda" and structured(call):
        # FlexAttention generates one fused kernel that skips the mask's empty blocks, where
        # tiled's per-chunk torch ops would be many small kernel launches
        return Rank(LEADS, "its one compiled kernel skips the blocks the mask hides")
    # not while exporting: measured_faster compares L with a threshold, and a symbolic L
    # would turn that comparison into a bound on the exported graph's length axis
    if call.device_type == "cpu" and not call.exported and measured_faster(call):
        return Rank(
            LEADS,
            "its compiled kernel measured faster than tiled on long sliding windows "
            "(compiled once per shape, the compile time not counted)",
        )
    return Rank(LAST + 5, "it compiles a kernel per mask structure and shape")


def measured_faster(call: Call) -> bool:
    """True where the compiled kernel measured faster than tiled on CPU: a float32 sliding
    window (a band bounded on both sides, before + after <= 512) over at least 4096 query
    rows, without a bias. Compile time is not counted: it is paid once per shape."""
    _, _, _, length_q, length_k, _ = call.shape
    if call.mask is None or call.bias is not None or call.query.dtype != torch.float32:
        return False
    if length_q < _CPU_MIN_ROWS:
        return False
    band = call.mask.visible_distances(length_q, length_k)
    if band is None or band[0] is None or band[1] is None:
        return False
    return band[1] - band[0] <= _CPU_MAX_SPAN


def block_mask(
    mask: Mask,
    length_q: int,
    length_k: int,
    *,
    batch_size: int = 1,
    device: torch.device | str | None = None,
    block_size: int | None = None,
    q_blocks: bool = True,
):
    """The mask as a FlexAttention ``BlockMask`` for (L, S), built from its own answers.

    For every ``block_size`` block of query rows, ``mask.tile`` bounds the key blocks worth
    asking about and ``mask.rect_kind`` classifies each: EMPTY blocks are left out, FULL ones
    run without the predicate, PARTIAL ones apply ``mask.mask_mod``. Blocks that run past L or
    S count as partial, as in ``create_block_mask``. Work is one ``tile`` call per query block
    and one ``rect_kind`` call per candidate block, never a pass over L x S.

    Args:
        mask: any ``multihead.masks.Mask``.
        batch_size: B; the block mask has B rows when the mask depends on the batch entry,
            else one that broadcasts.
        block_size: query rows and keys per block (default ``BLOCK``, 128).
        q_blocks: also build the transposed index the backward pass needs.

    Returns:
        ``torch.nn.attention.flex_attention.BlockMask`` of shape (B or 1, 1, L, S); its
        ``to_string()`` draws the blocks and ``sparsity()`` gives the share skipped.
    """
    from torch.nn.attention.flex_attention import BlockMask

    block_size = BLOCK if block_size is None else block_size
    rows = list(range(batch_size)) if mask.batch_size is not None else [0]
    n_q, n_k = math.ceil(length_q / block_size), math.ceil(length_k / block_size)
    partial = torch.zeros(len(rows), 1, n_q, n_k, dtype=torch.int32)
    full = torch.zeros(len(rows), 1, n_q, n_k, dtype=torch.int32)
    marks: dict[bool, list[tuple[int, int, int]]] = {True: [], False: []}
    for r, b in enumerate(rows):
        for i in range(n_q):
            q0, q1 = i * block_size, min((i + 1) * block_size, length_q)
            t = mask.tile(length_q, length_k, q0, q1, batch=b)
            if t.kind == TileKind.EMPTY:
                continue
            for j in range(t.start // block_size, math.ceil(t.stop / block_size)):
                k0, k1 = j * block_size, min((j + 1) * block_size, length_k)
                kind = mask.rect_kind(length_q, length_k, q0, q1, k0, k1, batch=b)
                if kind == TileKind.EMPTY:
                    continue
                whole = q1 - q0 == block_size and k1 - k0 == block_size
                marks[kind == TileKind.FULL and whole].append((r, i, j))
    for is_full, where in marks.items():
        if where:
            r, i, j = torch.tensor(where).unbind(1)
            (full if is_full else partial)[r, 0, i, j] = 1

    def ordered(dense: Tensor) -> tuple[Tensor, Tensor]:
        # FlexAttention's layout: per query block, the count and then the listed key blocks
        count = dense.sum(dim=-1, dtype=torch.int32)
        index = torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32)
        return count.to(device), index.to(device)

    return BlockMask.from_kv_blocks(
        *ordered(partial),
        *ordered(full),
        BLOCK_SIZE=block_size,
        mask_mod=mask.mask_mod(length_q, length_k, device=device),
        seq_lengths=(length_q, length_k),
        compute_q_blocks=q_blocks,
    )


def run(call: Call) -> tuple[Tensor, Tensor | None]:
    q, k, v = call.query, call.key, call.value
    _, h, h_kv, length_q, length_k, _ = call.shape
    blocks = None if call.mask is None else _cached_block_mask(call)
    score_mod = None
    if call.bias is not None:
        add = call.bias.score_mod(length_q, length_k, device=q.device)
        stat = stat_dtype(q.dtype)

        def score_mod(score, b, head, q_idx, kv_idx):
            # the bias rule: scores plus bias in float32 (float64 beside float64). The function
            # is traced with a score of the input dtype, so casting to score.dtype would round
            # the sum to bf16/fp16
            return add(score, b, head, q_idx, kv_idx).to(stat)

    if q.device.type == "cpu" and length_k % BLOCK:
        k, v, blocks, score_mod = _padded(k, v, blocks, score_mod, length_q, length_k)
    key = _kernel_key(call)
    kernel = _kernels.make(key, lambda: _Kernel(_compile(f"{next(_tags)}")))
    args = (q, k, v, score_mod, blocks, call.scale, h != h_kv)
    if kernel.compiled:
        return kernel.fn(*args), None
    start = time.perf_counter()
    try:
        out = kernel.fn(*args)
    except Exception as e:  # Inductor's failures come in many types; all mean "cannot compile"
        del _kernels[key]
        first_line = (str(e).strip().splitlines() or [""])[0][:200]
        why = f"{type(e).__name__}: {first_line}"
        _failures[_structure(call)] = why
        _log.append(CompileRecord(_describe(call), time.perf_counter() - start, why))
        # its rule reports the failure from now on, so auto picks another backend
        raise BackendUnavailable(
            f"FlexAttention could not be compiled for this mask and bias ({why})"
        ) from e
    kernel.compiled = True
    _log.append(CompileRecord(_describe(call), time.perf_counter() - start, None))
    return out, None


def _padded(key: Tensor, value: Tensor, blocks, score_mod, length_q: int, length_k: int):
    """Keys and values padded with zeros to a whole number of key blocks, and a block mask
    and score function that never let a query see the padding. Inductor's CPU kernel (torch
    2.13) loads the last key block whole and multiplies its masked weights (0) by what lies
    past the tensor's end: NaN there turns the last (batch, head)'s rows to NaN, seen with S
    = 72, 88 or 104 (tests/masks/test_predicate.py). Padding puts zeros in that place; the
    mask and the bias read a key index clamped to S - 1, so neither indexes past its tensors."""
    from torch.nn.attention.flex_attention import BlockMask

    pad = -length_k % BLOCK
    key = torch.nn.functional.pad(key, (0, 0, 0, pad))
    value = torch.nn.functional.pad(value, (0, 0, 0, pad))
    last = length_k - 1
    if blocks is None:
        n_q, n_k = math.ceil(length_q / BLOCK), math.ceil(length_k / BLOCK)
        partial = torch.full((1, 1, n_q), 1, dtype=torch.int32)
        partial_index = torch.arange(n_k - 1, -1, -1, dtype=torch.int32).expand(1, 1, n_q, n_k)
        full = torch.full((1, 1, n_q), n_k - 1, dtype=torch.int32)
        full_index = torch.arange(n_k, dtype=torch.int32).expand(1, 1, n_q, n_k)
        inner = None
        parts = [t.to(key.device).contiguous() for t in (partial, partial_index, full, full_index)]
    else:
        inner = blocks.mask_mod
        parts = [
            blocks.kv_num_blocks,
            blocks.kv_indices,
            blocks.full_kv_num_blocks,
            blocks.full_kv_indices,
        ]

    def mask_mod(b, head, q_idx, kv_idx):
        seen = kv_idx <= last
        if inner is None:
            return seen
        return seen & inner(b, head, q_idx, torch.clamp(kv_idx, max=last))

    padded = BlockMask.from_kv_blocks(
        *parts,
        BLOCK_SIZE=BLOCK,
        mask_mod=mask_mod,
        seq_lengths=(length_q, length_k + pad),
        compute_q_blocks=blocks is not None and blocks.q_num_blocks is not None,
    )
    if score_mod is None:
        return key, value, padded, None
    add = score_mod

    def clamped(score, b, head, q_idx, kv_idx):
        return add(score, b, head, q_idx, torch.clamp(kv_idx, max=last))

    return key, value, padded, clamped


def _attend(query, key, value, score_mod, block_mask, scale, enable_gqa):
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(
        query,
        key,
        value,
        score_mod=score_mod,
        block_mask=block_mask,
        scale=scale,
        enable_gqa=enable_gqa,
    )


def _compile(tag: str) -> Callable:
    """A compiled ``_attend`` of its own: torch.compile caches per code object and stops
    compiling (falling back to eager, which builds L x S scores) after a few recompiles, so
    every cache entry gets a fresh code object and compiles exactly once."""
    code = _attend.__code__.replace(co_name=f"_attend_{tag}")
    fn = types.FunctionType(code, _attend.__globals__, code.co_name)
    return torch.compile(fn, dynamic=False, fullgraph=True)


def _cached_block_mask(call: Call):
    b, _, _, length_q, length_k, _ = call.shape
    device, grad = call.query.device, call.needs_grad
    structure = call.mask.structure_key
    if structure is None:  # the pattern depends on the mask's tensors: build it every call
        return block_mask(call.mask, length_q, length_k, batch_size=b, device=device, q_blocks=grad)
    key = (structure, length_q, length_k, str(device), grad, BLOCK)
    return _block_masks.make(
        key, lambda: block_mask(call.mask, length_q, length_k, device=device, q_blocks=grad)
    )


def _structure(call: Call, sizes: bool = False) -> Hashable:
    """What a compile failure is remembered under: the mask's and the bias's structure (their
    predicate code and what they read), dtype and device; with ``sizes``, also the sizes of
    the tensors they read."""
    _, _, _, length_q, length_k, _ = call.shape
    device = call.query.device
    parts: list[Hashable] = []
    for part, fn in ((call.mask, "mask_mod"), (call.bias, "score_mod")):
        key = None if part is None else part.structure_key
        if part is not None and key is None:
            key = _signature(getattr(part, fn)(length_q, length_k, device=device), sizes)
        parts.append(key)
    return (*parts, call.query.dtype, device.type)


def _kernel_key(call: Call) -> Hashable:
    """A compiled kernel serves calls with equal structure, shapes, scale and grad mode."""
    shapes = tuple(tuple(t.shape) for t in (call.query, call.key, call.value))
    return (_structure(call, sizes=True), shapes, call.scale, call.needs_grad, BLOCK)


def _describe(call: Call) -> str:
    b, h, h_kv, length_q, length_k, d = call.shape
    # a mask's repr may go on with a small picture of itself: keep its first line
    mask = "no mask" if call.mask is None else repr(call.mask).splitlines()[0]
    bias = "" if call.bias is None else f", bias {call.bias!r}"
    kv = f"{h_kv} kv heads, " if h_kv != h else ""
    return (
        f"{mask}{bias}: B={b} H={h} {kv}L={length_q} S={length_k} D={d} "
        f"{str(call.query.dtype).removeprefix('torch.')} on {call.query.device.type}"
    )


def _signature(obj: object, sizes: bool = True, depth: int = 0) -> Hashable:
    """A hashable description of a predicate or score function as torch.compile sees it: its
    code, and the values it closes over (tensors by dtype, device and, with ``sizes``, shape;
    numbers by value; objects by their attributes)."""
    if depth > 6:
        return ("deep", id(obj))
    if isinstance(obj, Tensor):
        shape = tuple(obj.shape) if sizes else obj.dim()
        return ("tensor", shape, obj.dtype, obj.device.type)
    if obj is None or isinstance(obj, (bool, int, float, str, torch.dtype, torch.device)):
        return obj
    inner = functools.partial(_signature, sizes=sizes, depth=depth + 1)
    if isinstance(obj, (tuple, list)):
        return tuple(map(inner, obj))
    if isinstance(obj, dict):
        return tuple((k, inner(v)) for k, v in sorted(obj.items(), key=str))
    if isinstance(obj, types.FunctionType):
        cells = []
        for cell in obj.__closure__ or ():
            try:
                cells.append(inner(cell.cell_contents))
            except ValueError:  # a cell not yet bound
                cells.append(("unbound",))
        return (obj.__code__, tuple(cells))
    if isinstance(obj, types.MethodType):
        return ("method", obj.__func__.__code__, inner(obj.__self__))
    if hasattr(obj, "__dict__"):
        return (type(obj), inner(vars(obj)))
    return ("object", id(obj))


BACKEND = Backend(
    run=run,
    rank=rank,
    capabilities=Capabilities(label="FlexAttention", weights=False, dropout=False),
    unsupported=_unsupported,
    state=lambda: len(_failures),  # a compile that failed changes what it answers
    compiles=True,  # once per mask structure and shape: auto never times it on a proxy
)
