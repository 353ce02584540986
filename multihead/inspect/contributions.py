"""What each key contributes to an attention block's output, one layer at a time, in memory
that grows as L² (never L² x E): the per-layer parts of the ``norm`` and ``alti`` methods of
``multihead.inspect.attribute``.

One layer's call is read as ``LayerParts``: the softmax weights α (H, L, L), the values v
(H_kv, L, D_v) as the kernel saw them (bias included), the output projection W_o and its bias
b_o, the residual stream x the block adds its output to, and the norm after the sum (post-norm
layers, BERT) or none (pre-norm layers, GPT-2, Llama). Head h's projected value of key j is
``u_hj = W_o^h v_hj`` (E); the block's output at query i is

    z_i = Σ_j T_ij + b_o,  T_ij = Σ_h α_hij u_hj + [i = j] x_i,

then ``y_i = norm(z_i)`` for a post-norm layer (``y_i = z_i`` otherwise). A norm is linear
once its scale is fixed at the row's own (``linearized``): LayerNorm's part of T_ij is
``γ ⊙ (T_ij - mean(T_ij)) / σ(z_i)``, RMSNorm's ``γ ⊙ T_ij / rms(z_i)``; what no key owns
(b_o, β) stays in y_i and in no T_ij.

* Kobayashi et al. 2020 ("Attention is Not Only a Weight"): ``‖Σ_h α_hij u_hj‖₂``, the
  residual and norm left out; with them (Kobayashi et al. 2021) ``‖T'_ij‖₂``. Computed from
  each key's Gram matrix over heads, ``‖Σ_h α_hij u_hj‖² = Σ_{h,g} α_hij α_gij (u_hj · u_gj)``:
  (L, L) per head pair, never (L, L, E).
* ALTI (Ferrando et al. 2022, "Measuring the Mixing of Contextual Information in the
  Transformer"): ``c_ij = max(0, ‖y_i‖₁ - ‖y_i - T'_ij‖₁)``, each row normalized to sum 1; the
  layers compose as rollout does, ``R = C_last ... C_1``. The Manhattan distance has no Gram
  form, so its (rows, L, E) differences are formed a block of query rows at a time, the block
  sized to ``BLOCK_BYTES``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "BLOCK_BYTES",
    "LayerParts",
    "alti_matrix",
    "head_values",
    "linearized",
    "norm_rows",
    "norm_scale",
]

BLOCK_BYTES = 64 * 2**20  # one block of ALTI's (rows, L, E) differences, in float32
KERNEL_BLOCK_BYTES = 64 * 2**20  # one block of weights the kernel reads as (rows, keys, H)


@dataclass(frozen=True)
class LayerParts:
    """One self-attention layer's call on one sequence without padding.

    Attributes:
        weights: (H, L, L) softmax weights, each row summing to 1 (0 above the diagonal of a
            causal layer).
        values: (H_kv, L, D_v) the value vectors of the call, H_kv dividing H.
        out_weight: (E, H * D_v) the output projection's weight.
        out_bias: (E,) or None.
        residual: (L, E) what the block's output is added to (the layer's input).
        norm: the norm applied to the sum (a post-norm layer), or None.
        causal: no query sees a later key (the work above the diagonal is skipped).
        output: (L, E) the block's output before the residual, as the model computed it
            (``Σ_j Σ_h α_hij u_hj + b_o``); None: rebuilt from the parts (an (L, L) x (L, E)
            product per head, the largest cost of a long layer).
    """

    weights: Tensor
    values: Tensor
    out_weight: Tensor
    out_bias: Tensor | None
    residual: Tensor
    norm: nn.Module | None = None
    causal: bool = False
    output: Tensor | None = None


def head_values(parts: LayerParts) -> Tensor:
    """u (H, L, E): every head's value of every key through its slice of the output
    projection, ``u_hj = W_o^h v_hj``."""
    heads = parts.weights.shape[0]
    values = parts.values
    if values.shape[0] != heads:  # grouped-query attention: head h reads KV head h // group
        values = values.repeat_interleave(heads // values.shape[0], dim=0)
    d_v = values.shape[-1]
    w_o = parts.out_weight.reshape(parts.out_weight.shape[0], heads, d_v)  # (E, H, D_v)
    return torch.einsum("hjd,ehd->hje", values.to(parts.weights.dtype),
                        w_o.to(parts.weights.dtype))  # fmt: skip


def norm_scale(norm: nn.Module) -> tuple[Tensor, Tensor | None, float, bool]:
    """(γ, β or None, eps, centred) of a LayerNorm or an RMSNorm (the library's, transformers'
    ``*RMSNorm`` with ``variance_epsilon``), read without running it.

    Raises:
        ValueError: a norm of another kind (its class named).
    """
    if isinstance(norm, nn.LayerNorm):
        gamma = norm.weight if norm.weight is not None else torch.ones(norm.normalized_shape)
        return gamma, norm.bias, float(norm.eps), True
    eps = getattr(norm, "eps", getattr(norm, "variance_epsilon", None))
    weight = getattr(norm, "weight", None)
    name = type(norm).__name__
    if "RMSNorm" in name and isinstance(weight, Tensor) and isinstance(eps, (int, float)):
        if "Gemma" in name:  # Gemma scales by (1 + weight)
            raise ValueError(
                f"{name} scales by (1 + weight), which the contributions do not read yet. "
                f"Received: a {name}"
            )
        return weight, None, float(eps), False
    raise ValueError(
        f"the contributions read LayerNorm and RMSNorm layers only. Received: a {name}"
    )


def _affine(norm: nn.Module, part: Tensor) -> Tensor:
    """The norm's linear map with a unit scale: ``γ ⊙ (part - mean(part))`` (LayerNorm) or
    ``γ ⊙ part`` (RMSNorm)."""
    gamma, _, _, centred = norm_scale(norm)
    if centred:
        part = part - part.mean(-1, keepdim=True)
    return gamma.to(part.dtype) * part


def _row_scale(total: Tensor, eps: float, centred: bool) -> Tensor:
    """1 / σ(total) (LayerNorm) or 1 / rms(total) (RMSNorm) over the last dimension."""
    if centred:
        return (total.var(-1, unbiased=False) + eps).rsqrt()
    return (total.pow(2).mean(-1) + eps).rsqrt()


def linearized(norm: nn.Module, total: Tensor, part: Tensor) -> Tensor:
    """``part``'s share of ``norm(total)`` with the norm's scale fixed at ``total``'s:
    ``γ ⊙ (part - mean(part)) / σ(total)`` (LayerNorm) or ``γ ⊙ part / rms(total)``
    (RMSNorm); ``total`` (..., E) broadcasts against ``part``'s leading dimensions."""
    _, _, eps, centred = norm_scale(norm)
    scale = _row_scale(total.to(part.dtype), eps, centred)[..., None]
    return _affine(norm, part) * scale


def _normed(norm: nn.Module, total: Tensor) -> Tensor:
    """``norm(total)`` computed from the norm's parameters in ``total``'s dtype."""
    _, beta, _, _ = norm_scale(norm)
    out = linearized(norm, total, total)
    return out if beta is None else out + beta.to(out.dtype)


def _gram_norms(alpha: Tensor, gram: Tensor, extra: Tensor | None = None) -> Tensor:
    """‖Σ_h α_h·j u_hj‖₂ for a block of rows: alpha (H, n, S), gram (S, H, H) -> (n, S)."""
    # Σ_h α_hij (Σ_g G_j[h, g] α_gij): per key a (n, H) @ (H, H) product
    a = alpha.permute(2, 1, 0)  # (S, n, H)
    squared = (torch.bmm(a, gram) * a).sum(-1).transpose(0, 1)  # (n, S)
    if extra is not None:
        squared = squared + extra
    return squared.clamp_min(0).sqrt()


def norm_rows(parts: LayerParts, rows: Tensor, *, residual: bool = False) -> Tensor:
    """Kobayashi's norms for the query rows ``rows`` (n,): (n, L), ``‖Σ_h α_hij u_hj‖₂``, or with
    ``residual`` ``‖T'_ij‖₂`` (the residual on the diagonal and the post-norm linearized; a
    pre-norm layer has no norm after the sum).

    The float64 check of this formula is ``tests/inspect/test_attribution.py``."""
    u = head_values(parts)  # (H, L, E)
    alpha = parts.weights[:, rows]  # (H, n, L)
    if not residual:
        return _gram_norms(alpha, torch.einsum("hje,gje->jhg", u, u))
    x = parts.residual.to(u.dtype)
    if parts.norm is not None:  # T'_ij = γ ⊙ P T_ij / σ_i: σ_i is the row's own, applied last
        _, _, eps, centred = norm_scale(parts.norm)
        scale = _row_scale(_sums(parts, u)[rows], eps, centred)  # (n,)
        u, x = _affine(parts.norm, u), _affine(parts.norm, x)
    else:
        scale = torch.ones(len(rows), dtype=u.dtype)
    squared = _gram_norms(alpha, torch.einsum("hje,gje->jhg", u, u)).pow(2)
    n = torch.arange(len(rows))
    cross = 2 * (alpha[:, n, rows] * (u[:, rows] * x[rows]).sum(-1)).sum(0)  # j = i: + x_i
    squared[n, rows] += cross + x[rows].pow(2).sum(-1)
    return squared.clamp_min(0).sqrt() * scale[:, None]


def _sums(parts: LayerParts, u: Tensor) -> Tensor:
    """z (L, E): the residual plus the attention output, ``Σ_j T_ij + b_o``, rebuilt from the
    parts (``y = norm(z)``), or the block's own output where the model gave it."""
    if parts.output is not None:
        return parts.output.to(u.dtype) + parts.residual.to(u.dtype)
    z = torch.einsum("hij,hje->ie", parts.weights.to(u.dtype), u) + parts.residual.to(u.dtype)
    if parts.out_bias is not None:
        z = z + parts.out_bias.to(u.dtype)
    return z


def _kernel(dtype: torch.dtype, wanted: bool | None) -> object | None:
    """The fused kernel's module where it computes ALTI's distances (float32, built), else
    None; ``wanted`` True requires it, False refuses it."""
    if wanted is False or dtype != torch.float32:
        if wanted:
            raise ValueError(f"the kernel's distances take float32. Received: {dtype}")
        return None
    from ..backends import fused

    if not fused.built():
        if wanted:
            raise RuntimeError(f"the fused kernel is not built: {fused.build_error()}")
        return None
    module = fused.build()
    return module if hasattr(module, "alti_distances") else None


def alti_matrix(
    parts: LayerParts, *, block_bytes: int = BLOCK_BYTES, kernel: bool | None = None
) -> Tensor:
    """ALTI's contributions C (L, L) of one layer: row i says how much each key's T'_ij makes up
    y_i, ``max(0, ‖y_i‖₁ - ‖y_i - T'_ij‖₁)`` normalized over j (a row with nothing left keeps
    its own token: 1 on the diagonal).

    In float32 the fused C++ kernel forms the distances (``alti_distances``: each key's values
    read once per task of rows, nothing of size (rows, keys, E) stored); otherwise, or with
    ``kernel=False``, torch forms them a block of query rows at a time, the block's (rows, keys,
    E) differences within ``block_bytes``. ``kernel=True`` requires the kernel."""
    u = head_values(parts)  # (H, L, E)
    length = u.shape[1]
    z = _sums(parts, u)
    y = z if parts.norm is None else _normed(parts.norm, z)
    x = parts.residual.to(u.dtype)
    alpha = parts.weights.to(u.dtype)
    out = torch.zeros(length, length, dtype=u.dtype)
    module = _kernel(u.dtype, kernel)
    if module is not None:
        distances = _kernel_distances(module, parts, u, x, z, alpha)
    else:
        distances = _torch_distances(parts, u, x, z, y, alpha, block_bytes)
    for start, stop, keys, distance in distances:
        own = torch.arange(start, stop)
        y_rows = y[start:stop]
        c = (y_rows.abs().sum(-1, keepdim=True) - distance).clamp_min(0)
        if parts.causal:  # a later key contributes nothing, whatever the rounding says
            c = c.masked_fill(torch.arange(keys)[None] > own[:, None], 0.0)
        total = c.sum(-1, keepdim=True)
        empty = total[:, 0] == 0
        c = c / total.clamp_min(torch.finfo(c.dtype).tiny)
        c[empty.nonzero().flatten(), own[empty]] = 1.0
        out[start:stop, :keys] = c
    return out


Blocks = Iterator[tuple[int, int, int, Tensor]]  # (start, stop, keys, d (rows, keys))


def _torch_distances(parts: LayerParts, u: Tensor, x: Tensor, z: Tensor, y: Tensor,
                     alpha: Tensor, block_bytes: int) -> Blocks:  # fmt: skip
    """(start, stop, keys, d (rows, keys)) for blocks of query rows, by torch."""
    _, length, width = u.shape
    span = alpha.permute(2, 1, 0)  # (keys, rows, H): one (rows, H) @ (H, E) product per key
    u_keys = u.transpose(0, 1)  # (keys, H, E)
    step = max(1, block_bytes // max(1, 3 * length * width * u.element_size()))
    for start in range(0, length, step):
        stop = min(length, start + step)
        keys = stop if parts.causal else length  # a causal row sees no later key
        t = torch.bmm(span[:keys, start:stop], u_keys[:keys]).transpose(0, 1)  # (rows, keys, E)
        own = torch.arange(start, stop)
        t[own - start, own] += x[start:stop]
        if parts.norm is not None:
            t = linearized(parts.norm, z[start:stop, None], t)
        yield start, stop, keys, (y[start:stop, None] - t).abs().sum(-1)


def _kernel_distances(module: Any, parts: LayerParts, u: Tensor, x: Tensor, z: Tensor,
                      alpha: Tensor) -> Blocks:  # fmt: skip
    """The same blocks, each from one call of the kernel's ``alti_distances``."""
    heads, length, _ = u.shape
    y = z if parts.norm is None else _normed(parts.norm, z)
    if parts.norm is not None:  # the norm's linear map on u and x, its row scale apart
        _, _, eps, centred = norm_scale(parts.norm)
        u, x = _affine(parts.norm, u), _affine(parts.norm, x)
        scale = _row_scale(z, eps, centred)
    else:
        scale = torch.ones(length, dtype=u.dtype)
    u_keys = u.transpose(0, 1).contiguous()  # (keys, H, E)
    step = max(1, KERNEL_BLOCK_BYTES // max(1, 4 * length * heads))
    for start in range(0, length, step):
        stop = min(length, start + step)
        keys = stop if parts.causal else length
        block = alpha[:, start:stop, :keys].permute(1, 2, 0).contiguous()  # (rows, keys, H)
        d = module.alti_distances(block, u_keys[:keys], y[start:stop].contiguous(),
                                  x[start:stop].contiguous(), scale[start:stop].contiguous(),
                                  start, parts.causal)  # fmt: skip
        yield start, stop, keys, d
