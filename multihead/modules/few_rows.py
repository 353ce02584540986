"""Few-row products on every core: the linear layers' products at a decoding step.

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
* ``step_product`` / ``stacked_products``: a layer's products at a decoding step, for
  ``RowsLinear``, ``nn.Linear`` and the packed bf16 / int8 layers of ``quant.py`` (a module
  holding a ``packed`` buffer, which always runs on the kernel) alike.

Where the kernel cannot be built (no compiler) the products fall back to ``F.linear`` on the
same numbers: slower, never different beyond rounding. ``MULTIHEAD_ROWS_KERNEL=0`` turns the
kernel off.
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
    "RowsLinear",
    "few_row_linears",
    "kernel_choices",
    "kernel_error",
    "kernel_fits",
    "rows_linear",
    "rows_linear_stacked",
    "stacked_products",
    "step_product",
]

# products of this many rows at most may run on the kernel: decoding batches of up to 16
# sequences. The kernel holds up to 8 rows x a few channels in registers, so each weight read
# serves every row; past 16 rows a BLAS GEMM reuses weights better
MAX_ROWS = 16

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
    ``forward`` would run x on it (a packed layer, ``quant.PackedLinear``, always; a
    ``RowsLinear`` where ``_float_on_kernel`` says so), the module without hooks; else
    None."""
    if not fits or module._forward_hooks or module._forward_pre_hooks:
        return None
    kind = type(module)
    params: dict[str, Any] = module._parameters
    buffers: dict[str, Any] = module._buffers
    if "packed" in buffers:  # its weights as the kernel reads them, and their scales
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


def few_row_linears(model: nn.Module) -> nn.Module:
    """Replace, in place, every plain float32 ``nn.Linear`` of ``model`` by a ``RowsLinear``
    with the same parameters (not copies: tied weights stay tied; a non-contiguous weight is
    made contiguous); other layers stay as they are. Returns ``model``."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or child.weight.dtype != torch.float32:
                continue
            new = RowsLinear.__new__(RowsLinear)
            new.__dict__ = child.__dict__  # the same parameters, not copies (tying holds)
            if not child.weight.is_contiguous():
                with torch.no_grad():
                    new.weight = nn.Parameter(
                        child.weight.contiguous(), requires_grad=child.weight.requires_grad
                    )
            setattr(parent, name, new)
    return model
