"""The validated request every backend receives (``prepare`` builds it), and helpers shared by
the eager backends."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .. import _validation as V
from .. import bias as _bias
from ..bias import ScoreModifier
from ..masks import Mask, TorchMasks, dense


class BackendUnavailable(RuntimeError):
    """Raised by a backend's ``run`` when it finds only on trying that it cannot run the call
    (a compile that fails). The registry catches it and runs the next backend ``auto`` would
    choose; the backend's ``unsupported`` should report the reason from then on."""


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
    # ([B, len(heads), L, S]); only for backends whose capabilities say heads
    heads: tuple[int, ...] | None = None

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
    return torch.compiler.is_exporting() or torch.onnx.is_in_onnx_export()


def stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax statistics and biases: float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def sink_grad(sinks: Tensor, grad: Tensor, out: Tensor, lse: Tensor) -> Tensor:
    """Gradient of the sink logits (H,) from a finished call: each row gives its sink the weight
    exp(sink - lse) (``lse`` with the sink joined) times -sum(dO * O), the same row term every
    score's gradient subtracts, summed over batch and rows. Rows that see nothing (lse -inf)
    give none."""
    delta = (grad.to(lse.dtype) * out.to(lse.dtype)).sum(-1)  # [B, H, L]
    weight = torch.exp(sinks.detach().to(lse.dtype)[None, :, None] - lse)
    weight = torch.where(torch.isfinite(lse), weight, 0.0)
    return -(weight * delta).sum((0, 2)).to(sinks.dtype)


def repeat_kv(t: Tensor, groups: int) -> Tensor:
    """[B, H_kv, S, D] -> [B, H_kv * groups, S, D]; query head h reads kv head h // groups."""
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def dense_keep(call: Call) -> Tensor | None:
    """The mask as a bool tensor broadcastable to [B, H, L, S], or None when there is none."""
    if call.mask is None:
        return None
    _, _, _, length_q, length_k, _ = call.shape
    return call.mask.to_dense(length_q, length_k, device=call.query.device)


def drop_dead_keys(keep: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
    """Zero key/value rows that no query may see.

    Padding often holds garbage (even NaN); a weight of 0 times NaN is still NaN inside a matmul,
    so keys that are invisible to every query must not be read at all. When the mask differs
    per head, key/value are first expanded from H_kv to H heads so each head drops its own.
    """
    live = keep.any(dim=2)  # [B|1, H|1, S]
    # no early exit when every key is live: a data-dependent branch would stop torch.export
    if live.shape[1] not in (1, key.shape[1]):
        groups = live.shape[1] // key.shape[1]
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    live = live[..., None]  # [B|1, H|1, S, 1]
    zero = torch.zeros((), dtype=key.dtype, device=key.device)
    return torch.where(live, key, zero), torch.where(live, value, zero)
