"""KVCache: cached decoding equals recomputing every row alone from scratch, at every step, for
fixed, growing and rolling caches, with rows of different lengths in one batch."""

from __future__ import annotations

import pytest
import torch
from helpers import llama_decoder

import multihead as mh
from multihead import masks

E, H, H_KV, D = 32, 4, 2, 8


def _stack(layers: int = 2) -> mh.TransformerDecoder:
    """A Llama-style stack: rotary GQA attention, SwiGLU, RMSNorm."""
    torch.manual_seed(0)
    return llama_decoder(layers, E, H, H_KV, D).eval()


def _pad(chunks: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad (n_b, E) chunks into (B, L, E), padding filled with large junk."""
    width = max(c.shape[0] for c in chunks)
    out = torch.full((len(chunks), max(width, 1), E), 1e4)
    for b, c in enumerate(chunks):
        out[b, : c.shape[0]] = c
    return out, torch.tensor([c.shape[0] for c in chunks])


# rows start with prompts of 5, 9 and 2 tokens; then three one-token steps, a step of 3, 0 and
# 2 tokens (chunked prefill, one row idle), and two more one-token steps
PROMPTS = [5, 9, 2]
STEPS = [[1, 1, 1]] * 3 + [[3, 0, 2]] + [[1, 1, 1]] * 2


def _run(stack, cache, window=None):
    """Feed PROMPTS then STEPS through the cache; after each step compare every row's new
    outputs with the stack run on that row's whole sequence alone (<= 1e-5 in fp32)."""
    g = torch.Generator().manual_seed(1)
    seqs = [
        torch.randn(n + sum(s[b] for s in STEPS), E, generator=g) for b, n in enumerate(PROMPTS)
    ]
    done = [0, 0, 0]
    full = []
    with torch.no_grad():
        for seq in seqs:
            mask = masks.causal() if window is None else masks.sliding_window(window - 1)
            full.append(stack(seq[None], mask=mask)[0])
        for counts in [PROMPTS, *STEPS]:
            x, n = _pad([seqs[b][done[b] : done[b] + c] for b, c in enumerate(counts)])
            cache.begin(n, x.shape[1])
            out = stack(x, cache=cache)
            for b, c in enumerate(counts):
                expected = full[b][done[b] : done[b] + c]
                assert ((out[b, :c] - expected).abs() <= 1e-5).all(), (counts, b)
                done[b] += c
    assert cache.lengths.tolist() == [len(s) for s in seqs]
    return seqs, full


@pytest.mark.parametrize("max_length", [None, 20], ids=["growing", "fixed"])
def test_cached_decoding_equals_full_recompute(max_length):
    stack = _stack()
    cache = mh.KVCache(2, 3, H_KV, D, max_length=max_length)
    _run(stack, cache)
    assert cache.capacity == (64 if max_length is None else 20)


def test_rolling_cache_equals_sliding_window_recompute():
    """A window of 4 keys per query: a prompt of 9 tokens is longer than the window, and the
    ring never holds more than 4 tokens per row."""
    stack = _stack()
    cache = mh.KVCache(2, 3, H_KV, D, window=4)
    before = cache.nbytes
    _run(stack, cache, window=4)
    assert cache.capacity == 4 and cache.nbytes == before == 2 * 3 * 4 * H_KV * 2 * D * 4


@pytest.mark.parametrize("kind", ["growing", "rolling"])
def test_one_token_steps_take_the_short_path_on_the_kernel(monkeypatch, kind):
    """A step of one token per row runs every layer through ``multihead.routes``: checked and
    chosen on the first layer, then the fused kernel prepared once for the step (``auto``
    made to pick it: the tests turn its measurement off). Every row still equals the whole
    recompute (``_run``'s rule), and no layer's call goes through ``registry.run``."""
    from multihead import decoding_routes as routes
    from multihead.backends import fused, registry

    monkeypatch.setattr(registry, "_CHOICES", {})
    monkeypatch.setattr(fused, "measured_faster", lambda call, rival: True)
    stepped, routed, ran = [], [], []
    attend, route, run = routes.attend, routes._route, registry.run
    monkeypatch.setattr(routes, "attend", lambda *a: stepped.append(a[0].shape) or attend(*a))
    monkeypatch.setattr(routes, "_route", lambda *a: routed.append(1) or route(*a))
    monkeypatch.setattr(registry, "run", lambda *a: ran.append(a[0].shape) or run(*a))
    stack = _stack()
    window = 4 if kind == "rolling" else None
    _run(stack, mh.KVCache(2, 3, H_KV, D, window=window), window=window)
    one_token = sum(1 for s in STEPS if max(s) == 1)  # steps whose every row has one token
    assert len(stepped) == 2 * one_token  # both layers of each
    assert len(routed) == one_token  # the first layer works the route out, the second reuses it
    # registry.run saw the prompts, the 3-token step and the full recomputes, no step's call
    assert all(shape[2] != 1 for shape in ran)


def test_the_short_path_is_not_taken_for_training_or_a_bias(monkeypatch):
    """Dropout while training and an explicit bias take ``attention`` as before; the same
    step in eval mode takes the short path."""
    from multihead import decoding_routes as routes

    attn = mh.MultiHeadAttention(E, H, num_kv_heads=H_KV, dropout=0.5)
    cache = mh.KVCache(1, 1, H_KV, D)
    calls = []
    real = routes.attend
    monkeypatch.setattr(routes, "attend", lambda *a: calls.append(1) or real(*a))
    cache.begin(1)
    attn.train()
    attn(torch.randn(1, 1, E), cache=cache[0])
    cache.begin(1)
    attn.eval()
    with torch.no_grad():
        attn(torch.randn(1, 1, E), cache=cache[0], bias=torch.zeros(1, H, 1, 2))
    assert calls == []
    cache.begin(1)
    with torch.no_grad():
        attn(torch.randn(1, 1, E), cache=cache[0])
    assert calls == [1]


def test_growing_cache_grows_and_fixed_refuses():
    stack = _stack(1)
    cache = mh.KVCache(1, 1, H_KV, D)
    assert cache.capacity == 0
    with torch.no_grad():
        cache.begin(70)
        stack(torch.randn(1, 70, E), cache=cache)
        assert cache.capacity == 128  # rounded up to whole blocks of 64 slots
        cache.begin(100)
        stack(torch.randn(1, 100, E), cache=cache)
        assert cache.capacity == 256  # doubled (170 needed): amortized O(1) per token
    fixed = mh.KVCache(1, 2, H_KV, D, max_length=8)
    fixed.begin(torch.tensor([8, 3]))
    stack(torch.randn(2, 8, E), cache=fixed)
    with pytest.raises(
        ValueError, match=r"holds max_length=8 tokens per row, and this step needs 9"
    ):
        fixed.begin(1)


def test_garbage_beyond_each_rows_length_is_never_read():
    """NaN in every slot past a row's length (what a reused or preallocated cache may hold)
    leaves the next steps unchanged: a step reads only each row's valid prefix."""
    stack = _stack()
    outs = []
    for poison in (False, True):
        cache = mh.KVCache(2, 3, H_KV, D, max_length=16)
        g = torch.Generator().manual_seed(4)
        x, n = _pad([torch.randn(c, E, generator=g) for c in PROMPTS])
        with torch.no_grad():
            cache.begin(n, x.shape[1])
            stack(x, cache=cache)
            if poison:
                for b, length in enumerate(cache.lengths.tolist()):
                    cache._keys[:, b, :, length:] = float("nan")
                    cache._values[:, b, :, length:] = float("nan")
            for _ in range(3):
                cache.begin(1)
                outs.append(stack(torch.randn(3, 1, E, generator=g), cache=cache))
    for clean, poisoned in zip(outs[:3], outs[3:]):
        assert torch.isfinite(poisoned).all()
        torch.testing.assert_close(poisoned, clean, rtol=0, atol=0)


def test_a_step_projects_only_the_new_tokens():
    """O(S) per step: after the prefill, every layer's projections see one token per row."""
    stack = _stack()
    seen = []
    for layer in stack.layers:
        layer.self_attn.q_proj.register_forward_hook(
            lambda m, args, out: seen.append(args[0].shape)
        )
    cache = mh.KVCache(2, 3, H_KV, D)
    with torch.no_grad():
        cache.begin(torch.tensor([4, 2, 1]), 4)
        stack(torch.randn(3, 4, E), cache=cache)
        for _ in range(3):
            cache.begin(1)
            stack(torch.randn(3, 1, E), cache=cache)
    assert seen == [(3, 4, E)] * 2 + [(3, 1, E)] * 6


@pytest.mark.parametrize("window", [None, 3], ids=["prefix", "rolling"])
def test_weights_while_decoding(window):
    """run() in a cached step gives one column per key slot; mapped through
    key_positions() they equal the weights of the full recompute of that row."""
    stack = _stack(1)
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randn(n + 1, E, generator=g) for n in PROMPTS]
    mask = masks.causal() if window is None else masks.sliding_window(window - 1)
    cache = mh.KVCache(1, 3, H_KV, D, window=window)
    with torch.no_grad():
        x, n = _pad([s[:-1] for s in seqs])
        cache.begin(n, x.shape[1])
        stack(x, cache=cache)
        cache.begin(1)
        step = stack.run(torch.stack([s[-1] for s in seqs])[:, None], cache=cache)
        weights = step.weights[0]  # (B, H, 1, S) over cache slots
        columns = cache.key_positions()  # (B, S)
        attn, norm = stack.layers[0].self_attn, stack.layers[0].norm1
        for b, seq in enumerate(seqs):
            _, full = attn.run(norm(seq[None]), mask=mask)
            expected = full[0, :, -1]  # (H, positions) of the row's last query
            mine, held = weights[b, :, 0], columns[b] >= 0
            assert (mine[:, ~held] == 0).all()
            assert (mine[:, held] - expected[:, columns[b][held]]).abs().max() <= 1e-6
            assert (expected.sum(-1) - mine.sum(-1)).abs().max() <= 1e-6


def test_memory_per_token():
    """GQA caches H_kv heads: layers x H_kv x (D + D_v) x bytes per element per token."""
    cache = mh.KVCache(12, 8, 12, 64, max_length=256)  # GPT-2 small, fp32
    assert cache.bytes_per_token == 12 * 12 * 128 * 4 == 73_728
    assert cache.nbytes == 73_728 * 8 * 256
    gqa = mh.KVCache(2, 1, 2, 8, value_dim=4, dtype=torch.bfloat16)
    assert gqa.bytes_per_token == 2 * 2 * (8 + 4) * 2


def _unfinished():
    cache = mh.KVCache(2, 1, H_KV, D)
    cache.begin(1)
    cache.update(0, torch.zeros(1, H_KV, 1, D), torch.zeros(1, H_KV, 1, D))
    cache.begin(1)


def _twice():
    cache = mh.KVCache(1, 1, H_KV, D)
    cache.begin(1)
    cache.update(0, torch.zeros(1, H_KV, 1, D), torch.zeros(1, H_KV, 1, D))
    cache.update(0, torch.zeros(1, H_KV, 1, D), torch.zeros(1, H_KV, 1, D))


def _update(shape, dtype=torch.float32):
    cache = mh.KVCache(1, 2, H_KV, D)
    cache.begin(torch.tensor([2, 1]))
    cache.update(0, torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: mh.KVCache(2, 1, 2, 8, max_length=9, window=4), ValueError, "pass one of them"),
        (lambda: mh.KVCache(0, 1, 2, 8), ValueError, "num_layers must be a positive int"),
        (lambda: mh.KVCache(1, 1, 2, 8, dtype=torch.int32), TypeError, "floating torch.dtype"),
        (lambda: mh.KVCache(1, 2, 2, 8).begin(torch.tensor([1])), ValueError, "one entry per row"),
        (lambda: mh.KVCache(1, 2, 2, 8).begin(torch.tensor([3, 1]), 2), ValueError, r"in \[0, L\]"),
        (lambda: mh.KVCache(1, 1, 2, 8).step, ValueError, "call cache.begin"),
        (lambda: mh.KVCache(1, 1, 2, 8)[1], IndexError, r"layer must be in \[0, 1\)"),
        (_unfinished, ValueError, r"no update from layers \[1\]"),
        (_twice, ValueError, "layer 0 already stored its keys this step"),
        (lambda: _update((2, H_KV, 1, D)), ValueError, r"\(B, H_kv, L, D\)=\(2, 2, 2, 8\)"),
        (lambda: _update((2, H_KV, 2, D), torch.float64), TypeError, "the cache's dtype"),
        (
            lambda: _stack(1)(torch.randn(1, 2, E), mask=masks.causal(), cache=_begun()),
            ValueError,
            "the cache supplies the mask",
        ),
    ],
    ids=[
        "window_and_max",
        "layers",
        "dtype",
        "counts_shape",
        "counts_range",
        "no_step",
        "layer_index",
        "unfinished",
        "twice",
        "shape",
        "value_dtype",
        "mask_and_cache",
    ],
)
def test_bad_use(call, error, match):
    with pytest.raises(error, match=match):
        call()


def _begun():
    cache = mh.KVCache(1, 1, H_KV, D)
    cache.begin(2)
    return cache
