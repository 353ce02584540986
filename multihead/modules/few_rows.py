"""Linear layers for decoding: few-row products on every core, and weight-only bf16 / int8.

Decoding multiplies one row per sequence by every weight matrix of the model, so a step reads
all the weights once and does two flops per weight read: the memory bandwidth bounds it. A
BLAS runs such a product as a matrix-vector product on one core; ``rows_linear`` (a small C++
kernel, ``kernels/csrc/rows_linear.cpp``, loaded as the fused attention kernel is: the package
build's, else built on first use into the same per-user cache) splits the output channels over
torch's intra-op pool, so every core streams its share, and reads weights stored as float32,
bfloat16 or int8 (converted to float32 in registers; activations and sums stay float32).
``rows_linear_stacked`` runs several matrices of one input (a layer's q, k and v) as one call,
each output the bits of its own product.

* ``RowsLinear``: an ``nn.Linear`` (same parameters, state dict and gradients) whose
  products of at most ``MAX_ROWS`` rows, outside autograd and outside traced graphs, run on
  the kernel where it measured faster than ``F.linear`` (the BLAS) for that shape on this
  machine: the first product of each (rows, out, in) times both, as ``auto`` times the fused
  attention kernel (``backends/_measure.compare``: at least 10% faster), and the choice is
  kept for the process (``kernel_choices()`` lists them). Everything else runs on
  ``F.linear``.
* ``PackedLinear``: weight-only ``"bf16"`` (rounded to nearest) or ``"int8"`` (symmetric, one
  float32 scale per output channel: scale = max |w| / 127 over the channel's inputs). It holds
  no float32 weight; ``.weight`` dequantizes on access. Products of at most ``MAX_ROWS`` rows
  always run on the kernel (the alternative dequantizes the whole matrix first); products of
  more rows (a prompt) dequantize the weight and run on ``F.linear``.

Where the kernel cannot be built (no compiler) both fall back to ``F.linear`` on the same
numbers (``PackedLinear`` dequantizing each call): slower, never different beyond rounding.
``MULTIHEAD_ROWS_KERNEL=0`` turns the kernel off.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import _validation as V
from ..kernels import ROWS, Loader

__all__ = [
    "MAX_ROWS",
    "WEIGHT_FORMATS",
    "PackedLinear",
    "RowsLinear",
    "dequantize_int8",
    "kernel_choices",
    "kernel_error",
    "kernel_fits",
    "pack_linears",
    "quantize_int8",
    "rows_linear",
    "rows_linear_stacked",
    "stacked_products",
    "step_product",
]

# products of this many rows at most may run on the kernel: decoding batches of up to 16
# sequences. The kernel holds up to 8 rows x a few channels in registers, so each weight read
# serves every row; past 16 rows a BLAS GEMM reuses weights better
MAX_ROWS = 16
WEIGHT_FORMATS = ("bf16", "int8")

_LOADER = Loader(ROWS, "the decoding kernel")  # the loaded module, or why there is none
# (rows, out, in) -> whether the kernel measured faster than F.linear on float32 weights
_faster: dict[tuple[int, int, int], bool] = {}
# the kernel's "no scale" / "no bias" (float32 on the CPU, where it runs)
with torch.inference_mode(False):  # usable outside inference mode too
    _NONE = torch.empty(0, dtype=torch.float32)


def kernel_error() -> str | None:
    """None when the few-row kernel is built (building it now if needed), else why not."""
    return _LOADER.load_error()


def rows_linear(x: Tensor, weight: Tensor, scale: Tensor | None, bias: Tensor | None) -> Tensor:
    """``x @ (weight * scale[:, None]).T + bias`` on the kernel: x float32 (..., K), its
    leading dimensions the rows (``MAX_ROWS`` at most), weight (N, K) float32 / bfloat16 /
    int8, scale and bias float32 (N,) or None; the output (..., N). Raises RuntimeError when
    the kernel cannot be built."""
    kernel = _LOADER.module or _LOADER.load()
    return kernel.rows_linear(
        x, weight, _NONE if scale is None else scale, _NONE if bias is None else bias
    )


def rows_linear_stacked(
    x: Tensor,
    weights: Sequence[Tensor],
    scales: Sequence[Tensor | None],
    biases: Sequence[Tensor | None],
) -> Tensor:
    """The products ``rows_linear(x, weights[i], scales[i], biases[i])`` side by side in one
    (..., N_0 + N_1 + ...) output, in one kernel call: the matrices share x's width K and one
    dtype, and each output holds the bits ``rows_linear`` gives it. Raises RuntimeError when
    the kernel cannot be built."""
    kernel = _LOADER.module or _LOADER.load()
    return kernel.rows_linear_stacked(
        x,
        list(weights),
        [_NONE if s is None else s for s in scales],
        [_NONE if b is None else b for b in biases],
    )


def kernel_fits(x: Tensor) -> bool:
    """The call may run on the kernel: few float32 CPU rows, no autograd, nothing traced."""
    if (
        x.dtype != torch.float32
        or x.device.type != "cpu"
        or x.numel() > MAX_ROWS * x.shape[-1]
        or torch.is_grad_enabled()
        or torch.compiler.is_compiling()
        or torch.jit.is_tracing()
        or V.in_onnx_export()
    ):
        return False
    return _LOADER.module is not None or kernel_error() is None


def _clock(fn) -> float:  # the timer of kernel against BLAS (tests replace it)
    from ..backends import _measure

    return _measure.best_time(fn)


def _kernel_faster(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """Whether the kernel beats ``F.linear`` on this product's shape, timed on first use with
    the call's own tensors (``backends/_measure.compare``) and kept for the process."""
    rows = x.numel() // x.shape[-1]
    key = (rows, weight.shape[0], weight.shape[1])
    known = _faster.get(key)
    if known is not None:  # every call of a decoding step after the first
        return known
    from ..backends import _measure

    flat = x.reshape(rows, x.shape[-1])
    _faster[key] = _measure.compare(
        lambda: rows_linear(flat, weight, None, bias),
        lambda: F.linear(flat, weight, bias),
        clock=_clock,
    )
    return _faster[key]


def _float_on_kernel(x: Tensor, weight: Tensor, bias: Tensor | None, fits: bool) -> bool:
    """Whether a ``RowsLinear``'s product runs on the kernel: x fits it (``fits``, what
    ``kernel_fits`` says of x), the weight is float32 and the kernel measured faster for the
    shape."""
    return fits and weight.dtype == torch.float32 and _kernel_faster(x, weight, bias)


def _float_product(x: Tensor, weight: Tensor, bias: Tensor | None, fits: bool) -> Tensor:
    """A ``RowsLinear``'s product: on the kernel where ``_float_on_kernel`` says so, else
    ``F.linear``."""
    if _float_on_kernel(x, weight, bias, fits):
        return rows_linear(x, weight, None, bias)
    return F.linear(x, weight, bias)


def step_product(module: nn.Module, x: Tensor, fits: bool) -> Tensor:
    """``module(x)`` for x (..., in), the module call left out where it can be: a
    ``RowsLinear``, ``PackedLinear`` or ``nn.Linear`` without hooks computes here, with the
    same choice of kernel or ``F.linear`` as its ``forward``; any other module is called.
    ``fits``: what ``kernel_fits`` says of x, asked once by the caller for all its products
    of the same rows. (Parameters and hooks are read from the module's own dicts: this runs
    72 times in a GPT-2 decoding step.)"""
    args = _kernel_args(module, x, fits)
    if args is not None:
        return rows_linear(x, *args)
    if module._forward_hooks or module._forward_pre_hooks:
        return module(x)
    kind = type(module)
    if kind is RowsLinear or kind is nn.Linear:
        params: dict[str, Any] = module._parameters
        return F.linear(x, params["weight"], params.get("bias"))
    return module(x)


def stacked_products(modules: Sequence[nn.Module], x: Tensor, fits: bool) -> list[Tensor] | None:
    """What ``[step_product(m, x, fits) for m in modules]`` gives for the products of one
    input (a layer's q, k and v projections; a gated feed-forward's gate and up), as one
    kernel call: where each of them would run on the kernel, over weights of one dtype
    (``rows_linear_stacked``: the same bits, one call and one pass of the threads instead of
    one per product). None where they cannot: a module with hooks, a product ``F.linear``
    would run, matrices of different dtypes."""
    weights: list[Tensor] = []
    scales: list[Tensor] = []
    biases: list[Tensor] = []
    for module in modules:
        args = _kernel_args(module, x, fits)
        if args is None or (weights and args[0].dtype != weights[0].dtype):
            return None
        weight, scale, bias = args
        weights.append(weight)
        scales.append(_NONE if scale is None else scale)
        biases.append(_NONE if bias is None else bias)
    kernel = _LOADER.module or _LOADER.load()
    # each product contiguous, as its own call gives it (views of the one output for one
    # row): an elementwise op after it (the activation, a rotary embedding) may round a row's
    # last partial vector differently in another layout
    return kernel.rows_linear_parts(x, weights, scales, biases)


def _kernel_args(
    module: nn.Module, x: Tensor, fits: bool
) -> tuple[Tensor, Tensor | None, Tensor | None] | None:
    """(weight, scale, bias) the kernel takes for ``module(x)`` where the module's own
    ``forward`` would run x on it (a ``PackedLinear`` always, a ``RowsLinear`` where
    ``_float_on_kernel`` says so), the module without hooks; else None."""
    if not fits or module._forward_hooks or module._forward_pre_hooks:
        return None
    kind = type(module)
    params: dict[str, Any] = module._parameters
    if kind is PackedLinear:
        buffers: dict[str, Any] = module._buffers
        return buffers["packed"], buffers["scale"], params.get("bias")
    if kind is RowsLinear:
        weight, bias = params["weight"], params.get("bias")
        if _float_on_kernel(x, weight, bias, fits):
            return weight, None, bias
    return None


def kernel_choices() -> dict[tuple[int, int, int], str]:
    """The products timed so far in this process: (rows, out, in) -> "kernel" or "blas"."""
    return {key: "kernel" if fast else "blas" for key, fast in _faster.items()}


class RowsLinear(nn.Linear):
    """``nn.Linear`` whose products of at most ``MAX_ROWS`` rows, outside autograd, run on the
    multi-core few-row kernel where it measured faster than ``F.linear`` for that shape (see
    the module docstring); the weight stays the usual (out, in) contiguous float32
    parameter."""

    def forward(self, x: Tensor) -> Tensor:
        return _float_product(x, self.weight, self.bias, kernel_fits(x))


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
    """A linear layer with weight-only ``"bf16"`` or ``"int8"`` weights and float32
    activations (see the module docstring).

    Attributes:
        packed: (out, in) bfloat16 or int8 buffer.
        scale: (out,) float32 per-channel scales for int8, else None.
        bias: float32 (out,) parameter or None.
        weights: "bf16" or "int8".
    """

    packed: Tensor
    scale: Tensor | None

    def __init__(self, linear: nn.Linear, weights: str) -> None:
        super().__init__()
        if weights not in WEIGHT_FORMATS:
            raise ValueError(f"weights must be 'bf16' or 'int8'. Received: weights={weights!r}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weights = weights
        w = linear.weight.detach()
        if weights == "int8":
            q, scale = quantize_int8(w)
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


def pack_linears(model: nn.Module, weights: str | None) -> nn.Module:
    """Replace, in place, every plain float32 ``nn.Linear`` of ``model`` by a ``RowsLinear``
    (``weights=None``: same parameters, tying kept) or a ``PackedLinear`` (``"bf16"``,
    ``"int8"``). Other layers (embeddings, norms) stay as they are; returns ``model``."""
    if weights is not None and weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be None, 'bf16' or 'int8'. Received: weights={weights!r}")
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or child.weight.dtype != torch.float32:
                continue
            new: nn.Module
            if weights is None:
                new = RowsLinear.__new__(RowsLinear)
                new.__dict__ = child.__dict__  # the same parameters, not copies (tying holds)
                with torch.no_grad():
                    if not child.weight.is_contiguous():
                        new.weight = nn.Parameter(
                            child.weight.contiguous(), requires_grad=child.weight.requires_grad
                        )
            else:
                new = PackedLinear(child, weights)
            setattr(parent, name, new)
    return model
