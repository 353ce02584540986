"""The validated request every backend receives: ``prepare`` checks an attention call and
builds its ``Call``; ``plain_causal`` and ``structured`` are what the backends' ranking rules
read besides the shapes, and ``Call.traced`` / ``Call.exported`` whether a graph is traced.

A ``Call`` asks for the output and, besides, for at most one of: the softmax weights
(``return_weights``, of every head or of ``heads``) or statistics of them (``stats``, of every
head or of ``heads``). Every request runs through ``registry.run``."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from .. import _validation as V
from .. import bias as _bias
from ..bias import ScoreModifier
from ..masks import Mask, TileKind, TorchMasks, dense, key_padding

__all__ = [
    "Call",
    "exporting",
    "heads_as_rows",
    "plain_causal",
    "prepare",
    "select_heads",
    "single_row_mask",
    "structured",
    "traced",
]


@dataclass(frozen=True)
class Call:
    """One attention call after validation. Shapes use the legend B, H, H_kv, L, S, D, D_v."""

    query: Tensor  # [B, H, L, D]
    key: Tensor  # [B, H_kv, S, D]
    value: Tensor  # [B, H_kv, S, D_v]
    mask: Mask | None
    bias: ScoreModifier | None  # additive scores; tensors arrive wrapped
    scale: float
    dropout_p: float
    return_weights: bool
    softcap: float | None = None  # scores -> cap * tanh(scores / cap) before bias and mask
    sinks: Tensor | None = None  # [H]: one logit per head in every row's softmax denominator
    # with return_weights: the weights of these query heads only, in this order
    # ([B, len(heads), L, S]), from one pass on backends whose capabilities say heads (the
    # registry runs others twice); with stats: the statistics of these heads
    heads: tuple[int, ...] | None = None
    # statistics of the weights (names from ``stat_names.STATS``), returned in place of the
    # weights as {name: Tensor}: folded into the pass by a backend whose capabilities say
    # stats, else reduced by the registry from weights, one slice of query rows at a time
    stats: tuple[str, ...] | None = None
    # with stats: ``window_mass`` sums the last ``window`` query rows
    window: int | None = None
    # made while a graph is traced (``traced()`` when the call was made): no data-dependent
    # branch, no measurement, no remembered choice. Asked once per call (``prepare`` asks
    # torch once for both flags), not by every step of its way to a kernel and not by every
    # ranking rule (a decoding step's attention call has microseconds to spare)
    traced: bool = field(default_factory=lambda: traced(), compare=False, repr=False)
    # made while torch.export or the ONNX exporter traces (``exporting()``): plain ops only
    exported: bool = field(default_factory=lambda: exporting(), compare=False, repr=False)

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        """(B, H, H_kv, L, S, D)."""
        b, h, l_q, d = self.query.shape
        return b, h, self.key.shape[1], l_q, self.key.shape[2], d

    @property
    def device_type(self) -> str:
        """The device type the call runs on ("cpu", "cuda", ...): what ranking rules read, in
        one place so that tests can stand in for a GPU."""
        return self.query.device.type

    @property
    def needs_grad(self) -> bool:
        tensors = (self.query, self.key, self.value, *self.bias_tensors)
        sinks = self.sinks is not None and self.sinks.requires_grad
        return torch.is_grad_enabled() and (sinks or any(t.requires_grad for t in tensors))

    @property
    def bias_tensors(self) -> tuple[Tensor, ...]:
        return () if self.bias is None else self.bias.tensors()

    @property
    def window_row(self) -> int:
        """The first query row ``window_mass`` sums (0 without a window)."""
        length_q = self.query.shape[2]
        return max(length_q - (self.window or length_q), 0)

    def dense_bias(self, dtype: torch.dtype) -> Tensor | None:
        """The bias lowered to a tensor broadcastable to [B, H, L, S] (differentiable)."""
        if self.bias is None:
            return None
        _, _, _, length_q, length_k, _ = self.shape
        return self.bias.to_dense(length_q, length_k, device=self.query.device, dtype=dtype)


def prepare(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Mask | Tensor | None,
    bias: Tensor | ScoreModifier | None,
    scale: float | None,
    dropout_p: float,
    return_weights: bool,
) -> Call:
    """Validate the arguments of an attention call and normalize mask and bias into a ``Call``
    (what ``attention()`` and context parallelism hand to backends)."""
    b, h, _, length_q, length_k, d = V.check_qkv(query, key, value)
    modifier = _bias.as_modifier(bias)
    if isinstance(mask, TorchMasks):  # from masks.from_torch: visibility plus additive part
        mask, extra = mask
        if extra is not None:
            extra = _bias.as_modifier(extra.to(query.device))
            modifier = extra if modifier is None else modifier + extra
    if isinstance(mask, Tensor):
        V.check_mask_tensor_dtype("mask", mask)
        mask = dense(mask)
    elif mask is not None and not isinstance(mask, Mask):
        raise TypeError(
            "mask must be a multihead.masks.Mask, a bool tensor (True = may attend), the result "
            "of masks.from_torch(...) or None. "
            f"Received: mask of type {type(mask).__name__}"
        )
    if mask is not None:
        mask.check(b, h, length_q, length_k)
    terms = _bias.split(modifier)
    exported = exporting()
    if modifier is not None:
        modifier.check(b, h, length_q, length_k)
        for t in modifier.tensors():
            if t.device != query.device:
                raise ValueError(
                    "bias must be on the same device as query. "
                    f"Received: bias on {t.device}, query.device={query.device}"
                )
    return Call(
        query=query,
        key=key,
        value=value,
        mask=mask,
        bias=terms.additive,
        scale=V.check_scale(scale, d),
        dropout_p=V.check_dropout(dropout_p),
        return_weights=V.check_bool("return_weights", return_weights),
        softcap=terms.softcap,
        sinks=terms.sinks,
        traced=exported or torch.compiler.is_compiling(),
        exported=exported,
    )


def select_heads(call: Call, heads: list[int]) -> Call:
    """The same call restricted to query heads ``heads``: those query heads, the key/value
    head each of them reads (one per query head), and the mask's and bias's rows for them.
    Only these heads are computed by whoever runs the result."""
    _, h, h_kv, length_q, length_k, _ = call.shape
    index = torch.tensor(heads, device=call.query.device)
    kv = index // (h // h_kv)
    mask = call.mask
    if mask is not None and mask.num_heads is not None:  # differs per head: keep the rows
        keep = mask.to_dense(length_q, length_k, device=call.query.device)
        mask = dense(keep[:, index] if keep.shape[1] != 1 else keep)
    bias = None if call.bias is None else call.bias.heads(index)
    return replace(
        call,
        query=call.query[:, index],
        key=call.key[:, kv],
        value=call.value[:, kv],
        mask=mask,
        bias=bias,
        sinks=None if call.sinks is None else call.sinks[index],
        heads=None,
    )


def plain_causal(call: Call) -> bool:
    """True when torch's ``is_causal`` expresses the mask exactly (and there is no bias, cap or
    sink)."""
    _, _, _, length_q, length_k, _ = call.shape
    return (
        call.mask is not None
        and call.bias is None
        and call.softcap is None
        and call.sinks is None
        and call.mask.torch_is_causal(length_q, length_k)
    )


def structured(call: Call) -> bool:
    """A mask or computed bias with structure to exploit (not a dense tensor, not plain
    causal): what block-skipping backends rank themselves by."""
    if call.bias is not None and call.bias.computed:
        return True
    return call.mask is not None and not call.mask.arbitrary and not plain_causal(call)


def exporting() -> bool:
    """True while torch.export or the ONNX exporter traces: no data-dependent branches then."""
    return torch.compiler.is_exporting() or V.in_onnx_export()


def traced() -> bool:
    """True while torch.compile, torch.export or the ONNX exporter traces a graph."""
    return torch.compiler.is_compiling() or exporting()


def heads_as_rows(call: Call) -> Call | None:
    """A one-row call's grouped query heads as the rows of their key/value head.

    At L = 1 the H / H_kv query heads of a group read the same keys and values; where the
    mask is the same for every head and row (or there is none) and nothing else differs by
    head (no bias, sinks or returned weights), they see the same keys too, so they are the
    rows of one (B, H_kv, H / H_kv, D) call with the same mask: a backend then reads each key
    once per group. None where the call does not fold that way.
    """
    b, h, h_kv, length_q, _, d = call.shape
    if length_q != 1 or h_kv == h:
        return None
    if call.bias is not None or call.sinks is not None or call.return_weights:
        return None
    mask = call.mask
    if mask is not None and not (mask.rows_alike and mask.num_heads in (None, 1)):
        return None
    return replace(call, query=call.query.reshape(b, h_kv, h // h_kv, d))


def single_row_mask(mask: Mask, batch: int, length_k: int) -> Mask | None:
    """For a one-row call whose grouped heads may fold (``heads_as_rows``) but whose mask's
    rows may differ: a mask showing every row the keys the single row sees (None where that
    is every key: a causal band over the whole cache), so the heads fold with it; ``mask``
    itself where heads see different keys, which do not fold."""
    entries = range(batch if mask.batch_size not in (None, 1) else 1)
    tiles = [mask.tile(1, length_k, 0, 1, batch=i) for i in entries]
    if all(t.kind == TileKind.FULL and (t.start, t.stop) == (0, length_k) for t in tiles):
        return None
    row = mask.block(1, length_k, 0, 1, 0, length_k)  # [B|1, H|1, 1, S]
    if row.shape[1] != 1:
        return mask
    return key_padding(row[:, 0, 0].expand(batch, length_k))
