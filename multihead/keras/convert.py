"""Weight mapping between ``keras.layers.MultiHeadAttention`` and ``multihead.MultiHeadAttention``.

Keras keeps each projection as an einsum kernel with the heads as their own axis; we keep
``nn.Linear`` weights (out_features, in_features) whose output is viewed as (H, D):

| Keras (torch backend)                  | multihead                                   |
|----------------------------------------|---------------------------------------------|
| ``query_dense.kernel`` (E, H, D)       | ``q_proj.weight`` (H * D, E)                |
| ``query_dense.bias`` (H, D)            | ``q_proj.bias`` (H * D,)                    |
| ``key_dense.kernel`` (kdim, H, D)      | ``k_proj.weight`` (H * D, kdim)             |
| ``value_dense.kernel`` (vdim, H, D_v)  | ``v_proj.weight`` (H * D_v, vdim)           |
| ``output_dense.kernel`` (H, D_v, out)  | ``out_proj.weight`` (out, H * D_v)          |
| ``output_dense.bias`` (out,)           | ``out_proj.bias`` (out,)                    |

Flattening (H, D) row-major puts head h at rows h * D ... (h + 1) * D - 1, which is exactly the
slice ``split_heads`` gives head h, so no permutation is needed beyond the transpose.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..modules.attention import MultiHeadAttention
from ._backend import import_keras

__all__ = ["check_supported", "from_keras", "to_keras"]


def check_supported(
    *, attention_axes: object, use_gate: object, sliding_window: object, output_shape: object
) -> None:
    """Reject Keras options that have no counterpart here (raise rather than convert wrongly).

    ``attention_axes`` may be None, 1 or -2 (the sequence axis of (B, L, E) inputs: Keras' own
    default, which its ``get_config`` writes out as ``(1,)`` once built).
    """
    axes = attention_axes
    if isinstance(axes, int):
        axes = (axes,)
    if axes is not None and tuple(axes) not in ((1,), (-2,)):
        raise ValueError(
            "only attention over the sequence axis of (B, L, E) inputs maps to multihead: "
            "attention_axes must be None (or (1,)); flatten other axes into L first. "
            f"Received: attention_axes={attention_axes!r}"
        )
    if use_gate:
        raise ValueError(
            "Keras' gated attention (use_gate=True) has no counterpart in multihead. "
            f"Received: use_gate={use_gate!r}"
        )
    if sliding_window is not None:
        raise ValueError(
            "Keras' sliding_window (a symmetric band |i - j| < w) is not a layer option here: "
            "pass it as a mask, masks.sliding_window(w - 1, w - 1) for L == S. "
            f"Received: sliding_window={sliding_window!r}"
        )
    if output_shape is not None and len(tuple(output_shape)) != 1:
        raise ValueError(
            "only a one-dimensional output_shape (the output width) maps to multihead's "
            f"out_dim. Received: output_shape={output_shape!r}"
        )


def _value(variable: object) -> Tensor:
    """The torch tensor behind a Keras variable (torch backend), detached."""
    return variable.value.detach()


def from_keras(
    layer: object, cls: type[MultiHeadAttention] = MultiHeadAttention
) -> MultiHeadAttention:
    """A ``multihead.MultiHeadAttention`` with the weights of a built Keras 3
    ``keras.layers.MultiHeadAttention`` (torch backend).

    ``key_dim``, ``value_dim`` and ``output_shape`` become ``head_dim``, ``value_head_dim`` and
    ``out_dim``; the (E, H, D) and (H, D_v, out_dim) einsum kernels become the four linear
    layers. The result is in eval mode, as a Keras layer called outside ``fit``.

    Args:
        layer: a built ``keras.layers.MultiHeadAttention`` (or ``multihead.keras``'s layer).
        cls: the module class to build (a subclass of ``multihead.MultiHeadAttention``).

    Raises:
        TypeError: ``layer`` is not a Keras MultiHeadAttention.
        ValueError: the layer is not built yet, or uses an option with no counterpart.
    """
    keras = import_keras()
    if not isinstance(layer, keras.layers.MultiHeadAttention):
        raise TypeError(
            "from_keras expects a keras.layers.MultiHeadAttention. "
            f"Received: {type(layer).__name__}"
        )
    if not layer.built:
        raise ValueError(
            "from_keras needs a built layer (its kernels exist only after the first call or "
            "layer.build(query_shape, value_shape, key_shape)). Received: layer.built=False"
        )
    check_supported(
        attention_axes=layer._attention_axes,
        use_gate=getattr(layer, "_use_gate", False),
        sliding_window=getattr(layer, "_sliding_window", None),
        output_shape=layer._output_shape,
    )
    dense = (layer.query_dense, layer.key_dense, layer.value_dense)
    q_kernel, k_kernel, v_kernel = (_value(d.kernel) for d in dense)
    o_kernel = _value(layer.output_dense.kernel)  # [H, D_v, out]
    embed_dim, num_heads, head_dim = q_kernel.shape
    new = cls(
        embed_dim,
        num_heads,
        kdim=k_kernel.shape[0],
        vdim=v_kernel.shape[0],
        bias=layer.use_bias,
        dropout=float(layer.dropout),
        head_dim=head_dim,
        value_head_dim=v_kernel.shape[-1],
        out_dim=o_kernel.shape[-1],
    ).to(device=o_kernel.device, dtype=o_kernel.dtype)
    projections = (new.q_proj, new.k_proj, new.v_proj)
    with torch.no_grad():
        for proj, kernel in zip(projections, (q_kernel, k_kernel, v_kernel)):
            proj.weight.copy_(kernel.reshape(kernel.shape[0], -1).T)  # [H * D, in]
        new.out_proj.weight.copy_(o_kernel.reshape(-1, o_kernel.shape[-1]).T)  # [out, H * D_v]
        if layer.use_bias:
            for proj, d in zip(projections, dense):
                proj.bias.copy_(_value(d.bias).reshape(-1))
            new.out_proj.bias.copy_(_value(layer.output_dense.bias))
    return new.eval()


def to_keras(module: MultiHeadAttention) -> object:
    """A built ``keras.layers.MultiHeadAttention`` (torch backend, the module's dtype) with the
    weights of ``module``. Its call order is ``layer(query, value, key)``.

    Raises:
        ValueError: grouped-query attention (``num_kv_heads != num_heads``), which Keras'
            MultiHeadAttention cannot express.
    """
    keras = import_keras()
    h, d, d_v = module.num_heads, module.head_dim, module.value_head_dim
    if module.num_kv_heads != h:
        raise ValueError(
            "keras.layers.MultiHeadAttention has one key/value head per query head; a "
            "grouped-query module (num_kv_heads < num_heads) does not convert. "
            f"Received: num_heads={h}, num_kv_heads={module.num_kv_heads}"
        )
    ref = module.out_proj.weight
    has_bias = module.out_proj.bias is not None
    layer = keras.layers.MultiHeadAttention(
        num_heads=h,
        key_dim=d,
        value_dim=d_v,
        dropout=module.dropout,
        use_bias=has_bias,
        output_shape=None if module.out_dim == module.embed_dim else (module.out_dim,),
        dtype=str(ref.dtype).removeprefix("torch."),
    )
    # build(query_shape, value_shape, key_shape): Keras' argument order
    layer.build(
        (None, None, module.embed_dim), (None, None, module.vdim), (None, None, module.kdim)
    )
    projections = (module.q_proj, module.k_proj, module.v_proj)
    dense = (layer.query_dense, layer.key_dense, layer.value_dense)
    with torch.no_grad():
        for proj, target, per_head in zip(projections, dense, (d, d, d_v)):
            target.kernel.assign(proj.weight.T.reshape(-1, h, per_head))  # [in, H, D]
            if has_bias:
                target.bias.assign(proj.bias.reshape(h, per_head))
        layer.output_dense.kernel.assign(module.out_proj.weight.T.reshape(h, d_v, -1))
        if has_bias:
            layer.output_dense.bias.assign(module.out_proj.bias)
    return layer
