"""Context parallelism: exact attention over one sequence split across processes.

Each rank holds a contiguous shard of the queries and of the keys/values (rank order = sequence
order). Key/value shards travel around a ring: at step t rank r holds the shard of rank r - t,
computes its queries against it with the tiled kernel (which returns the log-sum-exp), and
merges the partial result exactly through the log-sum-exp, while the shard of the next step is
already in flight (batched isend/irecv). The mask's tile answers say which shards a rank's
queries can see at all; the others are forwarded without any compute.

The backward pass is a second ring: the key/value shards travel again, each with its dK/dV
accumulator, and every rank adds its queries' contribution before passing it on; one more hop
brings each accumulator home. Gradients of bias tensors (an ALiBi slope, a T5 table) are summed
over ranks with ``all_reduce``, so every rank holds the gradient of the whole.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch import Tensor

from .. import _validation as V
from .. import masks
from ..backends import tiled
from ..backends._call import Call, prepare, stat_dtype
from ..bias import ScoreModifier
from ..masks import Mask, TileKind, dense

__all__ = ["ProcessGroupError", "context_attention", "visible_shards"]

# every rank describes its inputs in one small int64 vector; one all_gather tells every rank the
# shard lengths of all the others and lets all of them reject a mismatch together
_FIELDS = ("ok", "B", "H", "H_kv", "D", "D_v", "L", "S", "dtype", "mask", "bias", "grad")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_KV_TAG, _ACC_TAG = 0, 1  # gloo matches messages by tag (NCCL ignores tags)


class ProcessGroupError(RuntimeError, ValueError):
    """No usable process group: none initialized, or this process is not in the given group.

    A RuntimeError like torch.distributed's own, and a ValueError like every other input error
    of this library, so either ``except`` catches it.
    """


def visible_shards(
    mask: Mask | Tensor | None,
    query_lengths: Sequence[int],
    key_lengths: Sequence[int] | None = None,
) -> list[list[bool]]:
    """Which key shards each query shard may see, from the mask's tile answers alone.

    Entry ``[r][j]`` is True when some query of shard r may see some key of shard j (for any
    batch entry); ``context_attention`` computes exactly those pairs and only forwards the
    others. With P equal shards a causal mask leaves P (P + 1) / 2 of the P * P pairs, a
    sliding window narrower than a shard about 2 P.

    Args:
        mask: the mask of the whole sequence (as passed to ``context_attention``), or None.
        query_lengths: L_r of every rank, in rank order (the whole has L = sum of them).
        key_lengths: S_r of every rank; default: the same as ``query_lengths``.

    Example (causal, 4 equal shards; ``#`` = computed)::

        # . . .
        # # . .
        # # # .
        # # # #
    """
    if isinstance(mask, Tensor):
        V.check_mask_tensor_dtype("mask", mask)
        mask = dense(mask)
    query_cuts = _cuts("query_lengths", query_lengths)
    key_cuts = query_cuts if key_lengths is None else _cuts("key_lengths", key_lengths)
    if len(key_cuts) != len(query_cuts):
        raise ValueError(
            "query_lengths and key_lengths need one entry per rank each. "
            f"Received: {len(query_cuts) - 1} query shards, {len(key_cuts) - 1} key shards"
        )
    whole = (query_cuts[-1], key_cuts[-1])
    return [
        [_sees(mask, *whole, q0, q1, k0, k1) for k0, k1 in itertools.pairwise(key_cuts)]
        for q0, q1 in itertools.pairwise(query_cuts)
    ]


def _cuts(name: str, lengths: Sequence[int]) -> tuple[int, ...]:
    values = list(lengths)
    if not values or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in values):
        raise ValueError(
            f"{name} must be a non-empty list of shard lengths (ints >= 0), one per rank. "
            f"Received: {name}={lengths!r}"
        )
    return (0, *itertools.accumulate(values))


def _sees(
    mask: Mask | None, length_q: int, length_k: int, q0: int, q1: int, k0: int, k1: int
) -> bool:
    """True when some query in [q0, q1) may see some key in [k0, k1), for some batch entry."""
    if q0 == q1 or k0 == k1:
        return False
    if mask is None:
        return True
    # a mask without its own batch dimension answers alike for every batch entry
    for b in range(mask.batch_size or 1):
        t = mask.tile(length_q, length_k, q0, q1, batch=b)
        if t.kind != TileKind.EMPTY and t.start < k1 and k0 < t.stop:
            return True
    return False


@dataclass(frozen=True)
class _Ring:
    """The ring of one call: who is next, who is previous, and where every shard lies."""

    group: dist.ProcessGroup | None
    rank: int
    world: int
    query_cuts: tuple[int, ...]  # shard r holds queries [query_cuts[r], query_cuts[r + 1])
    key_cuts: tuple[int, ...]
    next_peer: int  # global ranks (what P2POp wants)
    prev_peer: int

    def source(self, step: int) -> int:
        """The rank whose key/value shard this rank holds at ``step``."""
        return (self.rank - step) % self.world

    def key_length(self, j: int) -> int:
        return self.key_cuts[j + 1] - self.key_cuts[j]

    def exchange(self, send: list[Tensor], recv: list[Tensor], tag: int) -> list:
        """Send to the next rank and receive from the previous one, all at once; returns the
        requests to wait on. Empty tensors travel as nothing (both ends know the sizes)."""
        ops = [
            dist.P2POp(dist.isend, t, self.next_peer, self.group, tag) for t in send if t.numel()
        ]
        ops += [
            dist.P2POp(dist.irecv, t, self.prev_peer, self.group, tag) for t in recv if t.numel()
        ]
        return dist.batch_isend_irecv(ops) if ops else []


@dataclass(frozen=True)
class _Piece:
    """Rows [r0, r1) of this rank's queries against keys [c0, c1) of one key shard (both in
    shard coordinates); ``full``: every pair is visible, so the kernel runs without a mask."""

    r0: int
    r1: int
    c0: int
    c1: int
    full: bool


@dataclass(frozen=True)
class _Plan:
    """Everything both ring passes need besides the tensors."""

    ring: _Ring
    whole: Call  # mask, bias and scale of the whole (L, S) problem (placeholder tensors)
    visible: tuple[bool, ...]  # key shard j is computed by this rank
    split: dict[int, list[_Piece]] = field(default_factory=dict, compare=False)

    def box(self, j: int) -> tuple[int, int, int, int]:
        """(q0, q1, k0, k1): this rank's queries and shard j's keys in the whole."""
        ring = self.ring
        return (*ring.query_cuts[ring.rank : ring.rank + 2], *ring.key_cuts[j : j + 2])

    def pieces(self, j: int) -> list[_Piece]:
        """The kernel calls for key shard j, worked out once for both passes."""
        if j not in self.split:
            q0, q1, k0, k1 = self.box(j)
            rows, cols = q1 - q0, k1 - k0
            mask = self.whole.mask
            band = None
            if mask is not None:
                band = mask.crop(*self.size, q0, q1, k0, k1).visible_distances(rows, cols)
            if mask is None:
                self.split[j] = [_Piece(0, rows, 0, cols, True)]
            elif band is None:  # documents, padding, dense: the kernel plans the whole block
                self.split[j] = [_Piece(0, rows, 0, cols, False)]
            else:
                self.split[j] = _band_pieces(*band, rows, cols, _BAND_ROWS, _MIN_FULL)
        return self.split[j]

    @property
    def size(self) -> tuple[int, int]:
        return self.ring.query_cuts[-1], self.ring.key_cuts[-1]

    def call(self, q: Tensor, k: Tensor, v: Tensor, j: int, piece: _Piece) -> Call:
        """One piece of this rank's queries against key shard j, with the mask and bias
        cropped to it (no mask where every pair is visible)."""
        q0, _, k0, _ = self.box(j)
        box = (q0 + piece.r0, q0 + piece.r1, k0 + piece.c0, k0 + piece.c1)
        whole = self.whole
        mask = None if piece.full else whole.mask.crop(*self.size, *box)
        if mask is not None:
            mask = _same_band(mask, piece.r1 - piece.r0, piece.c1 - piece.c0) or mask
        bias = None if whole.bias is None else whole.bias.crop(*self.size, *box)
        cols = slice(piece.c0, piece.c1)
        return replace(
            whole,
            query=q[:, :, piece.r0 : piece.r1],
            key=k[:, :, cols],
            value=v[:, :, cols],
            mask=mask,
            bias=bias,
        )


# A band mask (causal, sliding window) over a long shard is cut into blocks of query rows, each
# with its fully visible key range as one unmasked kernel call and only the strips along the
# band's edges left to the tiled kernel's planner, which lowers partly visible ranges to bool
# blocks: handing it a whole causal shard costs O(L_r * S_r) bool work before any compute.
_BAND_ROWS = 1024  # query rows per block
_MIN_FULL = 256  # narrowest fully visible key range worth a kernel call of its own


def _same_band(mask: Mask, rows: int, cols: int) -> Mask | None:
    """A causal or sliding-window mask with exactly the pattern ``mask`` has on a (rows, cols)
    block, or None. A crop's structure key holds its offsets, so the tiled kernel would plan
    every block anew; the plain band's key depends on its distances alone, so every block of
    the same shape (one per row block of a long shard) shares one cached plan."""
    band = mask.visible_distances(rows, cols)
    if band is None or band[1] is None:
        return None
    lo, hi = band
    if lo is None:
        candidates = [masks.causal(), masks.causal(align="top_left")]
    else:
        candidates = []
        for align, offset in (("top_left", 0), ("bottom_right", cols - rows)):
            before, after = offset - lo, hi - offset
            if before >= 0 and after >= 0:
                candidates.append(masks.sliding_window(before, after, align=align))
    for candidate in candidates:  # the mask's own description decides, not its class
        if candidate.visible_distances(rows, cols) == band:
            return candidate
    return None


def _band_pieces(
    lo: int | None, hi: int | None, rows: int, cols: int, block_rows: int, min_full: int
) -> list[_Piece]:
    """The pieces of a (rows, cols) block in which query i sees key j exactly when
    lo <= j - i <= hi (None: unbounded), in order of rows."""

    def clip(x: int) -> int:
        return min(max(x, 0), cols)

    pieces: list[_Piece] = []
    for r0 in range(0, rows, block_rows):
        r1 = min(r0 + block_rows, rows)
        # some row of the block sees [first, stop); every row sees [every0, every1)
        first = 0 if lo is None else clip(r0 + lo)
        stop = cols if hi is None else clip(r1 + hi)
        if first >= stop:
            continue
        every0 = 0 if lo is None else clip(r1 - 1 + lo)
        every1 = cols if hi is None else clip(r0 + hi + 1)
        whole_block = (every0, every1) == (first, stop)
        if every1 - every0 < min_full and not whole_block:
            pieces.append(_Piece(r0, r1, first, stop, False))
            continue
        last = pieces[-1] if pieces else None
        if last and last.full and (last.c0, last.c1, last.r1) == (every0, every1, r0):
            pieces[-1] = _Piece(last.r0, r1, every0, every1, True)  # one call for both blocks
        else:
            pieces.append(_Piece(r0, r1, every0, every1, True))
        if first < every0:
            pieces.append(_Piece(r0, r1, first, every0, False))
        if every1 < stop:
            pieces.append(_Piece(r0, r1, every1, stop, False))
    return pieces


def context_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Mask | Tensor | None = None,
    *,
    bias: Tensor | ScoreModifier | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    group: dist.ProcessGroup | None = None,
    **unexpected: object,
) -> Tensor:
    """Exact attention over a sequence split across the ranks of a process group.

    Every rank passes its contiguous shard of the sequence (rank order = sequence order) and
    gets its shard of the output, equal to rows [L_0 + ... + L_{r-1}, ... + L_r) of
    ``multihead.attention`` on the whole. Shards may differ in length (even be empty).
    Key/value shards travel around a ring (batched isend/irecv, overlapping the compute) and
    partial results merge exactly through the log-sum-exp; shards the mask hides from a rank's
    queries (half of them under a causal mask, all but the neighbours under a sliding window)
    are forwarded without compute. Differentiable: backward is a second ring pass, and every
    rank must run it (as with DDP), because it communicates.

    Equivalent to (on one process, with the shards concatenated)::

        out = multihead.attention(cat(queries), cat(keys), cat(values), mask, bias=bias)
        out_r = out[:, :, L_0 + ... + L_{r-1} : L_0 + ... + L_r]

    Args:
        query: (B, H, L_r, D), this rank's queries.
        key: (B, H_kv, S_r, D), this rank's keys. H_kv divides H (grouped-query attention).
        value: (B, H_kv, S_r, D_v).
        mask: a mask of the *whole* sequence (L = sum of L_r, S = sum of S_r), the same on
            every rank (e.g. ``masks.causal()``, ``masks.documents(ids)`` with the ids of all
            L positions), a bool tensor, or None.
        bias: a score modifier (``multihead.bias.alibi``, ``relative_buckets``) or a float
            tensor for the whole sequence, the same on every rank. Gradients of its tensors
            are summed over ranks: each rank receives the gradient of the whole.
        scale: multiplies the scores; default 1 / sqrt(D).
        dropout_p: must be 0 (see Raises).
        group: the process group (default: the default group). Works with gloo on CPU and
            nccl on CUDA.

    Returns:
        (B, H, L_r, D_v): this rank's rows of the output. A query that sees no key gives 0.

    Raises:
        ProcessGroupError: no process group is initialized, or this process is not in
            ``group``.
        ValueError: on every rank when any rank's inputs are invalid or the ranks disagree on
            B, H, H_kv, D, D_v, dtype, whether a mask or bias was given or whether gradients
            are needed; dropout (the ring passes would need the same random draws on every
            rank).
        TypeError: SDPA keywords and other unexpected keywords; ``return_weights`` (there are
            no weights: each rank's rows span every shard, more than one process holds).
    """
    rank, world = _membership(group)
    error: Exception | None = None
    try:
        _check_local(query, key, value, dropout_p, unexpected)
        _check_device(dist.get_backend(group), query.device)
    except (TypeError, ValueError) as err:
        error = err
    needs_grad = error is None and _needs_grad(query, key, value, bias)
    table = _gather(query, key, value, mask, bias, needs_grad, error, group, rank, world)
    ring = _ring(table, group, rank, world)
    row = table[0]
    b, h, h_kv, d, d_v = (row[_FIELDS.index(f)] for f in ("B", "H", "H_kv", "D", "D_v"))
    one = torch.zeros((), dtype=query.dtype, device=query.device)
    # the whole problem's mask and bias, validated once against (B, H, L, S); the same objects
    # on every rank, so every rank raises the same error here
    whole = prepare(
        one.expand(b, h, ring.query_cuts[-1], d),
        one.expand(b, h_kv, ring.key_cuts[-1], d),
        one.expand(b, h_kv, ring.key_cuts[-1], d_v),
        mask,
        bias,
        scale,
        0.0,
        False,
    )
    if whole.sinks is not None:
        raise ValueError(
            "context_attention has no attention sinks: a sink joins a row's softmax once, "
            "after every shard has merged. Received: bias with sinks"
        )
    q0, q1 = ring.query_cuts[rank : rank + 2]
    size = (ring.query_cuts[-1], ring.key_cuts[-1])
    visible = tuple(
        _sees(whole.mask, *size, q0, q1, *ring.key_cuts[j : j + 2]) for j in range(world)
    )
    plan = _Plan(ring, whole, visible)
    if needs_grad:
        return _RingAttention.apply(query, key, value, plan, *whole.bias_tensors)
    with torch.no_grad():
        return _forward(plan, query, key, value)[0]


def _membership(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(rank in group, group size), or a ProcessGroupError that says how to set one up."""
    if not dist.is_available():
        raise ProcessGroupError(
            "context_attention needs torch.distributed, which this torch build lacks; install "
            "a build with distributed support. Received: torch.distributed.is_available()=False"
        )
    if not dist.is_initialized():
        raise ProcessGroupError(
            "context_attention needs an initialized process group: launch one process per "
            "shard (torchrun --nproc-per-node P script.py, or torch.multiprocessing) and call "
            "torch.distributed.init_process_group('gloo') on CPU or ('nccl') on GPUs first. "
            "Received: no default process group"
        )
    # dist.new_group returns this marker, not a group, on the ranks it leaves out
    if group is not None and group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ProcessGroupError(
            "this process is not a member of the given group; call context_attention only on "
            f"the ranks of that group. Received: global rank {dist.get_rank()}, a group made "
            "without it (dist.GroupMember.NON_GROUP_MEMBER)"
        )
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            "group must be a torch.distributed.ProcessGroup (e.g. from dist.new_group) or None "
            f"for the default group. Received: group of type {type(group).__name__}"
        )
    rank = dist.get_rank(group)
    if rank < 0:
        raise ProcessGroupError(
            "this process is not a member of the given group; call context_attention only on "
            "the ranks of that group. "
            f"Received: global rank {dist.get_rank()}, group of size {dist.get_world_size(group)}"
        )
    return rank, dist.get_world_size(group)


_MOVED = {
    "return_weights": "context_attention returns no weights (each rank's (L_r, S) rows span "
    "every shard); call multihead.attention_with_weights on the shards you want to look at",
}


def _check_local(query, key, value, dropout_p, unexpected) -> None:
    V.reject_foreign_keywords("context_attention()", unexpected, moved=_MOVED)
    V.check_qkv(query, key, value)
    if V.check_dropout(dropout_p) > 0.0:
        raise ValueError(
            "context_attention computes no dropout: the forward and backward rings would have "
            "to draw the same random weights on every rank; apply dropout after attention, or "
            f"set dropout_p=0 for this layer. Received: dropout_p={dropout_p}"
        )


def _check_device(backend: str, device: torch.device) -> None:
    """gloo moves CPU tensors, nccl CUDA tensors; a "cpu:gloo,cuda:nccl" group maps each."""
    if ":" in backend:
        devices = dict(part.split(":", 1) for part in backend.split(","))
        ok, wanted = device.type in devices, " or ".join(devices)
    elif backend in ("gloo", "nccl"):
        wanted = "cpu" if backend == "gloo" else "cuda"
        ok = device.type == wanted
    else:  # other backends (mpi, ucc, custom ones) say themselves what they accept
        return
    if not ok:
        hint = (
            "init_process_group('nccl') for CUDA tensors"
            if device.type == "cuda"
            else "init_process_group('gloo') for CPU tensors"
        )
        raise ValueError(
            f"the process group's backend {backend!r} moves {wanted} tensors; use {hint}. "
            f"Received: tensors on {device}, backend {backend!r}"
        )


def _needs_grad(query, key, value, bias) -> bool:
    if not torch.is_grad_enabled():
        return False
    modifier = bias if isinstance(bias, ScoreModifier) else None
    tensors = [query, key, value]
    if isinstance(bias, Tensor):
        tensors.append(bias)
    elif modifier is not None:
        tensors += list(modifier.tensors())
    return any(t.requires_grad for t in tensors)


def _comm_device(group) -> torch.device:
    """Where small collectives run: nccl moves CUDA tensors only."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _gather(
    query, key, value, mask, bias, needs_grad, error, group, rank, world
) -> list[list[int]]:
    """Every rank's _FIELDS, gathered once; raises on every rank together when any rank's inputs
    are invalid or the ranks disagree."""
    if error is None:
        b, h, length_q, d = query.shape
        _, h_kv, length_k, d_v = value.shape
        dtype = _DTYPES.index(query.dtype) if query.dtype in _DTYPES else -1
        fields = [1, b, h, h_kv, d, d_v, length_q, length_k, dtype, mask is not None]
        fields.append(bias is not None)
        fields.append(needs_grad)
    else:
        fields = [0] + [-1] * (len(_FIELDS) - 1)
    mine = torch.tensor(fields, dtype=torch.int64, device=_comm_device(group))
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine, group=group)
    table = torch.stack(parts).tolist()
    failed = [r for r, row in enumerate(table) if row[0] == 0]
    if failed:
        # one more collective, only on this path: every rank learns what went wrong where
        messages: list[object] = [None] * world
        dist.all_gather_object(
            messages, None if error is None else f"{type(error).__name__}: {error}", group=group
        )
        if error is not None:
            raise error
        first = failed[0]
        raise ValueError(
            f"rank {first} rejected its inputs to context_attention, so every rank stops; fix "
            f"the inputs there. Received on rank {first}: {messages[first]}"
        )
    _check_agreement(table)
    return table


_AGREE = {
    "B": "the batch size B (every rank holds a shard of the same sequences)",
    "H": "the number of query heads H",
    "H_kv": "the number of key/value heads H_kv",
    "D": "the head dim D",
    "D_v": "the value head dim D_v",
    "dtype": "the dtype",
    "mask": "whether a mask is given (pass the whole sequence's mask on every rank)",
    "bias": "whether a bias is given (pass the whole sequence's bias on every rank)",
    "grad": "whether gradients are needed (backward is a ring pass every rank must join)",
}


def _check_agreement(table: list[list[int]]) -> None:
    for name, what in _AGREE.items():
        column = [row[_FIELDS.index(name)] for row in table]
        if len(set(column)) > 1:
            if name == "dtype":
                column = [str(_DTYPES[i]) if i >= 0 else "other" for i in column]
            elif name in ("mask", "bias", "grad"):
                column = [bool(x) for x in column]
            raise ValueError(
                f"context_attention: the ranks disagree on {what}; every rank must pass its "
                f"shard of the same problem. Received: {name} per rank = {column}"
            )


def _ring(table: list[list[int]], group, rank: int, world: int) -> _Ring:
    lengths_q = [row[_FIELDS.index("L")] for row in table]
    lengths_k = [row[_FIELDS.index("S")] for row in table]

    def peer(r: int) -> int:
        return r if group is None else dist.get_global_rank(group, r)

    return _Ring(
        group=group,
        rank=rank,
        world=world,
        query_cuts=_cuts("query lengths", lengths_q),
        key_cuts=_cuts("key lengths", lengths_k),
        next_peer=peer((rank + 1) % world),
        prev_peer=peer((rank - 1) % world),
    )


def _merge_into(acc: Tensor, total: Tensor, out: Tensor, lse: Tensor) -> None:
    """acc, total <- the exact merge of (acc, total) with (out, lse) over disjoint key sets."""
    lse = lse.to(total.dtype)
    new = torch.logaddexp(total, lse)
    safe = torch.where(torch.isfinite(new), new, 0.0)  # rows that see nothing stay 0
    acc.mul_(torch.exp(total - safe)[..., None])
    acc.add_(out.to(acc.dtype) * torch.exp(lse - safe)[..., None])
    total.copy_(new)


def _forward(plan: _Plan, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """(out [B, H, L_r, D_v], lse [B, H, L_r]) of this rank's queries over the whole."""
    ring = plan.ring
    b, h, length_q, _ = q.shape
    stat = stat_dtype(q.dtype)
    # heads-inner layout, as the tiled kernel's, so merging heads afterwards is a free view
    acc = torch.zeros(b, length_q, h, v.shape[-1], dtype=stat, device=q.device).transpose(1, 2)
    total = torch.full((b, h, length_q), float("-inf"), dtype=stat, device=q.device)
    k_cur, v_cur = k.contiguous(), v.contiguous()
    for step in range(ring.world):
        j = ring.source(step)
        works, k_next, v_next = [], None, None
        if step < ring.world - 1:  # the next shard travels while this one is computed
            k_next, v_next = _kv_buffers(ring, k, v, ring.source(step + 1))
            works = ring.exchange([k_cur, v_cur], [k_next, v_next], _KV_TAG)
        if plan.visible[j]:
            for piece in plan.pieces(j):
                out, lse = tiled.forward_with_lse(plan.call(q, k_cur, v_cur, j, piece))
                rows = slice(piece.r0, piece.r1)
                _merge_into(acc[:, :, rows], total[:, :, rows], out, lse)
        for w in works:
            w.wait()
        k_cur, v_cur = k_next, v_next
    return acc.to(q.dtype), total


def _kv_buffers(ring: _Ring, k: Tensor, v: Tensor, j: int) -> tuple[Tensor, Tensor]:
    """Receive buffers for rank j's key/value shard."""
    b, h_kv, _, d = k.shape
    n = ring.key_length(j)
    return k.new_empty(b, h_kv, n, d), v.new_empty(b, h_kv, n, v.shape[-1])


def _backward(plan: _Plan, g: Tensor, q, k, v, out, lse):
    """(dq, dk, dv, gradient of each bias tensor or None) for this rank's shards."""
    ring = plan.ring
    stat = stat_dtype(q.dtype)
    tensors = plan.whole.bias_tensors
    dq = torch.zeros(q.shape, dtype=stat, device=q.device)
    d_bias: list[Tensor | None] = [None] * len(tensors)
    k_cur, v_cur = k.contiguous(), v.contiguous()
    acc_works: list = []
    acc_in: tuple[Tensor, Tensor] | None = None  # the accumulator of the shard held, in flight
    acc_sent: tuple[Tensor, Tensor] | None = None  # kept alive until its send completes
    for step in range(ring.world):
        j = ring.source(step)
        kv_works, k_next, v_next = [], None, None
        if step < ring.world - 1:
            k_next, v_next = _kv_buffers(ring, k, v, ring.source(step + 1))
            kv_works = ring.exchange([k_cur, v_cur], [k_next, v_next], _KV_TAG)
        parts = []  # (piece, dk, dv) of the pieces computed here
        for piece in plan.pieces(j) if plan.visible[j] else []:
            rows = slice(piece.r0, piece.r1)
            a, dk, dv, db = tiled.backward_with_lse(
                plan.call(q, k_cur, v_cur, j, piece),
                g[:, :, rows],
                out[:, :, rows],
                lse[:, :, rows],
            )
            dq[:, :, rows] += a
            parts.append((piece, dk, dv))
            for i, grad in enumerate(db):
                if grad is not None:
                    d_bias[i] = grad if d_bias[i] is None else d_bias[i] + grad
        # shard j's dK/dV accumulator: fresh at its owner (step 0), else it arrived from the
        # previous rank while this step computed
        for w in acc_works:
            w.wait()
        if step == 0:
            acc = (
                torch.zeros(k_cur.shape, dtype=stat, device=q.device),
                torch.zeros(v_cur.shape, dtype=stat, device=q.device),
            )
        else:
            acc = acc_in
        for piece, dk, dv in parts:
            acc[0][:, :, piece.c0 : piece.c1] += dk
            acc[1][:, :, piece.c0 : piece.c1] += dv
        if ring.world == 1:
            acc_in = acc
            break
        # on to the next holder of shard j (after the last step: its owner); meanwhile the
        # accumulator of the shard this rank holds next comes from the previous rank
        n = ring.key_length(ring.source(step + 1))
        acc_in = (
            acc[0].new_empty(*k.shape[:2], n, k.shape[-1]),
            acc[1].new_empty(*v.shape[:2], n, v.shape[-1]),
        )
        acc_sent = acc
        acc_works = ring.exchange(list(acc_sent), list(acc_in), _ACC_TAG)
        for w in kv_works:
            w.wait()
        k_cur, v_cur = k_next, v_next
    for w in acc_works:
        w.wait()
    del acc_sent
    dk, dv = acc_in
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), _sum_bias_grads(ring, tensors, d_bias)


def _sum_bias_grads(ring: _Ring, tensors, d_bias: list[Tensor | None]) -> list[Tensor | None]:
    """Each rank saw a part of the scores; the bias's gradient is the sum over ranks. Every
    rank holds the same bias, so every rank reduces the same tensors in the same order."""
    out: list[Tensor | None] = []
    for t, grad in zip(tensors, d_bias):
        if not t.requires_grad:
            out.append(None)
            continue
        grad = torch.zeros_like(t) if grad is None else grad.clone()
        if ring.world > 1:
            dist.all_reduce(grad, group=ring.group)
        out.append(grad)
    return out


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(fctx, q, k, v, plan, *bias_tensors):
        out, lse = _forward(plan, q, k, v)
        fctx.save_for_backward(q, k, v, out, lse)
        fctx.plan = plan
        return out

    @staticmethod
    def backward(fctx, g):
        q, k, v, out, lse = fctx.saved_tensors
        dq, dk, dv, d_bias = _backward(fctx.plan, g.contiguous(), q, k, v, out, lse)
        return dq, dk, dv, None, *d_bias
