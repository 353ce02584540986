"""The decoding step's short path (``multihead/decode_route.py``) through transformers'
attention interface: one query row per call, grouped heads folded into rows, the checks and
the backend choice kept per mask object.

Every decode call is compared with ``multihead.attention`` on the same arguments (the whole
path). Folding changes only the order of floating-point sums (a matrix product over the rows
of a group instead of one vector product per head), so the outputs agree to fp32 rounding:
within 1e-6 of their largest entry.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import transformers as tf
from transformers import masking_utils as mu

import multihead
from multihead import bias, masks
from multihead import decoding_routes as decode_route  # the name routes is a fixture here
from multihead.hf import attention as hf_attention
from multihead.hf import capture, make_mask

RTOL = 1e-6
B, H, H_KV, D, S = 3, 6, 2, 8, 21


def _qkv(heads: int = H, kv_heads: int = H_KV, length_k: int = S, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, heads, 1, D, generator=g)
    k = torch.randn(B, kv_heads, length_k, D, generator=g)
    v = torch.randn(B, kv_heads, length_k, D, generator=g)
    return q, k, v


def _padding(length_k: int, pads: tuple[int, ...] = (0, 4, 9)) -> torch.Tensor:
    keep = torch.ones(B, length_k, dtype=torch.bool)
    for b, pad in enumerate(pads):
        keep[b, :pad] = False
    return keep


def _decode_mask(length_k: int = S, **kwargs) -> multihead.masks.Mask | None:
    """What transformers' mask interface receives for the last position of a cache of
    ``length_k`` keys, through multihead's ``make_mask``."""
    args = dict(batch_size=B, q_length=1, kv_length=length_k, q_offset=length_k - 1)
    return make_mask(**{**args, **kwargs})


class _Layer(torch.nn.Module):
    """A stand-in attention module (only recording's layer lookup reads it)."""


def _bridge(q, k, v, mask, **kwargs) -> torch.Tensor:
    with torch.inference_mode():
        out, weights = hf_attention.attention_forward(_Layer(), q, k, v, mask, **kwargs)
    assert weights is None
    return out


def _whole(q, k, v, mask, scale=None, softcap=None) -> torch.Tensor:
    """``multihead.attention`` in transformers' layout (B, L, H, D_v)."""
    cap = None if softcap is None else bias.softcap(softcap)
    with torch.inference_mode():
        out = multihead.attention(q, k, v, mask, bias=cap, scale=scale)
    return out.transpose(1, 2)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.is_contiguous()
    assert (got - want).abs().max() <= RTOL * want.abs().max()


@pytest.fixture
def routes(monkeypatch) -> list[tuple]:
    """The routes worked out (each a call to ``decode_route._route``), in order, from none kept."""
    monkeypatch.setattr(decode_route, "_UNMASKED", {})
    made: list[tuple] = []
    original = decode_route._route

    def spy(q, k, v, mask, scale, softcap):
        route = original(q, k, v, mask, scale, softcap)
        made.append((mask, route))
        return route

    monkeypatch.setattr(decode_route, "_route", spy)
    return made


# (what transformers passes make_mask, the folded call's mask: none, the step's own mask
# (padding: its rows are alike), or the single row lowered to key padding once per step)
CASES = {
    "causal": (dict(), "none"),
    "causal, left padding": (dict(attention_mask=_padding(S)), "own"),
    "sliding window, left padding": (
        dict(mask_function=mu.sliding_window_causal_mask_function(5), attention_mask=_padding(S)),
        "lowered",
    ),
    "static cache (empty slots after the query)": (dict(q_offset=12), "lowered"),
    "every key hidden in a row": (dict(attention_mask=_padding(S, (0, S, 2))), "own"),
}


@pytest.mark.parametrize(("kwargs", "how"), CASES.values(), ids=CASES.keys())
@pytest.mark.parametrize("softcap", [None, 1.5], ids=["", "softcap"])
def test_a_folded_decode_call_equals_the_whole_path(routes, kwargs, how, softcap):
    q, k, v = _qkv()
    mask = _decode_mask(**kwargs)
    got = _bridge(q, k, v, mask, scaling=0.3, softcap=softcap)
    _close(got, _whole(q, k, v, mask, scale=0.3, softcap=softcap))
    ((_, route),) = routes
    assert route.folded == (B, H_KV, H // H_KV, D)
    assert route.own_mask == (how == "own")
    assert (route.mask is None) == (how != "lowered")


@pytest.mark.parametrize(("kwargs", "how"), CASES.values(), ids=CASES.keys())
@pytest.mark.parametrize("softcap", [None, 1.5], ids=["", "softcap"])
def test_a_prepared_call_takes_the_same_route_without_its_checks_again(
    routes, monkeypatch, kwargs, how, softcap
):
    # decode_route.run: the compressed layers' decoding steps, whose call is already prepared
    from multihead.backends import call as calls

    q, k, v = _qkv()
    mask = _decode_mask(**kwargs)
    cap = None if softcap is None else bias.softcap(softcap)
    with torch.inference_mode():
        prepared = calls.prepare(q, k, v, mask, cap, 0.3, 0.0, False)
        checks = []
        monkeypatch.setattr(decode_route, "prepare", lambda *a: checks.append(a))
        got = decode_route.run(prepared)
        again = decode_route.run(prepared)
    _close(got, _whole(q, k, v, mask, scale=0.3, softcap=softcap))
    assert torch.equal(again, got)
    assert checks == [] and routes == []  # not through _route: no second prepare
    (route,) = decode_route._routes(mask).values()
    assert route.folded == (B, H_KV, H // H_KV, D)
    assert route.own_mask == (how == "own")


@pytest.fixture
def kernel_leads(monkeypatch):
    """auto picks the fused kernel (the tests turn its measurement off: conftest.py)."""
    from multihead.backends import fused, registry

    monkeypatch.setattr(registry, "_CHOICES", {})
    monkeypatch.setattr(fused, "measured_faster", lambda call, rival: True)
    runs = []
    original = registry.run
    monkeypatch.setattr(registry, "run", lambda *a: runs.append(a) or original(*a))
    return runs


@pytest.mark.parametrize(("kwargs", "how"), CASES.values(), ids=CASES.keys())
@pytest.mark.parametrize("softcap", [None, 1.5], ids=["", "softcap"])
def test_the_kernel_runs_a_steps_calls_prepared(kernel_leads, routes, kwargs, how, softcap):
    """With the kernel chosen, a step's calls go to it with their arguments made once per
    route (``registry.prepared``), never through ``registry.run``, with the same result."""
    mask = _decode_mask(**kwargs)
    for seed in range(3):  # the layers of one step: other q, k and v, the same mask
        q, k, v = _qkv(seed=seed)
        got = _bridge(q, k, v, mask, scaling=0.3, softcap=softcap)
        assert kernel_leads == []
        _close(got, _whole(q, k, v, mask, scale=0.3, softcap=softcap))
        kernel_leads.clear()  # the whole path's own run
    ((_, route),) = routes
    assert route.backend == "fused" and route.direct is not None


@pytest.mark.parametrize("where", ["hidden", "seen"])
def test_nan_in_the_cache_takes_the_nan_rules_path(kernel_leads, routes, where):
    """NaN in a key the prepared kernel reads: it returns nothing and the call goes through
    ``registry.run``, whose careful path gives ``multihead.attention``'s result (a NaN under
    padding changes nothing; a NaN in a seen key makes that row NaN)."""
    mask = _decode_mask(attention_mask=_padding(S))
    q, k, v = _qkv()
    _bridge(q, k, v, mask)  # the route, on a clean call
    position = 2 if where == "hidden" else 12  # row 1's first 4 keys are padding
    k[1, 0, position, 0] = float("nan")
    got = _bridge(q, k, v, mask)
    if where == "seen":  # the careful path ran (a hidden key's block may not be read at all)
        assert len(kernel_leads) == 1
    want = _whole(q, k, v, mask)
    torch.testing.assert_close(got, want, rtol=0, atol=RTOL * 10, equal_nan=True)
    assert got[1].isnan().any() == (where == "seen")
    assert not got[0].isnan().any() and not got[2].isnan().any()


def test_a_fully_hidden_row_gives_zeros():
    q, k, v = _qkv()
    out = _bridge(q, k, v, _decode_mask(attention_mask=_padding(S, (0, S, 2))))
    assert torch.equal(out[1], torch.zeros_like(out[1]))


@pytest.mark.parametrize(
    ("heads", "kv_heads", "mask", "folds"),
    [
        (4, 4, "padding", False),  # no groups to fold
        (H, H_KV, "none", True),  # cross attention: no mask
        (H, H_KV, "per head", False),  # a mask that differs by head cannot fold
    ],
    ids=["mha", "no mask", "per-head mask"],
)
def test_calls_that_fold_or_not_equal_the_whole_path(routes, heads, kv_heads, mask, folds):
    q, k, v = _qkv(heads, kv_heads)
    if mask == "padding":
        chosen = _decode_mask(attention_mask=_padding(S))
    elif mask == "per head":
        keep = torch.rand(1, heads, 1, S, generator=torch.Generator().manual_seed(5)) > 0.3
        chosen = masks.dense(keep)
    else:
        chosen = None
    _close(_bridge(q, k, v, chosen), _whole(q, k, v, chosen))
    ((_, route),) = routes
    assert (route.folded is not None) is folds


def test_a_route_is_kept_per_mask_object_and_signature(routes):
    q, k, v = _qkv()
    mask = _decode_mask(attention_mask=_padding(S))
    for _ in range(3):  # the layers of one step
        _bridge(q, k, v, mask, scaling=0.25)
    assert len(routes) == 1
    _bridge(q, k, v, mask, scaling=0.5)  # another signature: a route of its own
    assert len(routes) == 2
    kept = decode_route._routes(mask)
    assert len(kept) == 2
    alive = weakref.ref(kept)
    del mask, kept, routes[:]
    gc.collect()
    assert alive() is None  # the routes die with the step's mask


def test_new_padding_is_never_served_a_kept_route(routes):
    """Each step's mask is a new object; a route kept for one padding never runs another."""
    q, k, v = _qkv()
    first = _decode_mask(attention_mask=_padding(S, (0, 4, 9)))
    second = _decode_mask(attention_mask=_padding(S, (6, 0, 2)))
    a, b = _bridge(q, k, v, first), _bridge(q, k, v, second)
    _close(a, _whole(q, k, v, first))
    _close(b, _whole(q, k, v, second))
    assert not torch.allclose(a, b)
    assert [m for m, _ in routes] == [first, second]
    # a longer cache under the same mask object is another signature, worked out anew
    q, k, v = _qkv(length_k=S + 1)
    longer = _decode_mask(S + 1, attention_mask=_padding(S + 1))
    _close(_bridge(q, k, v, longer), _whole(q, k, v, longer))


def test_a_growing_unmasked_cache_takes_one_route_per_length_class(kernel_leads, routes):
    """Unmasked steps over a growing cache (B = 1 without padding) share one route while the
    cache length stays in its class (``_measure.length_class``: powers of two): the kernel
    prepared once takes keys of every length, each step's result is the whole path's, and
    nothing goes through ``registry.run``."""
    q, k, v = _qkv(length_k=40)
    for length in range(17, 41):  # classes [16, 32) and [32, 64)
        keys, values = k[:, :, :length], v[:, :, :length]
        got = _bridge(q, keys, values, None, scaling=0.3)
        assert kernel_leads == []
        _close(got, _whole(q, keys, values, None, scale=0.3))
        kernel_leads.clear()
    assert len(routes) == 2
    assert all(route.backend == "fused" and route.direct is not None for _, route in routes)


def test_a_shared_unmasked_route_still_meets_nan_and_bad_lengths(kernel_leads, routes):
    """A route shared across lengths keeps the NaN rule (a NaN key in a later, longer step
    makes its rows NaN through the careful path) and the length check (keys and values of
    different lengths raise as ``multihead.attention`` does)."""
    q, k, v = _qkv(length_k=30)
    _bridge(q, k[:, :, :20], v[:, :, :20], None)
    k[1, 0, 25, 0] = float("nan")
    got = _bridge(q, k[:, :, :28], v[:, :, :28], None)
    assert len(routes) == 1 and len(kernel_leads) == 1  # the careful path ran
    want = _whole(q, k[:, :, :28], v[:, :, :28], None)
    torch.testing.assert_close(got, want, rtol=0, atol=RTOL * 10, equal_nan=True)
    assert got[1].isnan().any() and not got[0].isnan().any()
    with pytest.raises(ValueError, match="the same length S"):
        _bridge(q, k[:, :, :22], v[:, :, :21], None)


def test_a_kept_backend_that_refuses_is_chosen_again(routes):
    """A backend that refuses a call it ran before (a kernel turned off) costs a new choice,
    not an error."""
    q, k, v = _qkv()
    mask = _decode_mask(attention_mask=_padding(S))
    want = _bridge(q, k, v, mask)
    ((_, route),) = routes
    (signature,) = decode_route._routes(mask)
    # "half" takes only bf16/fp16 inputs: an explicit call with fp32 is refused
    decode_route._routes(mask)[signature] = decode_route._Route(
        **{**route.__dict__, "backend": "half"}
    )
    _close(_bridge(q, k, v, mask), want)
    assert decode_route._routes(mask)[signature].backend == route.backend


def test_a_bad_call_raises_as_multihead_attention_does():
    q, k, v = _qkv(heads=5)
    with pytest.raises(ValueError, match="multiple of the key/value head count"):
        _bridge(q, k, v, _decode_mask())


def test_calls_that_are_not_decoding_steps_take_the_whole_path(monkeypatch):
    taken = []
    monkeypatch.setattr(decode_route, "attend", lambda *a: taken.append(a))
    q, k, v = _qkv()
    mask = _decode_mask()
    module = _Layer()
    with torch.inference_mode():
        two_rows = torch.cat([q, q], dim=2)
        hf_attention.attention_forward(module, two_rows, k, v, _decode_mask(), dropout=0.0)
        hf_attention.attention_forward(module, q, k, v, mask, output_attentions=True)
        hf_attention.attention_forward(module, q, k, v, torch.ones(B, 1, 1, S, dtype=torch.bool))
        hf_attention.attention_forward(module, q, k, v, mask, s_aux=torch.zeros(H))
    with torch.no_grad():
        hf_attention.attention_forward(module, q, k, v, mask, dropout=0.1)
    hf_attention.attention_forward(module, q.requires_grad_(), k, v, mask)
    assert taken == []


def _qwen2(impl: str) -> tf.PreTrainedModel:
    """A Qwen2-like model: 6 query heads over 2 KV heads (groups of 3 to fold)."""
    torch.manual_seed(0)
    config = tf.Qwen2Config(
        vocab_size=97, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64,
        initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return tf.AutoModelForCausalLM.from_config(config, attn_implementation=impl).eval()


def test_generate_on_a_padded_batch_gives_sdpa_tokens(monkeypatch):
    """Greedy tokens of a left-padded batch of three through the KV cache: the same as sdpa's,
    every decoding step of every layer through the short path."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 97, (3, 10), generator=g)
    keep = torch.ones(3, 10, dtype=torch.long)
    keep[1, :3], keep[2, :6] = 0, 0
    ids[keep == 0] = 0
    calls = []
    original = decode_route.attend
    monkeypatch.setattr(decode_route, "attend", lambda *a: calls.append(1) or original(*a))
    model = _qwen2("sdpa")
    tokens = {}
    for impl in ("sdpa", "multihead"):
        model.set_attn_implementation(impl)
        with torch.inference_mode():
            tokens[impl] = model.generate(
                input_ids=ids, attention_mask=keep, max_new_tokens=12, min_new_tokens=12,
                do_sample=False,
            )  # fmt: skip
    assert tokens["multihead"].shape == (3, 22)
    assert torch.equal(tokens["sdpa"], tokens["multihead"])
    assert len(calls) == 2 * 11  # both layers of every step after the prompt's


def test_capture_inside_generate_still_records_every_step():
    """An active block takes the whole path: a capture sees the decoding steps' weights."""
    model = _qwen2("multihead")
    ids = torch.randint(3, 97, (1, 6), generator=torch.Generator().manual_seed(2))
    with capture(model, layers=[1]) as cap, torch.inference_mode():
        model.generate(input_ids=ids, max_new_tokens=3, min_new_tokens=3, do_sample=False)
    assert cap.weights[1].shape[-2:] == (1, 8)  # the last step: one row over 8 keys
