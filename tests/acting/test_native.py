"""``multihead.acting`` on the library's own models against the transformers path on the
same weights.

transformers writes each tiny random GPT-2 and Llama checkpoint (``models/decoders.py``; the
Llama with grouped-query attention and RoPE); ``multihead.models.gpt2/llama.load`` reads it
natively, and ``multihead.save`` then ``multihead.load`` gives the same model again. The same
functions act on both: the transformers model runs on the multihead implementation inside
each block (the bridge's reading of the plan), ours in its ``MultiHeadAttention`` modules.
Every captured weight, statistic, loss and logit agrees within 1e-5, and each edit moves the
result by far more than that (so a block that did nothing would fail).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from models.decoders import EOS, build, transformers_model

import multihead as mh
import multihead.hf as mhf  # the reader of transformers models
from multihead import acting
from multihead.models import gpt2, llama
from multihead.modules import decoding_native as native_step
from multihead.modules import decoding_python as python_step

LOADERS = {"gpt2": gpt2, "llama": llama}
ATOL = 1e-5
CLEAN = torch.tensor([[5, 17, 230, 9, 2, 44, 61, 120, 33, 250, 8, 19]])
CORRUPT = torch.tensor([[5, 17, 230, 9, 2, 71, 4, 3, 33, 250, 8, 19]])


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def models(request, tmp_path_factory):
    """{"transformers": theirs, "loaded": ours from the folder, "saved": ours through
    multihead.save and multihead.load}, all from one checkpoint."""
    root = tmp_path_factory.mktemp(request.param)
    folder = build(request.param, root / "hf")
    ours = LOADERS[request.param].load(folder).eval()
    mh.save(ours, root / "saved")
    return {
        "transformers": transformers_model(folder),
        "loaded": ours,
        "saved": mh.load(root / "saved").eval(),
    }


OURS = ["loaded", "saved"]


def _logits(model, ids):
    if isinstance(model, torch.nn.Module) and type(model).__module__.startswith("multihead."):
        return model(ids)
    return model(input_ids=ids).logits


def _loss(model, ids):
    """The mean next-token cross-entropy (transformers' ``labels=`` loss)."""
    return F.cross_entropy(_logits(model, ids)[0, :-1].float(), ids[0, 1:])


def _close(got, want):
    assert got.shape == want.shape
    assert (got - want).abs().max() <= ATOL


@pytest.mark.parametrize("ours", OURS)
def test_captured_heads_equal_the_transformers_path(models, ours):
    found = {}
    for name in ("transformers", ours):
        with acting.capture(models[name], layers=[1], heads=[3, 0]) as cap, torch.no_grad():
            _logits(models[name], CLEAN)
        assert list(cap.weights) == [1] and cap.num_layers == 2
        found[name] = cap.weights[1]
    _close(found[ours], found["transformers"])
    assert found[ours].shape == (1, 2, 12, 12)


@pytest.mark.parametrize("ours", OURS)
def test_captured_statistics_equal_the_transformers_path(models, ours):
    stats = ["key_mass", "window_mass", "entropy", "head_mean"]
    found = {}
    for name in ("transformers", ours):
        with (
            acting.capture(models[name], heads=[2, 0], stats=stats, window=3) as cap,
            torch.no_grad(),
        ):
            _logits(models[name], CLEAN)
        assert cap.weights == {} and sorted(cap.stats) == [0, 1]
        found[name] = cap.stats
    for layer in (0, 1):
        for stat in stats:
            _close(found[ours][layer][stat], found["transformers"][layer][stat])


@pytest.mark.parametrize("ours", OURS)
def test_ablated_losses_equal_the_transformers_path(models, ours):
    heads = {0: [1], 1: [0, 3]}
    with torch.no_grad():
        plain = float(_loss(models[ours], CLEAN))
    for scale in (0.0, 0.5):
        got = {}
        for name in ("transformers", ours):
            with acting.ablate(models[name], heads, scale=scale), torch.no_grad():
                got[name] = float(_loss(models[name], CLEAN))
        assert abs(got[ours] - got["transformers"]) <= ATOL
        assert abs(got[ours] - plain) > 1e-3  # the control


@pytest.mark.parametrize("ours", OURS)
def test_knocked_out_logits_equal_the_transformers_path(models, ours):
    cut = {"queries": [6, 7, 8, 11], "keys": [0, 2, 3], "layers": [1], "heads": [0, 2]}
    got = {}
    for name in ("transformers", ours):
        with acting.knockout(models[name], **cut), torch.no_grad():
            got[name] = _logits(models[name], CLEAN)
    _close(got[ours], got["transformers"])
    with torch.no_grad():
        assert (got[ours] - _logits(models[ours], CLEAN)).abs().max() > 1e-3


@pytest.mark.parametrize("ours", OURS)
def test_patched_logits_equal_the_transformers_path(models, ours):
    got = {}
    for name in ("transformers", ours):
        model = models[name]
        with acting.capture(model, layers=[0, 1], heads=[1, 2]) as cap, torch.no_grad():
            _logits(model, CLEAN)
        with acting.patch(model, cap), torch.no_grad():
            got[name] = _logits(model, CORRUPT)
    _close(got[ours], got["transformers"])
    with torch.no_grad():
        assert (got[ours] - _logits(models[ours], CORRUPT)).abs().max() > 1e-3


def _generate(model, ids, steps):
    if type(model).__module__.startswith("multihead."):
        return model.generate(ids, steps)
    return model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=steps,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=EOS,
    )


@pytest.mark.parametrize("ours", OURS)
def test_blocks_act_inside_generate_as_on_the_transformers_path(models, ours):
    """Through ``KVCache``: the last step's captured row, key statistics summed over every
    call, and a knockout reaching generated positions, as transformers' generate gives."""
    tokens, weights, mass, cut = {}, {}, {}, {}
    for name in ("transformers", ours):
        model = models[name]
        with (
            acting.capture(model, layers=[1], heads=[2, 1]) as cap,
            acting.capture(model, layers=[0], stats=["key_mass"], accumulate=True) as summed,
            torch.no_grad(),
        ):
            tokens[name] = _generate(model, CLEAN, 6)
        weights[name], mass[name] = cap.weights[1], summed.stats[0]["key_mass"]
        with acting.knockout(model, queries=range(12, 18), keys=[0, 1, 12]), torch.no_grad():
            cut[name] = _generate(model, CLEAN, 6)
    assert torch.equal(tokens[ours], tokens["transformers"])
    assert weights[ours].shape == (1, 2, 1, 17)  # the last step: one row over 17 keys
    _close(weights[ours], weights["transformers"])
    assert mass[ours].shape == (1, 4, 17)
    _close(mass[ours], mass["transformers"])
    assert torch.equal(cut[ours], cut["transformers"])


def test_the_decoding_short_path_waits_while_a_block_is_open(models, monkeypatch):
    ours = models["loaded"]
    taken = []
    original, native = python_step.step, native_step.step
    monkeypatch.setattr(python_step, "step", lambda *a: taken.append(1) or original(*a))
    monkeypatch.setattr(native_step, "step", lambda *a: taken.append(1) or native(*a))
    with torch.no_grad():
        plain = ours.generate(CLEAN, 4)
    assert len(taken) == 3  # every step after the prompt's
    taken.clear()
    with acting.ablate(ours, {0: [0]}, scale=1.0), torch.no_grad():
        same = ours.generate(CLEAN, 4)  # the modules' path, the same tokens
    assert taken == [] and torch.equal(same, plain)


def test_the_same_errors_for_both_kinds(models):
    messages = {}
    for name in ("transformers", "loaded"):
        model, found = models[name], []
        for block in (
            lambda m: acting.capture(m, layers=[2]),
            lambda m: acting.capture(m, heads=[4]),
            lambda m: acting.ablate(m, {0: [0]}, scale=float("nan")),
            lambda m: acting.knockout(m, queries=[1], keys=[0], layers=[0, 0]),
        ):
            with pytest.raises(ValueError) as info, block(model):
                pass
            found.append(str(info.value))
        with acting.ablate(model, {1: [2]}), pytest.raises(ValueError) as info:
            acting.ablate(model, {1: [2, 3]}).__enter__()
        found.append(str(info.value))
        messages[name] = found
    assert messages["loaded"] == messages["transformers"]
    assert "layers must be layer indices in [0, 2)" in messages["loaded"][0]


def test_a_capture_of_another_model_is_refused(models):
    with acting.capture(models["transformers"], layers=[0]) as cap, torch.no_grad():
        _logits(models["transformers"], CLEAN)
    with (
        pytest.raises(ValueError, match=r"patch needs a capture of the same model"),
        acting.patch(models["loaded"], cap),
    ):
        pass


def test_a_model_of_neither_kind_is_named():
    with (
        pytest.raises(TypeError, match=r"capture takes a transformers model .* or one of the "),
        acting.capture(torch.nn.Linear(2, 2)),
    ):
        pass


def test_a_block_with_a_compressing_cache_is_refused(models):
    ours = models["loaded"]
    with (
        torch.no_grad(),
        acting.capture(ours, layers=[0]),
        pytest.raises(ValueError, match=r"a KVCache with a policy does not combine with capture"),
    ):
        ours.generate(CLEAN, 2, compress=mh.kv.SnapKV(0.5))


def test_compress_takes_transformers_models_only(models):
    with (
        torch.inference_mode(),
        pytest.raises(TypeError, match=r"compress takes a transformers model.*KVCache"),
        mhf.compress(models["loaded"], mh.kv.SnapKV(0.5)),
    ):
        pass
