"""Keras 3 (torch backend) on multihead's kernel: a layer, an encoder block, weight conversion.

``import multihead.keras`` imports Keras, on its torch backend: it sets ``KERAS_BACKEND=torch``
when nothing chose a backend yet and raises ImportError if Keras already runs on another one.
``import multihead`` alone never imports Keras.

- ``MultiHeadAttention``: drop-in ``keras.layers.MultiHeadAttention`` whose attention runs on
  ``multihead.attention`` (``multihead.masks`` objects accepted as ``attention_mask``).
- ``EncoderLayer``, ``TokenAndPositionEmbedding``, ``text_classifier``: the seed's encoder
  block and a small classifier built on it.
- ``multihead.MultiHeadAttention.from_keras(layer)`` / ``.to_keras()`` convert weights
  (``multihead.keras.convert`` has the mapping).

Every layer here is registered with ``keras.saving.register_keras_serializable(package=
"multihead")``, so ``keras.saving.load_model(path)`` needs no ``custom_objects``.
"""

from .encoder import EncoderLayer, TokenAndPositionEmbedding, text_classifier
from .layers import MultiHeadAttention

__all__ = [
    "EncoderLayer",
    "MultiHeadAttention",
    "TokenAndPositionEmbedding",
    "text_classifier",
]
