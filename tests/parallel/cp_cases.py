"""Inputs and per-rank tasks for the context-parallel tests.

Every rank builds the same whole-sequence tensors from a seed and keeps its shard, as a real
job would after loading its slice of the data; the test process builds the same whole tensors
and runs single-process ``multihead.attention`` on them as the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from helpers import make_case
from torch import Tensor

from multihead import bias as mb


@dataclass(frozen=True)
class Spec:
    kind: str  # a helpers.make_case mask kind: "none", "causal", "window", "documents", ...
    lengths: tuple[int, ...]  # query shard lengths L_r, one per rank
    key_lengths: tuple[int, ...] | None = None  # S_r; default: the query lengths
    b: int = 2
    h: int = 4
    h_kv: int = 2  # grouped-query attention: 2 query heads per key/value head
    d: int = 8
    bias: str = "none"  # "none" | "alibi" | "alibi+t5" (the T5 table learns)
    dtype: str = "float32"
    seed: int = 0

    @property
    def key_shards(self) -> tuple[int, ...]:
        return self.lengths if self.key_lengths is None else self.key_lengths


@dataclass
class Whole:
    q: Tensor  # [B, H, L, D]
    k: Tensor  # [B, H_kv, S, D]
    v: Tensor  # [B, H_kv, S, D]
    grad_out: Tensor  # [B, H, L, D]
    mask: object
    bias: object
    table: Tensor | None  # the T5 table, a leaf that requires grad
    keep: Tensor  # the mask written out independently, bool [B, H|1, L, S]


def whole(spec: Spec) -> Whole:
    """The whole sequence's inputs, identical in every process that asks."""
    dtype = getattr(torch, spec.dtype)
    length_q, length_k = sum(spec.lengths), sum(spec.key_shards)
    g = torch.Generator().manual_seed(spec.seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    q = randn(spec.b, spec.h, length_q, spec.d)
    k = randn(spec.b, spec.h_kv, length_k, spec.d)
    v = randn(spec.b, spec.h_kv, length_k, spec.d)
    grad_out = randn(spec.b, spec.h, length_q, spec.d)
    case = make_case(spec.kind, spec.b, spec.h, length_q, length_k, seed=spec.seed)
    table, bias = None, None
    if spec.bias != "none":
        bias = mb.alibi(spec.h)
    if spec.bias == "alibi+t5":
        table = randn(16, spec.h).requires_grad_()
        bias = bias + mb.relative_buckets(table, max_distance=20)
    return Whole(q, k, v, grad_out, case.mask, bias, table, case.keep)


def _cuts(lengths) -> list[int]:
    cuts = [0]
    for n in lengths:
        cuts.append(cuts[-1] + n)
    return cuts


def shard(spec: Spec, rank: int) -> tuple[slice, slice]:
    """This rank's query rows and key rows of the whole."""
    qc, kc = _cuts(spec.lengths), _cuts(spec.key_shards)
    return slice(qc[rank], qc[rank + 1]), slice(kc[rank], kc[rank + 1])


def run_shard(rank: int, world: int, spec: Spec) -> dict:
    """context_attention on this rank's shard, forward and backward, plus a forward without
    autograd; everything as numpy arrays for the trip back."""
    from multihead.parallel import context_attention

    t = whole(spec)
    rows, cols = shard(spec, rank)
    q = t.q[:, :, rows].clone().requires_grad_()
    k = t.k[:, :, cols].clone().requires_grad_()
    v = t.v[:, :, cols].clone().requires_grad_()
    out = context_attention(q, k, v, t.mask, bias=t.bias)
    wrt = [q, k, v] + ([t.table] if t.table is not None else [])
    grads = torch.autograd.grad(out, wrt, t.grad_out[:, :, rows])
    with torch.no_grad():
        plain = context_attention(q, k, v, t.mask, bias=t.bias)
    result = {
        name: _numpy(x) for name, x in zip(["out", "dq", "dk", "dv", "dtable"], [out, *grads])
    }
    result["no_grad_out"] = _numpy(plain)
    return result


def _numpy(x: Tensor):
    """numpy has no bfloat16: those travel as float32, which holds them exactly."""
    x = x.detach()
    return (x.float() if x.dtype == torch.bfloat16 else x).numpy()


def run_split(rank: int, world: int, spec: Spec) -> dict:
    """run_shard with band shards cut into blocks of 5 query rows and full ranges of 2 keys
    or more run unmasked, so that short test sequences go through every kind of piece."""
    from multihead.parallel import context

    saved = context._BAND_ROWS, context._MIN_FULL
    context._BAND_ROWS, context._MIN_FULL = 5, 2
    try:
        return run_shard(rank, world, spec)
    finally:
        context._BAND_ROWS, context._MIN_FULL = saved


def count_kernel_calls(rank: int, world: int, spec: Spec) -> dict:
    """How many times this rank ran the tiled kernel forward and backward (one call per key
    shard it computes), with the real entry points wrapped for the duration."""
    from multihead.backends import tiled

    calls = {"forward": 0, "backward": 0}
    real_forward, real_backward = tiled.forward_with_lse, tiled.backward_with_lse

    def forward(*args, **kwargs):
        calls["forward"] += 1
        return real_forward(*args, **kwargs)

    def backward(*args, **kwargs):
        calls["backward"] += 1
        return real_backward(*args, **kwargs)

    tiled.forward_with_lse, tiled.backward_with_lse = forward, backward
    try:
        result = run_shard(rank, world, spec)
    finally:
        tiled.forward_with_lse, tiled.backward_with_lse = real_forward, real_backward
    # run_shard also makes one forward without autograd
    calls["forward"] //= 2
    return {**calls, "out": result["out"]}


def call_with(rank: int, world: int, spec: Spec, per_rank: dict) -> None:
    """context_attention with per-rank changes, to provoke the errors every rank must raise:
    per_rank maps a rank to {"b": 3} (another batch size), {"h": 8}, {"kwargs": {...}} (extra
    keywords) or {"no_mask": True}."""
    from multihead.parallel import context_attention

    t = whole(spec)
    rows, cols = shard(spec, rank)
    q, k, v = t.q[:, :, rows], t.k[:, :, cols], t.v[:, :, cols]
    change = per_rank.get(rank, {})
    if "b" in change:
        q, k, v = (x[:1].expand(change["b"], -1, -1, -1) for x in (q, k, v))
    if "h" in change:
        q = q.repeat(1, change["h"] // q.shape[1], 1, 1)
    if "q_rank" in change:
        q = q[0]
    mask = None if change.get("no_mask") else t.mask
    context_attention(q, k, v, mask, bias=t.bias, **change.get("kwargs", {}))


def subgroup(rank: int, world: int, spec: Spec) -> dict:
    """A group of rank 0 alone: rank 0 runs context_attention on the whole sequence in it (a
    ring of one); rank 1, outside the group, must be refused."""
    import torch.distributed as dist

    from multihead.parallel import ProcessGroupError, context_attention

    group = dist.new_group([0])  # every rank takes part in creating a group
    t = whole(spec)
    if rank == 0:
        with torch.no_grad():
            out = context_attention(t.q, t.k, t.v, t.mask, group=group)
        return {"out": out.numpy()}
    try:
        context_attention(t.q, t.k, t.v, t.mask, group=group)
    except ProcessGroupError as err:
        return {"error": str(err)}
    return {}
