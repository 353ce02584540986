"""One small instance of every class ``multihead.save`` can write, and a forward to compare.

Shared by ``test_fresh_process.py`` and the fresh interpreter it starts. Only torch and
``multihead`` are imported at the top: a class's module is imported inside its ``build``, which
the fresh interpreter never calls, so ``load`` there finds nothing registered beforehand.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import multihead as mh

VOCAB = 50
E, H = 16, 4


def _ids(b: int = 2, length: int = 7) -> torch.Tensor:
    return torch.randint(1, VOCAB, (b, length), generator=torch.Generator().manual_seed(3))


def _x(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(4))


def _lengths() -> torch.Tensor:
    return torch.tensor([7, 4])


def _bert_config() -> Any:
    from multihead.models.bert import BertConfig

    return BertConfig(vocab_size=VOCAB, hidden_size=E, num_hidden_layers=2,
                      num_attention_heads=H, intermediate_size=32,
                      max_position_embeddings=16)  # fmt: skip


def _bert() -> nn.Module:
    from multihead.models.bert import Bert

    return Bert(_bert_config(), pooler=True)


def _decoder(kind: str) -> nn.Module:
    import importlib

    family = importlib.import_module(f"multihead.models.{kind}").FAMILY
    config = family.sized(vocab_size=VOCAB, context=32, width=E, layers=2, heads=H, kv_heads=2)
    return family.model(config)


def _sentiment() -> nn.Module:
    from multihead.apps.sentiment import SentimentRegressor

    return SentimentRegressor(_bert(), hidden=8, alphas=(None, 2.0))


def _pretrained() -> Any:
    from multihead.models import bert

    return bert.load()


def _crossmodal(name: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from multihead.apps import crossmodal

        cls = getattr(crossmodal, name)
        if name == "QuestionOnly":
            return cls(text_dim=E, num_heads=H)
        if name == "ImageOnly":
            return cls(image_dim=24, num_heads=H, num_patches=4, patch_dim=16)
        return cls(text_dim=E, image_dim=24, num_heads=H, num_patches=4, patch_dim=16)

    return build


def _crossmodal_inputs() -> tuple:
    return (_ids(2, 5).clamp_max(9), torch.tensor([5, 3]), _x(2, 4, 16))


def _forecaster() -> nn.Module:
    from multihead.apps.forecast import CausalForecaster

    return CausalForecaster(3, embed_dim=E, num_heads=H, num_layers=2, ff_dim=32, linear_lags=4)


def _classifier() -> nn.Module:
    from multihead.apps.sentiment import AttentionClassifier

    return AttentionClassifier(VOCAB, embed_dim=E, num_heads=H)


def _encoder_stack() -> nn.Module:
    return mh.TransformerEncoder([mh.TransformerEncoderLayer(E, H, 32) for _ in range(2)])


def _decoder_layer() -> nn.Module:
    return mh.TransformerDecoderLayer(
        mh.MultiHeadAttention(E, H, num_kv_heads=2, bias=False, rotary=mh.RotaryEmbedding(E // H)),
        mh.GatedFeedForward(E, 32),
        norm1=mh.RMSNorm(E),
        norm2=nn.LayerNorm(E),
    )


def _decoder_stack() -> nn.Module:
    return mh.TransformerDecoder([_decoder_layer() for _ in range(2)], norm=mh.RMSNorm(E))


# name recorded in config.json -> (build, inputs of the forward to compare)
CASES: dict[str, tuple[Callable[[], Any], Callable[[], tuple]]] = {
    "multihead.FeedForward": (lambda: mh.FeedForward(E, 32), lambda: (_x(2, 5, E),)),
    "multihead.GatedFeedForward": (lambda: mh.GatedFeedForward(E, 32), lambda: (_x(2, 5, E),)),
    "multihead.LearnedPositionalEncoding": (
        lambda: mh.LearnedPositionalEncoding(12, E),
        lambda: (_x(2, 5, E),),
    ),
    "multihead.SinusoidalPositionalEncoding": (
        lambda: mh.SinusoidalPositionalEncoding(E, max_len=12),
        lambda: (_x(2, 5, E),),
    ),
    "multihead.MultiHeadAttention": (
        lambda: mh.MultiHeadAttention(E, H, num_kv_heads=2),
        lambda: (_x(2, 5, E),),
    ),
    "multihead.RMSNorm": (lambda: mh.RMSNorm(E), lambda: (_x(2, 5, E),)),
    "multihead.RotaryEmbedding": (lambda: mh.RotaryEmbedding(8), lambda: (_x(2, H, 5, 8),)),
    "multihead.TransformerEncoderLayer": (
        lambda: mh.TransformerEncoderLayer(E, H, 32),
        lambda: (_x(2, 5, E),),
    ),
    "multihead.TransformerEncoder": (_encoder_stack, lambda: (_x(2, 5, E),)),
    "multihead.TransformerDecoderLayer": (_decoder_layer, lambda: (_x(2, 5, E),)),
    "multihead.TransformerDecoder": (_decoder_stack, lambda: (_x(2, 5, E),)),
    "multihead.apps.crossmodal.CrossModalQA": (_crossmodal("CrossModalQA"), _crossmodal_inputs),
    "multihead.apps.crossmodal.QuestionOnly": (_crossmodal("QuestionOnly"), _crossmodal_inputs),
    "multihead.apps.crossmodal.ImageOnly": (_crossmodal("ImageOnly"), _crossmodal_inputs),
    "multihead.apps.forecast.CausalForecaster": (_forecaster, lambda: (_x(2, 9, 2),)),
    "multihead.apps.sentiment.AttentionClassifier": (_classifier, lambda: (_ids(), _lengths())),
    "multihead.apps.sentiment.SentimentRegressor": (_sentiment, lambda: (_ids(), _lengths())),
    "multihead.models.bert.Bert": (_bert, lambda: (_ids(),)),
    "multihead.models.bert.Pretrained": (_pretrained, lambda: (_ids(2, 9),)),
    "multihead.models.gpt2.GPT2": (lambda: _decoder("gpt2"), lambda: (_ids(),)),
    "multihead.models.llama.Llama": (lambda: _decoder("llama"), lambda: (_ids(),)),
    "torch.nn.Dropout": (lambda: nn.Dropout(0.3), lambda: (_x(2, 5),)),
    "torch.nn.Embedding": (lambda: nn.Embedding(VOCAB, E, padding_idx=0), lambda: (_ids(),)),
    "torch.nn.GELU": (lambda: nn.GELU(approximate="tanh"), lambda: (_x(2, 5),)),
    "torch.nn.Identity": (nn.Identity, lambda: (_x(2, 5),)),
    "torch.nn.LayerNorm": (lambda: nn.LayerNorm(E), lambda: (_x(2, E),)),
    "torch.nn.Linear": (lambda: nn.Linear(E, 3), lambda: (_x(2, E),)),
    "torch.nn.ModuleList": (
        lambda: nn.ModuleList([mh.TransformerEncoderLayer(E, H, 32)]),
        lambda: (_x(2, 5, E),),
    ),
    "torch.nn.RMSNorm": (lambda: nn.RMSNorm(E), lambda: (_x(2, E),)),
    "torch.nn.ReLU": (nn.ReLU, lambda: (_x(2, 5),)),
    "torch.nn.Sequential": (
        lambda: nn.Sequential(nn.Linear(E, 8), nn.SiLU(), nn.Linear(8, 2)),
        lambda: (_x(2, E),),
    ),
    "torch.nn.SiLU": (nn.SiLU, lambda: (_x(2, 5),)),
    "torch.nn.Tanh": (nn.Tanh, lambda: (_x(2, 5),)),
}


def run(obj: Any, name: str) -> torch.Tensor:
    """The forward compared across processes: ``obj`` in eval mode on the case's inputs."""
    inputs = CASES[name][1]()
    if isinstance(obj, nn.ModuleList):
        return obj[0](*inputs)
    module = obj.model if name.endswith("bert.Pretrained") else obj
    module.eval()
    with torch.no_grad():
        return module(*inputs)
