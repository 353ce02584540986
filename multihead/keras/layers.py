"""``multihead.keras.MultiHeadAttention``: Keras' layer with ``multihead.attention`` inside.

The layer is a drop-in subclass of ``keras.layers.MultiHeadAttention``: same constructor, same
weights (so ``set_weights``/``get_weights`` and ``.keras`` files are interchangeable), same call
``layer(query, value, key=None, ...)``. Only the attention itself differs: it runs on this
library's kernel, which skips masked tiles, takes ``multihead.masks`` objects as
``attention_mask`` and gives fully-masked query rows exactly 0 (Keras: a uniform average).
"""

from __future__ import annotations

import functools
import operator

from torch import Tensor

from .. import masks
from ..functional import attention, attention_with_weights
from ._backend import import_keras
from .convert import check_supported

__all__ = ["MultiHeadAttention"]

keras = import_keras()
# the mask Keras attaches to a tensor (Embedding(mask_zero=True)); not in Keras' public API
from keras.src.backend import get_keras_mask, set_keras_mask  # noqa: E402


def _attention_mask(attention_mask: Tensor) -> masks.Mask:
    """A Keras ``attention_mask`` (1 / True = attend) as a ``multihead.masks`` mask.

    Shapes as Keras broadcasts them onto the (B, H, L, S) scores: (L, S), (B, L, S) or
    (B, H, L, S), each dimension equal or 1.

    Raises:
        TypeError: a float mask (Keras would cast it to bool; here that is left to the caller,
            since float masks are additive in PyTorch code).
        ValueError: another rank.
    """
    t = keras.ops.convert_to_tensor(attention_mask)
    if t.dim() not in (2, 3, 4):
        raise ValueError(
            "a Keras attention_mask has shape (L, S), (B, L, S) or (B, H, L, S) with 1 / True = "
            "attend; for a (B, S) padding mask use value_mask= or masks.key_padding(keep). "
            f"Received: attention_mask.shape={tuple(t.shape)}"
        )
    if t.is_floating_point():
        raise TypeError(
            "attention_mask must be bool or integer (1 = attend); cast a 0/1 float mask with "
            f"mask > 0.5. Received: attention_mask.dtype={t.dtype}"
        )
    if t.dim() == 3:
        return masks.from_keras(t)
    return masks.dense(t != 0)


@keras.saving.register_keras_serializable(package="multihead")
class MultiHeadAttention(keras.layers.MultiHeadAttention):
    """Keras 3 multi-head attention (torch backend) computed by ``multihead.attention``.

    Takes the arguments of ``keras.layers.MultiHeadAttention`` (``num_heads``, ``key_dim``,
    ``value_dim``, ``dropout``, ``use_bias``, ``output_shape``, initializers, ...), except the
    options that have no counterpart here: a non-default ``attention_axes``, ``use_gate=True``,
    ``sliding_window`` (pass ``masks.sliding_window`` as ``attention_mask`` instead) and a
    multi-dimensional ``output_shape``. Inputs are (B, L, E) query and (B, S, E_v) value (and
    optional (B, S, E_k) key); the output is (B, L, E_out).

    Call arguments as in Keras: ``query, value, key=None, query_mask=None, value_mask=None,
    key_mask=None, attention_mask=None, return_attention_scores=False, training=None,
    use_causal_mask=False``. ``attention_mask`` is a Keras mask (bool or int, 1 / True =
    attend) of shape (L, S), (B, L, S) or (B, H, L, S), each dimension equal or 1, or any
    ``multihead.masks`` mask. Keras' implicit masks (from ``Embedding(mask_zero=True)``) hide
    padded keys and give padded queries an all-zero row; ``use_causal_mask`` is Keras'
    top-left aligned causal mask, ``masks.causal(align="top_left")``.
    The scores, when returned, are the per-head softmax weights (B, H, L, S) before dropout.

    Registered as ``multihead>MultiHeadAttention``: once ``multihead.keras`` is imported, a
    ``.keras`` file that uses it loads without ``custom_objects``.
    """

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        check_supported(
            attention_axes=self._attention_axes,
            use_gate=getattr(self, "_use_gate", False),
            sliding_window=getattr(self, "_sliding_window", None),
            output_shape=self._output_shape,
        )

    def build(self, query_shape, value_shape, key_shape=None) -> None:
        for name, shape in (("query", query_shape), ("value", value_shape), ("key", key_shape)):
            if shape is not None and len(shape) != 3:
                raise ValueError(
                    f"{name} must be a 3-D (B, L, E) input: flatten other axes into L first. "
                    f"Received: {name}_shape={tuple(shape)}"
                )
        super().build(query_shape, value_shape, key_shape)

    def call(
        self,
        query,
        value,
        key=None,
        query_mask=None,
        value_mask=None,
        key_mask=None,
        attention_mask=None,
        return_attention_scores=False,
        training=None,
        use_causal_mask=False,
    ):
        own_key = key is not None and key is not value
        key = value if key is None else key
        # Keras only fills *_mask from the inputs when a call has several tensor arguments
        query_mask = get_keras_mask(query) if query_mask is None else query_mask
        value_mask = get_keras_mask(value) if value_mask is None else value_mask
        key_mask = (get_keras_mask(key) if key_mask is None else key_mask) if own_key else None
        mask = _combined_mask(query_mask, value_mask, key_mask, attention_mask, use_causal_mask)

        # the projections get mask-free views: the masks are handled here, and a masked input
        # would make Keras warn that EinsumDense drops it (Keras' own layer instead clears
        # the masks on the caller's tensors)
        q = self._query_dense(query.view_as(query)).transpose(1, 2)  # [B, H, L, D]
        k = self._key_dense(key.view_as(key)).transpose(1, 2)  # [B, H, S, D]
        v = self._value_dense(value.view_as(value)).transpose(1, 2)  # [B, H, S, D_v]
        # Keras' contract: the scores come back beside the output when asked for
        dropout_p = float(self._dropout) if training else 0.0
        scores = None
        if return_attention_scores:
            out, scores = attention_with_weights(q, k, v, mask, dropout_p=dropout_p)
        else:
            out = attention(q, k, v, mask, dropout_p=dropout_p)
        out = self._output_dense(out.transpose(1, 2))  # [B, L, H, D_v] -> [B, L, E_out]
        if query_mask is not None:
            set_keras_mask(out, query_mask)
        return (out, scores) if return_attention_scores else out

    def compute_output_spec(
        self,
        query,
        value,
        key=None,
        query_mask=None,
        value_mask=None,
        key_mask=None,
        attention_mask=None,
        return_attention_scores=False,
        training=None,
        use_causal_mask=False,
    ):
        key_shape = None if key is None else key.shape
        shape = self.compute_output_shape(query.shape, value.shape, key_shape)
        out = keras.KerasTensor(shape, dtype=self.compute_dtype)
        if not return_attention_scores:
            return out
        # (B, H, L, S): Keras' own spec says (B, H, L, L), wrong for cross-attention
        scores = (query.shape[0], self.num_heads, query.shape[1], value.shape[1])
        return out, keras.KerasTensor(scores, dtype=self.compute_dtype)


def _combined_mask(query_mask, value_mask, key_mask, attention_mask, use_causal_mask):
    """Keras' masks (padding of query, value and key, ``attention_mask``, the causal flag) as
    one ``multihead`` mask, or None."""
    parts = []
    if query_mask is not None:  # a padded query sees nothing: its row is 0
        parts.append(masks.dense(keras.ops.cast(query_mask, "bool")[:, None, :, None]))
    for keep in (value_mask, key_mask):
        if keep is not None:
            parts.append(masks.key_padding(keras.ops.cast(keep, "bool")))
    if use_causal_mask:
        parts.append(masks.causal(align="top_left"))  # Keras: query i sees keys j <= i
    if attention_mask is not None:
        is_mask = isinstance(attention_mask, masks.Mask)
        parts.append(attention_mask if is_mask else _attention_mask(attention_mask))
    return functools.reduce(operator.and_, parts) if parts else None
