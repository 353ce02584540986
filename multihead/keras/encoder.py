"""The seed's Keras encoder block on ``multihead.keras.MultiHeadAttention``, and a text classifier.

``EncoderLayer`` is the post-norm block of "Attention Is All You Need" as the TensorFlow
tutorials write it (attention, dropout, residual, LayerNorm(eps=1e-6); ReLU feed-forward,
dropout, residual, LayerNorm). ``text_classifier`` stacks it into the usual small model:
token + position embeddings, encoder blocks, masked mean pooling, softmax.
"""

from __future__ import annotations

from .._validation import check_dropout, check_positive_int
from ._backend import import_keras
from .layers import MultiHeadAttention

__all__ = ["EncoderLayer", "TokenAndPositionEmbedding", "text_classifier"]

keras = import_keras()


@keras.saving.register_keras_serializable(package="multihead")
class EncoderLayer(keras.layers.Layer):
    """Post-norm Transformer encoder block, (B, L, d_model) -> (B, L, d_model)::

        x = LayerNorm(x + Dropout(MultiHeadAttention(x, x)))
        x = LayerNorm(x + Dropout(Dense(d_model)(Dense(dff, relu)(x))))

    Args:
        d_model: E, the model width; divisible by ``num_heads`` (D = d_model / num_heads).
        num_heads: H attention heads.
        dff: width of the feed-forward hidden layer.
        dropout_rate: dropout after the attention and after the feed-forward, in [0, 1).

    Call: ``layer(x, attention_mask=None, training=None)``; a Keras padding mask on ``x``
    (``Embedding(mask_zero=True)``) hides padded keys and is passed on to the output.
    ``attention_mask`` is a Keras (B, L, S) mask (1 = attend) or a ``multihead.masks`` mask.
    """

    def __init__(
        self, d_model: int, num_heads: int, dff: int, dropout_rate: float = 0.1, **kwargs
    ) -> None:
        super().__init__(**kwargs)
        for name, value in (("d_model", d_model), ("num_heads", num_heads), ("dff", dff)):
            check_positive_int(name, value)
        if d_model % num_heads:
            raise ValueError(
                "d_model must be divisible by num_heads (each head gets d_model / num_heads). "
                f"Received: d_model={d_model}, num_heads={num_heads}"
            )
        self.d_model, self.num_heads, self.dff = d_model, num_heads, dff
        self.dropout_rate = check_dropout(dropout_rate, "dropout_rate")
        self.mha = MultiHeadAttention(num_heads, d_model // num_heads, name="mha")
        self.ffn1 = keras.layers.Dense(dff, activation="relu", name="ffn1")
        self.ffn2 = keras.layers.Dense(d_model, name="ffn2")
        self.layernorm1 = keras.layers.LayerNormalization(epsilon=1e-6, name="layernorm1")
        self.layernorm2 = keras.layers.LayerNormalization(epsilon=1e-6, name="layernorm2")
        self.dropout1 = keras.layers.Dropout(dropout_rate)
        self.dropout2 = keras.layers.Dropout(dropout_rate)
        self.supports_masking = True

    def build(self, input_shape) -> None:
        # build every sublayer now, so a saved model's weights load before the first call
        self.mha.build(input_shape, input_shape)
        self.ffn1.build(input_shape)
        self.ffn2.build((*input_shape[:-1], self.dff))
        self.layernorm1.build(input_shape)
        self.layernorm2.build(input_shape)

    def call(self, x, mask=None, attention_mask=None, training=None):
        attn = self.mha(
            x,
            x,
            query_mask=mask,
            value_mask=mask,
            attention_mask=attention_mask,
            training=training,
        )
        x = self.layernorm1(x + self.dropout1(attn, training=training))
        ffn = self.ffn2(self.ffn1(x))
        return self.layernorm2(x + self.dropout2(ffn, training=training))

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self) -> dict:
        return {
            **super().get_config(),
            "d_model": self.d_model,
            "num_heads": self.num_heads,
            "dff": self.dff,
            "dropout_rate": self.dropout_rate,
        }


@keras.saving.register_keras_serializable(package="multihead")
class TokenAndPositionEmbedding(keras.layers.Layer):
    """Token ids (B, L) -> token embedding + learned position embedding (B, L, d_model).

    Id 0 is padding: the output carries the Keras mask ``ids != 0``, which the encoder blocks
    and ``GlobalAveragePooling1D`` honour.
    """

    def __init__(self, vocab_size: int, max_len: int, d_model: int, **kwargs) -> None:
        super().__init__(**kwargs)
        for name, value in (("vocab_size", vocab_size), ("max_len", max_len), ("d_model", d_model)):
            check_positive_int(name, value)
        self.vocab_size, self.max_len, self.d_model = vocab_size, max_len, d_model
        self.tokens = keras.layers.Embedding(vocab_size, d_model, mask_zero=True, name="tokens")
        self.positions = keras.layers.Embedding(max_len, d_model, name="positions")

    def build(self, input_shape) -> None:
        self.tokens.build(input_shape)
        self.positions.build((input_shape[-1],))

    def call(self, ids):
        positions = keras.ops.arange(keras.ops.shape(ids)[-1])
        return self.tokens(ids) + self.positions(positions)

    def compute_mask(self, ids, mask=None):
        return keras.ops.not_equal(ids, 0)

    def compute_output_shape(self, input_shape):
        return (*input_shape, self.d_model)

    def get_config(self) -> dict:
        return {
            **super().get_config(),
            "vocab_size": self.vocab_size,
            "max_len": self.max_len,
            "d_model": self.d_model,
        }


def text_classifier(
    vocab_size: int,
    max_len: int,
    num_classes: int = 2,
    *,
    d_model: int = 32,
    num_heads: int = 2,
    dff: int = 64,
    num_layers: int = 1,
    dropout_rate: float = 0.1,
) -> keras.Model:
    """A small Transformer text classifier (functional Keras model, not compiled).

    Input: token ids (B, max_len), 0 = padding. Output: class probabilities (B, num_classes).
    """
    check_positive_int("num_classes", num_classes)
    check_positive_int("num_layers", num_layers)
    ids = keras.Input((max_len,), dtype="int32", name="ids")
    x = TokenAndPositionEmbedding(vocab_size, max_len, d_model)(ids)
    for _ in range(num_layers):
        x = EncoderLayer(d_model, num_heads, dff, dropout_rate)(x)
    x = keras.layers.GlobalAveragePooling1D()(x)  # mean over real tokens (honours the mask)
    x = keras.layers.Dropout(dropout_rate)(x)
    probs = keras.layers.Dense(num_classes, activation="softmax")(x)
    return keras.Model(ids, probs, name="text_classifier")
