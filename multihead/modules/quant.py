"""Weight-only bf16 and int8 linear layers for decoding (``PackedLinear``), and the
conversion of a model's linear layers into them (``pack_linears``; ``prepare_linears`` picks
that or the float32 few-row layers of ``few_rows.few_row_linears``).

``PackedLinear``: weight-only ``"bf16"`` (rounded to nearest) or ``"int8"`` (symmetric, one
float32 scale per output channel: scale = max |w| / 127 over the channel's inputs), or
``"w8a16"``: the int8 codes and scales, with the activations of each product rounded to int16
(one scale per row) so that the kernel sums exact integers on AVX512-VNNI (two instructions per
32 weights instead of three per 16). ``"w8a16"`` moves a result by at most 1/65534 of each
row's largest activation per input beyond ``"int8"``; its codes are held offset by 128 as
uint8. It holds no float32 weight; ``.weight`` dequantizes on access. Products of at most
``few_rows.MAX_ROWS`` rows always run on the few-row kernel (``few_rows.py``; the alternative
dequantizes the whole matrix first); products of more rows (a prompt), and every product where
the kernel cannot be built, dequantize the weight and run on ``F.linear``: slower, never
different beyond rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .few_rows import few_row_linears, kernel_fits, rows_linear

__all__ = [
    "WEIGHT_FORMATS",
    "PackedLinear",
    "dequantize_int8",
    "pack_linears",
    "prepare_linears",
    "quantize_int8",
]

WEIGHT_FORMATS = ("bf16", "int8", "w8a16")


def quantize_int8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per-output-channel int8: (q int8 (N, K), scale float32 (N,)) with
    weight ~ q * scale[:, None], scale = max |w| / 127 per row (1 for an all-zero row); the
    rounding error of an entry is at most scale / 2."""
    w = weight.detach().to(torch.float32)
    peak = w.abs().amax(dim=1)
    scale = torch.where(peak > 0, peak / 127.0, torch.ones_like(peak))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: Tensor, scale: Tensor) -> Tensor:
    """The float32 matrix ``q * scale[:, None]``."""
    return q.to(torch.float32) * scale[:, None]


class PackedLinear(nn.Module):
    """A linear layer with weight-only ``"bf16"``, ``"int8"`` or ``"w8a16"`` weights and
    float32 activations (see the module docstring).

    Attributes:
        packed: (out, in) bfloat16, int8, or uint8 (w8a16: the int8 codes plus 128) buffer.
        scale: (out,) float32 per-channel scales for int8 and w8a16, else None.
        bias: float32 (out,) parameter or None.
        weights: "bf16", "int8" or "w8a16".
    """

    packed: Tensor
    scale: Tensor | None

    def __init__(self, linear: nn.Linear, weights: str) -> None:
        super().__init__()
        if weights not in WEIGHT_FORMATS:
            raise ValueError(
                f"weights must be 'bf16', 'int8' or 'w8a16'. Received: weights={weights!r}"
            )
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weights = weights
        w = linear.weight.detach()
        if weights in ("int8", "w8a16"):
            q, scale = quantize_int8(w)
            if weights == "w8a16":  # codes -127..127 as 1..255
                q = (q.to(torch.int16) + 128).to(torch.uint8)
            self.register_buffer("packed", q)
            self.register_buffer("scale", scale)
        else:
            self.register_buffer("packed", w.to(torch.bfloat16).contiguous())
            self.register_buffer("scale", None)
        bias = linear.bias
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().clone())

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of the activations it takes and returns: float32."""
        return torch.float32

    @property
    def weight(self) -> Tensor:
        """The dequantized float32 (out, in) weight, computed on every access."""
        if self.scale is None:
            return self.packed.to(torch.float32)
        if self.packed.dtype == torch.uint8:
            return (self.packed.to(torch.float32) - 128.0) * self.scale[:, None]
        return dequantize_int8(self.packed, self.scale)

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype != torch.float32:
            raise TypeError(
                f"a layer with {self.weights} weights takes float32 activations; load the model "
                f"with dtype=torch.float32. Received: input dtype {x.dtype}"
            )
        if kernel_fits(x):
            return rows_linear(x, self.packed, self.scale, self.bias)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, weights={self.weights!r}"
        )


def pack_linears(model: nn.Module, weights: str) -> nn.Module:
    """Replace, in place, every plain float32 ``nn.Linear`` of ``model`` by a ``PackedLinear``
    holding its weight in ``weights`` (``"bf16"``, ``"int8"``, ``"w8a16"``). Other layers
    (embeddings, norms) stay as they are; returns ``model``. ``weights=None`` is deprecated:
    it packs nothing and moves the layers onto the few-row kernel, which is
    ``few_rows.few_row_linears``'s job (or ``prepare_linears(model, None)``'s)."""
    if weights is None:
        from .._deprecation import deprecated

        deprecated("pack_linears(model, None)", "multihead.modules.few_rows.few_row_linears(model)")
        return few_row_linears(model)
    if weights not in WEIGHT_FORMATS:
        raise ValueError(
            f"weights must be 'bf16', 'int8' or 'w8a16'. Received: weights={weights!r}"
        )
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.dtype == torch.float32:
                setattr(parent, name, PackedLinear(child, weights))
    return model


def prepare_linears(model: nn.Module, weights: str | None) -> nn.Module:
    """The linear layers a decoder runs: packed in ``weights`` (``pack_linears``), or for
    None the float32 layers on the few-row kernel with their own parameters
    (``few_rows.few_row_linears``); returns ``model``."""
    if weights is None:
        return few_row_linears(model)
    return pack_linears(model, weights)
