"""A transformers model's linear layers on multihead's few-row kernel (``decoding_linears``).

A decoding step multiplies one row per sequence by every weight matrix of the model. On the
CPU torch hands such a product to its BLAS as a matrix-vector product, which streams the
weights at a fraction of the memory bandwidth; multihead's few-row kernel
(``multihead.modules.few_rows.RowsLinear``) splits the output channels over every core and streams
them at the bandwidth. In a decoding step the products are most of the time, and the
attention, whatever its implementation, a few percent of it: this is what makes a
transformers model's ``generate()`` faster, the attention implementation hardly does.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from ..modules import few_rows, quant

__all__ = ["decoding_linears"]


def decoding_linears(model: nn.Module) -> nn.Module:
    """Run the products of ``model``'s float32 ``nn.Linear`` layers of at most 16 rows (the
    decoding steps of up to 16 sequences) on multihead's few-row kernel, in place.

    Each ``nn.Linear`` with a float32 weight becomes a ``multihead.modules.few_rows.RowsLinear``: a
    subclass of ``nn.Linear`` that holds the same parameters (tied weights stay tied), so the
    state dict, ``save_pretrained`` and gradients are unchanged. Its products of at most 16
    rows outside autograd and traced graphs run on the kernel where it measured faster than
    ``F.linear`` for that shape on this machine (the first product of a shape times both);
    everything else, a prompt's forward included, runs on ``F.linear`` as before. Results
    differ from ``F.linear``'s by float32 rounding (another order of the same sums).

    Other layers (embeddings, norms, linear layers of other classes or dtypes) are left as
    they are; among them transformers' ``Conv1D`` (GPT-2's projections, stored transposed),
    so a GPT-2 model moves its ``lm_head`` only. Calling it again changes nothing. Where the
    kernel cannot be built (no C++ compiler) a warning says so, and the layers keep running
    ``F.linear``.

    Args:
        model: a module, typically a transformers model on the CPU in float32.

    Returns:
        ``model``.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: ``model`` has no float32 ``nn.Linear`` on the CPU, nor any already moved.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            "decoding_linears takes a torch.nn.Module (a transformers model). "
            f"Received: an object of type {type(model).__name__}"
        )
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if not any(map(_fits, linears)) and not any(type(m) is few_rows.RowsLinear for m in linears):
        found = sorted({f"{m.weight.dtype} on {m.weight.device.type}" for m in linears})
        raise ValueError(
            "decoding_linears moves float32 nn.Linear layers on the CPU (the few-row kernel "
            f"reads float32 activations); this model has none: {len(linears)} linear layers"
            + (f" ({', '.join(found)})" if found else "")
            + ". Convert it with model.float().cpu() first"
        )
    reason = few_rows.kernel_error()
    if reason is not None:
        warnings.warn(
            f"multihead's few-row kernel is not available ({reason}); the linear layers keep "
            "running F.linear. `multihead doctor` says how to get the kernel.",
            RuntimeWarning,
            stacklevel=2,
        )
    return quant.pack_linears(model, None)


def _fits(m: nn.Linear) -> bool:
    """A plain ``nn.Linear`` with a float32 weight on the CPU."""
    weight = m.weight
    return type(m) is nn.Linear and weight.dtype == torch.float32 and weight.device.type == "cpu"
