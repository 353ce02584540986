"""``ablate``, ``knockout``, ``patch`` and ``capture(stats=...)`` against an eager reference
that applies the same edit by hand.

The reference is a plain attention function registered with transformers under the name
"eager_edit" (with transformers' own eager mask): scores, soft cap, the model's float mask,
then by hand the blocked entries hidden, the stored weights put in place and the chosen heads'
outputs scaled. Tolerances are the bridge's (test_hf_attention.py): outputs within 2e-4 of the
reference relative to their largest entry, statistics within 1e-5 of the values computed from
the reference's weights; each edit also moves the output by far more than the tolerance (the
control), so a block that did nothing would fail.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import transformers as tf
from hf_archs import BY_NAME
from test_hf_attention import build, inputs

import multihead as mh
import multihead.hf as mhf
from multihead import masks

OUT_RTOL, STATS_ATOL = 2e-4, 1e-5
ARCH_NAMES = ["llama", "qwen2", "gemma2", "mistral", "bert", "modernbert"]

# what the reference applies by hand: {"scales": {layer: {head: s}}, "block": (q, k, layers,
# heads), "weights": {layer: (heads, W)}}; "seen" collects its weights per layer
EDIT: dict = {}
LAYER_OF: dict = {}


def eager_edit(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
               softcap=None, **kwargs):  # fmt: skip
    layer = LAYER_OF[module]
    h, group = query.shape[1], query.shape[1] // key.shape[1]
    k = key.repeat_interleave(group, dim=1).double()
    v = value.repeat_interleave(group, dim=1).double()
    q = query.double()
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    scores = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, float("-inf"))
        else:
            hidden = attention_mask <= torch.finfo(attention_mask.dtype).min / 2
            scores = scores.masked_fill(hidden, float("-inf"))
    block = EDIT.get("block")
    if block is not None and (block[2] is None or layer in block[2]):
        qs, ks, _, heads = block
        length_q, length_k = scores.shape[-2:]
        rows = [p - (length_k - length_q) for p in qs if 0 <= p - (length_k - length_q) < length_q]
        for hd in range(h) if heads is None else heads:
            for r in rows:
                scores[:, hd, r, ks] = float("-inf")
    seen = torch.isfinite(scores).any(-1, keepdim=True)
    weights = torch.softmax(scores.masked_fill(~seen, 0.0), -1).masked_fill(~seen, 0.0)
    if layer in EDIT.get("weights", {}):
        heads, stored = EDIT["weights"][layer]
        weights = weights.clone()
        weights[:, heads] = stored.double()
    EDIT.setdefault("seen", {})[layer] = weights
    out = weights @ v
    for hd, s in EDIT.get("scales", {}).get(layer, {}).items():
        out[:, hd] = out[:, hd] * s
    return out.to(query.dtype).transpose(1, 2).contiguous(), weights.to(query.dtype)


def _register() -> None:
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    tf.AttentionInterface.register("eager_edit", eager_edit)
    AttentionMaskInterface.register("eager_edit", eager_mask)


_register()


def _main(out) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _batch(arch, device: str = "cpu") -> dict:
    return {name: t.to(device) for name, t in inputs(arch)[0].items()}


def _reference(model, arch, edit: dict, device: str = "cpu") -> tuple[torch.Tensor, dict]:
    EDIT.clear()
    EDIT.update(edit)
    LAYER_OF.clear()
    for i, layer in enumerate(mhf.attention_layers(model)):
        for part in layer.modules():
            LAYER_OF.setdefault(part, i)
    model.set_attn_implementation("eager_edit")
    with torch.no_grad():
        out = _main(model(**_batch(arch, device)))
    model.set_attn_implementation("eager")
    return out, dict(EDIT["seen"])


def _multihead(model, arch, device: str = "cpu") -> torch.Tensor:
    with torch.no_grad():
        return _main(model(**_batch(arch, device)))


def _close(got: torch.Tensor, want: torch.Tensor, valid: torch.Tensor) -> float:
    """The largest difference over the valid positions, relative to the largest entry."""
    diff = (got - want).abs()[valid]
    return float(diff.max() / want[valid].abs().max())


def _assert_edit_matches(model, arch, edit: dict, block, device: str = "cpu") -> None:
    """``model`` inside ``block`` equals the reference applying ``edit`` by hand, and the
    edit moves the output far beyond the tolerance (the control)."""
    valid = inputs(arch)[1].to(device)
    plain = _reference(model, arch, {}, device)[0]
    want = _reference(model, arch, edit, device)[0]
    with block:
        got = _multihead(model, arch, device)
    assert _close(got, want, valid) <= OUT_RTOL
    assert _close(plain, want, valid) > 50 * OUT_RTOL  # the edit matters


@pytest.mark.parametrize("name", ARCH_NAMES)
def test_ablate_equals_scaling_the_heads_by_hand(name):
    arch = BY_NAME[name]
    model = build(arch)

    @contextlib.contextmanager
    def block():
        with mhf.ablate(model, {0: [1, 3]}), mhf.ablate(model, {1: [2]}, scale=2.5):
            yield

    _assert_edit_matches(model, arch, {"scales": {0: {1: 0.0, 3: 0.0}, 1: {2: 2.5}}}, block())
    assert model.config._attn_implementation == "eager"


@pytest.mark.parametrize("name", ARCH_NAMES)
def test_knockout_equals_hiding_the_entries_by_hand(name):
    arch = BY_NAME[name]
    model = build(arch)
    queries, keys = [6, 7, 8], [3, 4, 5]  # visible to every query of them in every mask here
    block = mhf.knockout(model, queries=queries, keys=keys, layers=[1], heads=[0, 2])
    _assert_edit_matches(model, arch, {"block": (queries, keys, [1], [0, 2])}, block)


@pytest.mark.parametrize("name", ARCH_NAMES)
def test_patch_equals_putting_the_stored_weights_in_place(name):
    arch = BY_NAME[name]
    model = build(arch)
    # weights from another input of the same shape: the same tokens reversed
    batch = inputs(arch)[0]
    other = {**batch, "input_ids": batch["input_ids"].flip(1)}
    with mhf.capture(model, layers=[0], heads=[3, 1]) as cap, torch.no_grad():
        model(**other)
    edit = {"weights": {0: ([3, 1], cap.weights[0])}}
    _assert_edit_matches(model, arch, edit, mhf.patch(model, cap))


@pytest.mark.parametrize("name", ARCH_NAMES)
def test_statistics_equal_the_reduced_eager_weights(name):
    arch = BY_NAME[name]
    model = build(arch)
    _, seen = _reference(model, arch, {})
    stats = ["key_mass", "window_mass", "entropy", "head_mean"]
    with mhf.capture(model, heads=[2, 0], stats=stats, window=3) as cap, torch.no_grad():
        model(**inputs(arch)[0])
    assert cap.weights == {}
    for layer, w in seen.items():
        w = w[:, [2, 0]]
        want = {
            "key_mass": w.sum(2),
            "window_mass": w[:, :, -3:].sum(2),
            "entropy": -torch.special.xlogy(w, w).sum(-1),
            "head_mean": w.mean(1),
        }
        for stat in stats:
            got = cap.stats[layer][stat].double()
            assert got.shape == want[stat].shape, stat
            assert (got - want[stat]).abs().max() <= STATS_ATOL * max(1, want[stat].abs().max())


def test_attention_stats_equals_the_weights_reduced_in_float64():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 203, 16, generator=g)
    k, v = torch.randn(2, 2, 211, 16, generator=g), torch.randn(2, 2, 211, 8, generator=g)
    m = masks.sliding_window(64) & masks.lengths(torch.tensor([211, 150]))
    out, got = mh.attention_stats(q, k, v, m, stats=["key_mass", "entropy", "head_mean",
                                  "window_mass"], window=5, heads=[3, 1])  # fmt: skip
    _, w = mh.attention_with_weights(q.double(), k.double(), v.double(), m, heads=[3, 1])
    torch.testing.assert_close(out, mh.attention(q, k, v, m), rtol=1e-5, atol=1e-6)
    want = {
        "key_mass": w.sum(2), "window_mass": w[:, :, -5:].sum(2),
        "entropy": -torch.special.xlogy(w, w).sum(-1), "head_mean": w.mean(1),
    }  # fmt: skip
    for name, value in want.items():
        torch.testing.assert_close(got[name].double(), value, rtol=1e-5, atol=1e-5, msg=name)


def test_statistics_slices_give_what_one_pass_gives(monkeypatch):
    """A long input is swept in slices of rows: force 7-row slices and compare with one."""
    from multihead.backends import reduce

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 40, 8, generator=g) for _ in range(3))
    whole = mh.attention_stats(q, k, v, masks.causal(), stats=["key_mass", "entropy"])
    monkeypatch.setattr(reduce, "SLICE_BYTES", 4 * 2 * 40 * 7)
    sliced = mh.attention_stats(q, k, v, masks.causal(), stats=["key_mass", "entropy"])
    torch.testing.assert_close(sliced[0], whole[0])
    for name in ("key_mass", "entropy"):
        torch.testing.assert_close(sliced[1][name], whole[1][name])


def test_a_row_knocked_out_from_every_key_gives_zero():
    q, k, v = (torch.randn(1, 2, 6, 4) for _ in range(3))
    m = masks.causal() & masks.knockout([3], list(range(6)))
    out = mh.attention(q, k, v, m)
    assert out[:, :, 3].abs().max() == 0
    assert out[:, :, 4].abs().max() > 0


def test_knockout_mask_tiles_are_exact():
    m = masks.knockout(list(range(64, 128)), list(range(0, 64)))
    assert m.rect_kind(256, 256, 64, 128, 0, 64) == masks.TileKind.EMPTY
    assert m.rect_kind(256, 256, 0, 64, 0, 256) == masks.TileKind.FULL
    assert m.rect_kind(256, 256, 64, 128, 0, 128) == masks.TileKind.PARTIAL
    keep = m.to_dense(256, 256)[0, 0]
    assert not keep[64:128, :64].any() and keep[:64].all() and keep[64:128, 64:].all()


GREEDY = ["llama", "gemma2"]


@pytest.mark.parametrize("name", GREEDY)
def test_generate_through_the_cache(name):
    arch = BY_NAME[name]
    model = build(arch)
    batch = inputs(arch)[0]
    model.set_attn_implementation("multihead")
    args = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    plain = model.generate(**batch, **args)
    stats = ["key_mass", "entropy"]
    with mhf.capture(model, layers=[1], stats=stats, accumulate=True) as cap:
        tokens = model.generate(**batch, **args)
    assert torch.equal(tokens, plain)  # nothing edited: the same greedy tokens
    mass = cap.stats[1]["key_mass"]
    # every call's rows each sum to 1 over the keys (padded rows sum to 0): the prompt's valid
    # rows plus one row per decoding step (the last token is sampled, never run)
    valid = batch["attention_mask"].sum(1)
    steps = args["max_new_tokens"] - 1
    torch.testing.assert_close(mass.sum(-1), (valid + steps)[:, None].float().expand(2, 4))
    assert mass.shape[-1] == batch["input_ids"].shape[1] + steps
    with mhf.capture(model, layers=[1], heads=[0]) as cap:
        model.generate(**batch, **args)
    assert cap.weights[1].shape[2] == 1  # the last call: one decoding row
    with mhf.ablate(model, {0: [0, 1, 2, 3], 1: [0, 1, 2, 3]}):
        ablated = model.generate(**batch, **args)
    assert not torch.equal(ablated, plain)
    with mhf.knockout(model, queries=list(range(40)), keys=[0, 1, 2, 3, 4, 5]):
        knocked = model.generate(**batch, **args)
    assert knocked.shape == plain.shape


def test_bad_input_is_named():
    arch = BY_NAME["llama"]
    model = build(arch)
    with pytest.raises(ValueError, match=r"layers must be layer indices in \[0, 2\)"):
        mhf.ablate(model, {5: [0]}).__enter__()
    with pytest.raises(ValueError, match=r"heads must be query-head indices in \[0, 4\)"):
        mhf.ablate(model, {0: [7]}).__enter__()
    with pytest.raises(ValueError, match="must not repeat"):
        mhf.ablate(model, {0: [1, 1]}).__enter__()
    with pytest.raises(ValueError, match="heads must be a non-empty dict"):
        mhf.ablate(model, [0]).__enter__()
    with pytest.raises(ValueError, match="scale must be a finite float"):
        mhf.ablate(model, {0: [1]}, scale=float("nan")).__enter__()
    with pytest.raises(ValueError, match="positions >= 0"):
        mhf.knockout(model, queries=[-1], keys=[0]).__enter__()
    with pytest.raises(ValueError, match="must not repeat a position"):
        mhf.knockout(model, queries=[2, 2], keys=[0]).__enter__()
    # positions past the input are taken (generate's steps reach them): the prompt runs as
    # without the block; but a block that no call reached (query 40 of a shorter input, or
    # query 0 from a key past the input: a prompt's query never sees a later key) hid
    # nothing, and is refused when it closes (it did nothing silently before)
    batch, real = inputs(arch)
    with torch.no_grad():
        plain = model(**batch).logits
        for queries, keys in (([40], [0, 41]), ([0], [50])):
            with (
                pytest.raises(ValueError, match="this knockout reached no call"),
                mhf.knockout(model, queries=queries, keys=keys),
            ):
                # the same sums through a masked tile path: float32 rounding apart (padded
                # positions' outputs mean nothing and are left out)
                torch.testing.assert_close(model(**batch).logits[real], plain[real])
    with pytest.raises(ValueError, match="unknown statistic 'mass'"):
        mhf.capture(model, stats=["mass"]).__enter__()
    with pytest.raises(ValueError, match="give window="):
        mhf.capture(model, stats=["window_mass"]).__enter__()
    with pytest.raises(ValueError, match="window must be an int >= 1"):
        mhf.capture(model, stats=["window_mass"], window=0).__enter__()
    with mhf.capture(model, layers=[0]) as cap, torch.no_grad():
        model(**inputs(arch)[0])
    other = build(arch)
    with pytest.raises(ValueError, match="same model"):
        mhf.patch(other, cap).__enter__()
    short = {k: v[:, :5] for k, v in inputs(arch)[0].items()}
    with mhf.patch(model, cap), pytest.raises(ValueError, match=r"have shape \(2, 4, 12, 12\)"):
        model(**short)
    with mhf.ablate(model, {0: [1]}), pytest.raises(ValueError, match="conflicts"):
        mhf.ablate(model, {0: [1, 2]}, scale=0.5).__enter__()
    with pytest.raises(ValueError, match="statistic"):
        mh.attention_stats(*(torch.randn(1, 2, 4, 4) for _ in range(3)), stats=["nope"])


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def cuda_fp32(full_fp32):
    """The device of the GPU tests, in full fp32 (conftest.py's ``full_fp32``)."""
    return "cuda"


@CUDA
@pytest.mark.parametrize("name", ["llama", "gemma2", "bert"])
def test_acting_on_attention_on_cuda_equals_the_eager_reference(cuda_fp32, name):
    """ablate, knockout, patch and the statistics on a model on the GPU, against the same
    reference as on the CPU, computed on the GPU."""
    arch = BY_NAME[name]
    model = build(arch).to(cuda_fp32)
    scales = {"scales": {0: {1: 0.0, 3: 0.0}, 1: {2: 2.5}}}

    @contextlib.contextmanager
    def ablated():
        with mhf.ablate(model, {0: [1, 3]}), mhf.ablate(model, {1: [2]}, scale=2.5):
            yield

    _assert_edit_matches(model, arch, scales, ablated(), cuda_fp32)
    queries, keys = [6, 7, 8], [3, 4, 5]
    knocked = mhf.knockout(model, queries=queries, keys=keys, layers=[1], heads=[0, 2])
    _assert_edit_matches(model, arch, {"block": (queries, keys, [1], [0, 2])}, knocked, cuda_fp32)
    batch = _batch(arch, cuda_fp32)
    other = {**batch, "input_ids": batch["input_ids"].flip(1)}
    with mhf.capture(model, layers=[0], heads=[3, 1]) as cap, torch.no_grad():
        model(**other)
    assert cap.weights[0].device.type == torch.device(cuda_fp32).type
    edit = {"weights": {0: ([3, 1], cap.weights[0])}}
    _assert_edit_matches(model, arch, edit, mhf.patch(model, cap), cuda_fp32)
    _, seen = _reference(model, arch, {}, cuda_fp32)
    with mhf.capture(model, heads=[2, 0], stats=["key_mass", "entropy"]) as cap, torch.no_grad():
        model(**batch)
    for layer, w in seen.items():
        w = w[:, [2, 0]]
        want = {"key_mass": w.sum(2), "entropy": -torch.special.xlogy(w, w).sum(-1)}
        for stat, value in want.items():
            got = cap.stats[layer][stat].double()
            assert got.device == value.device and got.shape == value.shape, stat
            assert (got - value).abs().max() <= STATS_ATOL * max(1, value.abs().max())


@CUDA
def test_generate_on_cuda_gives_the_tokens_of_sdpa(cuda_fp32):
    """generate() on the GPU through the bridge's decoding calls: sdpa's greedy tokens, on a
    left-padded batch; acting on attention inside it still records every step."""
    arch = BY_NAME["llama"]
    model = build(arch, "sdpa").to(cuda_fp32)
    batch = _batch(arch, cuda_fp32)
    args = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    want = model.generate(**batch, **args)
    model.set_attn_implementation("multihead")
    assert torch.equal(model.generate(**batch, **args), want)
    with mhf.capture(model, layers=[1], stats=["key_mass"], accumulate=True) as cap:
        assert torch.equal(model.generate(**batch, **args), want)
    mass = cap.stats[1]["key_mass"]
    valid = batch["attention_mask"].sum(1) + args["max_new_tokens"] - 1
    torch.testing.assert_close(mass.sum(-1), valid[:, None].float().expand_as(mass[..., 0]))
    with mhf.ablate(model, {0: [0, 1, 2, 3], 1: [0, 1, 2, 3]}):
        assert not torch.equal(model.generate(**batch, **args), want)
