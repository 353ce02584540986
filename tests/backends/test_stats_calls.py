"""Statistics are a request of the attention call (``Call.stats``) and run through
``registry.run``: a backend declares the ``stats`` capability as it declares weights, the NaN
rule and the fallback cover the request, ``explain_backend(..., stats=)`` says who computes
them, and a decoding step's route is the registry's (``registry.route``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from helpers import naive_attention, qkv

import multihead as mh
from multihead import backends, masks
from multihead import decoding_routes as routes
from multihead.backends import fused, reduce, registry
from multihead.backends._nonfinite import NonFiniteInput
from multihead.backends.call import prepare


def _formulas(w: torch.Tensor, window: int | None) -> dict[str, torch.Tensor]:
    """The statistics from the weights (B, h, L, S), in float64."""
    found = {
        "key_mass": w.sum(2),
        "entropy": -torch.special.xlogy(w, w).sum(-1),
        "head_mean": w.mean(1),
    }
    if window is not None:
        found["window_mass"] = w[:, :, -window:].sum(2)
    return found


@pytest.fixture
def counter():
    """Registers "counter": float64 on CPU, folds statistics into its pass (from the float64
    formulas over its own weights) and records every call it receives. Ranked ahead of every
    built-in backend. Removed afterwards."""
    seen: list = []
    behaviour = {"checks_inputs": False, "fail": False}

    def run(call):
        seen.append(call)
        if behaviour["fail"]:
            raise backends.BackendUnavailable("the counter lost its device")
        keep = None if call.mask is None else call.mask.to_dense(*call.shape[3:5])
        out, w = naive_attention(call.query, call.key, call.value, keep, scale=call.scale)
        if call.stats is None:
            return out, (w if call.return_weights else None)
        heads = list(call.heads) if call.heads is not None else list(range(w.shape[1]))
        found = _formulas(w[:, heads], call.window)
        return out, {name: found[name] for name in call.stats}

    def register():
        backends.register(
            "counter",
            backends.Backend(
                run=run,
                rank=lambda call: backends.Rank(-1, "it counts"),
                capabilities=backends.Capabilities(
                    label="the counter",
                    dtypes=(torch.float64,),
                    devices=("cpu",),
                    weights=True,
                    stats=True,
                ),
                checks_inputs=behaviour["checks_inputs"],
            ),
            replace=True,
        )

    register()
    yield seen, behaviour, register
    backends.unregister("counter")


def test_a_backend_that_declares_stats_receives_the_request(counter):
    seen, _, _ = counter
    q, k, v = qkv(2, 4, 2, 6, 9, 5)
    mask = masks.sliding_window(3)
    out, found = mh.attention_stats(
        q, k, v, mask, stats=["window_mass", "entropy"], window=2, heads=[2, 0]
    )
    assert len(seen) == 1
    call = seen[0]
    assert call.stats == ("window_mass", "entropy") and call.window == 2
    assert call.heads == (2, 0) and not call.return_weights
    want_out, w = naive_attention(q, k, v, mask.to_dense(6, 9))
    want = _formulas(w[:, [2, 0]], 2)
    torch.testing.assert_close(out, want_out, rtol=0, atol=0)
    assert list(found) == ["window_mass", "entropy"]
    for name in found:
        torch.testing.assert_close(found[name], want[name], rtol=0, atol=0)
    choice = mh.explain_backend(q, k, v, mask, stats=["window_mass"], window=2)
    assert choice.backend == "counter"
    # the built-in backends that fold no statistics say so
    assert "folds no statistics into its pass" in choice.reasons["tiled"]


@pytest.mark.parametrize("checks_inputs", [False, True])
def test_the_nan_rule_covers_a_statistics_call(counter, checks_inputs):
    """NaN in a key: the counter (which would compute NaN into every row it folds, or reports
    that it met one) is left for the slice sweep, whose slices take the careful path: the
    rows that see the bad key are NaN, the others are exact, as attention_with_weights'."""
    seen, behaviour, register = counter
    behaviour["checks_inputs"] = checks_inputs
    register()
    q, k, v = qkv(1, 2, 2, 6, 6, 4)
    k[0, 1, 3, 0] = float("nan")
    mask = masks.causal()
    if checks_inputs:  # the counter says it met NaN, as the fused kernel does
        original = registry.BACKENDS["counter"].run

        def checking(call):
            if not all(bool(torch.isfinite(t).all()) for t in (call.query, call.key, call.value)):
                raise NonFiniteInput
            return original(call)

        backends.register(
            "counter",
            backends.Backend(
                run=checking,
                rank=registry.BACKENDS["counter"].rank,
                capabilities=registry.BACKENDS["counter"].capabilities,
                checks_inputs=True,
            ),
            replace=True,
        )
    out, found = mh.attention_stats(q, k, v, mask, stats=["key_mass", "entropy"])
    want_out, w = mh.attention_with_weights(q, k, v, mask)
    torch.testing.assert_close(out, want_out, rtol=0, atol=0, equal_nan=True)
    want = _formulas(w, None)
    assert bool(out[0, 1, 3:].isnan().all()) and bool(out[0, 1, :3].isfinite().all())
    for name in found:
        torch.testing.assert_close(found[name], want[name], rtol=0, atol=0, equal_nan=True)
    assert all(c.stats is None for c in seen[1 if checks_inputs else 0 :])


def test_a_folding_backend_that_turns_out_unable_hands_over_to_the_sweep(counter):
    _, behaviour, _ = counter
    behaviour["fail"] = True
    q, k, v = qkv(1, 2, 1, 5, 5, 4)
    out, found = mh.attention_stats(q, k, v, masks.causal(), stats=["head_mean"])
    behaviour["fail"] = False
    want_out, w = naive_attention(q, k, v, masks.causal().to_dense(5, 5))
    torch.testing.assert_close(out, want_out, rtol=0, atol=1e-12)
    torch.testing.assert_close(found["head_mean"], w.mean(1), rtol=0, atol=1e-12)


@pytest.mark.skipif(fused.build_error() is not None, reason="the fused kernel is not built")
def test_explain_backend_names_who_computes_the_statistics(monkeypatch):
    q, k, v = qkv(1, 4, 2, 12, 12, 8, dtype=torch.float32)
    choice = mh.explain_backend(q, k, v, masks.causal(), stats=["key_mass"])
    assert choice.backend == "fused"
    assert "folds no statistics into its pass" in choice.reasons["sdpa"]
    # no backend folds them: the one whose weights the registry reduces, and why not fused
    monkeypatch.setattr(fused, "built", lambda: False)
    registry._changed()
    choice = mh.explain_backend(q, k, v, masks.causal(), stats=["key_mass"])
    assert choice.backend == mh.explain_backend(q, k, v, masks.causal(), weights=True).backend
    assert "not built" in choice.reasons["fused"]
    with pytest.raises(ValueError, match=r"weights=True or stats=.*Received: weights=True"):
        mh.explain_backend(q, k, v, weights=True, stats=["key_mass"])
    with pytest.raises(ValueError, match=r"unknown statistic 'mass'"):
        mh.explain_backend(q, k, v, stats=["mass"])
    registry._changed()


def test_the_sweep_is_the_only_fallback_and_stats_names_no_backend():
    """stats.py builds a call and hands it to the registry: it imports no backend."""
    source = Path(mh.stats.__file__).read_text()
    imported = {
        alias.name
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert not imported & {"fused", "tiled", "reference", "sdpa", "flex", "half"}
    assert "registry" in imported and reduce.sweep is not None


def test_a_decoding_steps_route_is_the_registrys(monkeypatch):
    """Every layer of a step shares one route, worked out by ``registry.route`` once."""
    asked = []
    original = registry.route

    def spy(call):
        asked.append(call.shape)
        return original(call)

    monkeypatch.setattr(registry, "route", spy)
    q, k, v = qkv(1, 4, 2, 1, 7, 8, dtype=torch.float32)
    step = masks.key_padding(torch.ones(1, 7, dtype=torch.bool))
    for _ in range(3):  # three layers of one step: one mask object
        out = routes.attend(q, k, v, step, None, None)
    assert len(asked) == 1
    want = mh.attention(q, k, v, step)
    torch.testing.assert_close(out, want.transpose(1, 2), rtol=0, atol=1e-6)
    name, _ = original(prepare(q, k, v, step, None, None, 0.0, False))
    assert name == registry.select(prepare(q, k, v, step, None, None, 0.0, False), "auto")
