"""torch.compile(fullgraph=True, dynamic=True) on every model-level entry point: no graph
break (fullgraph=True raises at the first, naming its reason), at most 2 recompilations over
8 (batch, length) shapes (dynamo's own count of the graphs it compiled), outputs equal to
eager within 1e-5.

Forward-only graphs run on dynamo's ``eager`` backend (the captured graph itself, with
symbolic shapes); training steps and the fused op on ``aot_eager``: AOTAutograd's forward and
backward graphs exactly as Inductor receives them, without generating C++ (minutes on 2
cores). Graph breaks and recompiles are dynamo's business, so the backend does not change
what is counted. Every model is tiny and related cases share one graph: the cost is tracing.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch._dynamo
from torch import Tensor, nn
from torch._dynamo.utils import counters

import multihead as mh
from multihead import masks

# (batch, length) shapes: no size 0 or 1, which dynamo specializes on by design. The first
# shape's sizes equal no fixed size of the tests' inputs (2 heads or features, 3 steps, 4
# pixels, 6 words): dynamo gives equal sizes one symbol at the first trace (duck sizing), and
# a batch of 2 beside 2 heads was pinned to 2 and compiled again at the next shape
SHAPES = [(5, 9), (2, 5), (3, 7), (4, 9), (2, 11), (5, 6), (3, 13), (6, 8), (2, 17)]
MAX_RECOMPILES = 2
# fp32 on both sides; compiled graphs may fuse or reorder float sums (a few ulp at E <= 32):
# 1e-5 absolute, relative to the size of the values above 1 (summed gradients reach ~10)
TOL = 1e-5


def _leaves(out: object) -> list[Tensor]:
    if isinstance(out, Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for x in out for t in _leaves(x)]
    return []


def check_compiled(
    fn: Callable,
    inputs: Callable[[int, int], tuple],
    *,
    shapes=SHAPES,
    backend="eager",
    grads: nn.Module | None = None,
) -> dict[str, float]:
    """``fn(*inputs(B, L))`` (``inputs`` deterministic) compiled with fullgraph=True,
    dynamic=True (a graph break raises, with its reason: a second trace by
    ``torch._dynamo.explain`` only to count breaks cost a fifth of this file's time), then
    compilations and the worst difference from eager over every shape (outputs, and with
    ``grads`` the gradients of the outputs' sum of squares with respect to that module's
    parameters). Asserts the three rules and returns what it measured."""
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(fn, backend=backend, fullgraph=True, dynamic=True)
    worst = 0.0
    for b, length in shapes:
        # fresh inputs for each side: a call may change them (a cache's contents)
        expected, got = _leaves(fn(*inputs(b, length))), _leaves(compiled(*inputs(b, length)))
        if grads is not None:
            params = list(grads.parameters())
            expected += torch.autograd.grad(sum(t.square().sum() for t in expected), params)
            got += torch.autograd.grad(sum(t.square().sum() for t in got), params)
        assert len(expected) == len(got) > 0
        for e, g in zip(expected, got):
            assert e.shape == g.shape
            scale = max(1.0, e.abs().max().item()) if e.numel() else 1.0
            worst = max(worst, (e.double() - g.double()).abs().max().item() / scale)
    # graphs compiled: a restart of one compile (dynamo specializing a float it first kept
    # symbolic) is not a recompilation and is not counted here
    compiles = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    assert 1 <= compiles <= 1 + MAX_RECOMPILES, compiles
    assert worst <= TOL, worst
    return {"compiles": compiles, "err": worst}


def test_a_graph_break_fails_the_check():
    """The check catches a break without ``explain``: fullgraph=True raises at it."""

    def fn(x):
        torch._dynamo.graph_break()
        return x * 2

    with pytest.raises(torch._dynamo.exc.Unsupported):
        check_compiled(fn, lambda b, length: (_randn(b, length),), shapes=SHAPES[:1])


def _randn(*shape: int) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))


def _lengths(b: int, length: int, seed: int) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    n = torch.randint(1, length + 1, (b,), generator=g)
    n[0] = length  # one full row: the padded length is the batch's longest
    return n


# ------------------------------------------------------------------------------------------
# MultiHeadAttention, every mask kind, the mask built inside the compiled function


def _mask(kind: str, n: Tensor, length: int):
    keep = torch.arange(length) < n[:, None]  # [B, S]
    return {
        "none": lambda: None,
        "causal": masks.causal,
        "causal_top_left": lambda: masks.causal(align="top_left"),
        "sliding_window": lambda: masks.sliding_window(2, 1),
        "lengths": lambda: masks.lengths(n),
        "lengths_per_query": lambda: masks.lengths(
            torch.minimum(n[:, None], torch.arange(1, length + 1))
        ),
        "lengths_query_lens": lambda: masks.lengths(n, query_lens=n),
        "key_padding": lambda: masks.key_padding(keep),
        "documents": lambda: masks.documents((torch.arange(length) >= length // 2).long()),
        "dense": lambda: keep[:, None, None, :] & keep[:, None, :, None],
        "predicate": lambda: masks.predicate(lambda b, h, q, k: (q - k).abs() <= 2),
        "causal_and_lengths": lambda: masks.causal() & masks.lengths(n, query_lens=n),
        "window_or_padding": lambda: masks.sliding_window(1) | masks.key_padding(keep),
    }[kind]()


KINDS = ["none", "causal", "causal_top_left", "sliding_window", "lengths", "lengths_per_query",
         "lengths_query_lens", "key_padding", "documents", "dense", "predicate",
         "causal_and_lengths", "window_or_padding"]  # fmt: skip


def test_multihead_attention_every_mask_kind():
    """One graph holds the module under every mask kind (one trace instead of 13), each mask
    built inside the graph from the lengths tensor; outputs equal eager. (Gradients through
    compiled attention: the training steps below.)"""
    torch.manual_seed(0)
    module = mh.MultiHeadAttention(16, 4, num_kv_heads=2).eval()

    def fn(x, n):
        return [module(x, mask=_mask(kind, n, x.shape[1])) for kind in KINDS]

    inputs = lambda b, length: (_randn(b, length, 16), _lengths(b, length, b))  # noqa: E731
    check_compiled(fn, inputs)


# ------------------------------------------------------------------------------------------
# stacks and models


def test_encoder_and_decoder_stacks_with_padding():
    torch.manual_seed(2)
    layers = [mh.TransformerEncoderLayer(16, 2, 32, norm_first=True) for _ in range(2)]
    encoder = mh.TransformerEncoder(layers, norm=nn.LayerNorm(16)).eval()
    layers = [
        mh.TransformerDecoderLayer(
            self_attn=mh.MultiHeadAttention(16, 4, num_kv_heads=2, bias=False),
            feed_forward=mh.GatedFeedForward(16, 24),
            norm1=mh.RMSNorm(16),
            norm2=mh.RMSNorm(16),
        )
        for _ in range(2)
    ]
    decoder = mh.TransformerDecoder(layers, norm=mh.RMSNorm(16)).eval()

    def fn(x, n):
        padded = masks.lengths(n, query_lens=n)
        return encoder(x, mask=padded), decoder(x, mask=masks.causal() & padded)

    check_compiled(fn, lambda b, length: (_randn(b, length, 16), _lengths(b, length, 4)))


def _ids(b: int, length: int, vocab: int, seed: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = _lengths(b, length, seed)
    ids = torch.randint(1, vocab, (b, length), generator=g)
    return ids.masked_fill(torch.arange(length) >= n[:, None], 0), n


def test_bert_padded_batches():
    from multihead.models.bert import Bert, BertConfig

    torch.manual_seed(4)
    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=32,
                        max_position_embeddings=32)  # fmt: skip
    model = Bert(config, pooler=True).eval()

    def fn(ids, n):
        out = model.run(ids, lengths=n)
        return out.last_hidden_state, out.pooler_output

    check_compiled(fn, lambda b, length: _ids(b, length, 50, 6))


def _gpt2():
    from multihead.models.gpt2 import GPT2, GPT2Config

    torch.manual_seed(5)
    return GPT2(GPT2Config(vocab_size=60, n_positions=64, n_embd=16, n_layer=2, n_head=2)).eval()


def _llama():
    from multihead.models.llama import Llama, LlamaConfig

    torch.manual_seed(6)
    config = LlamaConfig(vocab_size=60, hidden_size=16, intermediate_size=24,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64)  # fmt: skip
    return Llama(config).eval()


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_causal_lm_forward_padded(family):
    model = _gpt2() if family == "gpt2" else _llama()

    def fn(ids, n):
        return model(ids, lengths=n)

    check_compiled(fn, lambda b, length: _ids(b, length, 60, 7))


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_cached_decode_step(family):
    """One decode step on a cache filled by a ragged prefill (rows of different lengths):
    compiled, it writes the new keys by a scatter and attends over the whole fixed cache under
    a lengths mask computed on the device; logits and the cache contents equal eager's."""
    model = _gpt2() if family == "gpt2" else _llama()

    def step(tokens, cache):
        positions = cache.step.positions
        return model.lm_head(model.decoder(model.embed(tokens, positions), cache=cache))

    def inputs(b, length):
        ids, n = _ids(b, length, 60, 8)
        cache = model.new_cache(b, max_length=length + 3)
        with torch.no_grad():
            model.extend(ids, n, cache)
        cache.begin(1)
        return ids[:, :1] + 1, cache

    def fn(tokens, cache):
        with torch.no_grad():
            return step(tokens, cache), cache._keys, cache._values

    check_compiled(fn, inputs)


# ------------------------------------------------------------------------------------------
# the training steps of the three `multihead train` applications (their models, their losses;
# no dropout, so eager and compiled draw nothing random)


@pytest.mark.slow
def test_train_steps_of_the_three_apps():
    """The sentiment regressor (BERT, padded batches), the causal forecaster and the cross-modal
    model, each with its app's loss, in one compiled graph (one trace instead of three):
    losses and every parameter's gradient equal eager."""
    from multihead.apps.crossmodal import CrossModalQA
    from multihead.apps.forecast import CausalForecaster
    from multihead.apps.sentiment import SentimentRegressor
    from multihead.models.bert import Bert, BertConfig

    torch.manual_seed(9)
    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                        num_attention_heads=2, intermediate_size=32, max_position_embeddings=32,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # fmt: skip
    sentiment = SentimentRegressor(Bert(config), hidden=8, dropout=0.0)
    forecaster = CausalForecaster(3, embed_dim=16, num_heads=2, num_layers=1, ff_dim=32,
                                  linear_lags=4)  # fmt: skip
    crossmodal = CrossModalQA()
    models = nn.ModuleList([sentiment, forecaster, crossmodal])
    first = 3  # the forecast app's first position with a whole linear context

    def step(ids, n, target, series, ahead, words, count, image, answer):
        # each app's per-example loss, summed as fit() sums it
        return (
            (sentiment(ids, n).float() - target).pow(2).sum(),
            (forecaster(series)[:, first:].float() - ahead).pow(2).mean(dim=(1, 2)).sum(),
            nn.functional.binary_cross_entropy_with_logits(
                crossmodal(words, count, image).float(), answer, reduction="none"
            ).sum(),
        )

    def inputs(b, length):
        ids, n = _ids(b, length, 50, 10)
        target = torch.rand(b, generator=torch.Generator().manual_seed(b)) * 2 - 1
        series = _randn(b, length + first + 1, 2)  # forecast windows: (B, L, 2 features)
        ahead = _randn(b, length + 1, 3)  # three steps ahead from each position >= first
        words, count = _ids(b, min(length, 6), 10, 13)  # questions of at most 6 words
        image = _randn(b, 16, 4)  # 16 patches of 2 x 2 pixels
        return ids, n, target, series, ahead, words, count, image, (torch.arange(b) % 2).float()

    check_compiled(step, inputs, grads=models, backend="aot_eager")


# ------------------------------------------------------------------------------------------
# the fused kernel's op in a compiled graph (issue 18): with a cold plan cache the planner's
# host reads used to break the graph; a compiled graph now builds its plan on the device


def test_fused_op_in_a_compiled_graph_with_a_cold_plan_cache():
    from multihead.backends import _plan, fused

    if fused.build_error() is not None:
        pytest.fail(f"the fused kernel must build on the test machine: {fused.build_error()}")
    fused._FLAT.clear()
    _plan._PLANS.clear()

    def fn(q, n):
        k, v = q.flip(2), q * 0.5
        padding = masks.key_padding(torch.arange(q.shape[2]) < n[:, None])
        kinds = (None, masks.causal(), masks.lengths(n, query_lens=n),
                 masks.sliding_window(2) & padding)  # fmt: skip
        return [mh.attention(q, k, v, mask, backend="fused") for mask in kinds]

    def inputs(b, length):
        return _randn(b, 2, length, 8), _lengths(b, length, 14)

    # explain traces first, on the cold cache: no break means nothing was planned on the host
    check_compiled(fn, inputs)
