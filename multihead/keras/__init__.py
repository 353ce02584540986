"""Keras 3 (torch backend) on multihead's kernel: a layer, an encoder block, weight conversion.

``import multihead.keras`` imports Keras, on its torch backend: it sets ``KERAS_BACKEND=torch``
when nothing chose a backend yet and raises ImportError if Keras already runs on another one.
``import multihead`` alone never imports Keras.

- ``MultiHeadAttention``: drop-in ``keras.layers.MultiHeadAttention`` whose attention runs on
  ``multihead.attention`` (``multihead.masks`` objects accepted as ``attention_mask``).
- ``EncoderLayer``, ``TokenAndPositionEmbedding``, ``text_classifier``: the seed's encoder
  block and a small classifier built on it.
- ``from_keras(layer)`` / ``to_keras(module)`` convert weights between
  ``keras.layers.MultiHeadAttention`` and ``multihead.MultiHeadAttention``
  (``multihead.keras.convert`` has the mapping; the core module never imports Keras).

Every layer here is registered with ``keras.saving.register_keras_serializable(package=
"multihead")``, so ``keras.saving.load_model(path)`` needs no ``custom_objects``.
"""

from .convert import from_keras, to_keras
from .encoder import EncoderLayer, TokenAndPositionEmbedding, text_classifier
from .layers import MultiHeadAttention

__all__ = [
    "EncoderLayer",
    "MultiHeadAttention",
    "TokenAndPositionEmbedding",
    "from_keras",
    "text_classifier",
    "to_keras",
]
