"""Backend choice: auto never picks a backend that cannot honour the call, and says why."""

from __future__ import annotations

import re
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import MASK_KINDS, make_case, naive_attention, qkv

import multihead as mh
from multihead import backends, masks
from multihead import bias as mb
from multihead.backends import _nonfinite, half, registry
from multihead.backends._nonfinite import NonFiniteInput
from multihead.backends.call import prepare


@pytest.mark.parametrize(
    "mask,expected",
    [
        (None, "sdpa"),
        (masks.causal(), "sdpa"),  # L == S: torch's is_causal is exact
        (masks.sliding_window(2), "tiled"),
        (masks.lengths(torch.tensor([3, 1])), "tiled"),
        (masks.dense(torch.ones(4, 4, dtype=torch.bool)), "sdpa"),
    ],
    ids=["none", "causal", "window", "lengths", "dense"],
)
def test_auto_choice_and_reasons(mask, expected):
    q, k, v = qkv(2, 2, 2, 4, 4, 5)
    choice = mh.explain_backend(q, k, v, mask)
    assert choice.backend == expected
    everything = {"tiled", "half", "sdpa", "reference", "flex", "fused"}
    assert set(choice.reasons) == everything - {expected}
    assert all(
        r.startswith(f"supported, but {expected} is expected to be faster: ")
        for name, r in choice.reasons.items()
        # float64 inputs: flex and the half kernel say why they cannot run them; the fused
        # kernel leads only by measurement, which explain_backend reports and never runs
        if name not in ("flex", "half", "fused")
    )
    assert re.match(
        r"the C\+\+ kernel leads only where it measured faster; (calls of this shape class "
        rf"have not been timed yet \(the first one times it against {expected}\)|it did not "
        rf"measure faster than {expected} for calls of this shape class)|not built",
        choice.reasons["fused"],
    ), choice.reasons["fused"]
    assert str(choice).splitlines()[0] == f"chosen: {expected}"


def test_bottom_right_causal_with_fewer_queries_goes_to_tiled():
    q, k, v = qkv(1, 2, 2, 3, 8, 5)
    assert mh.explain_backend(q, k, v, masks.causal()).backend == "tiled"
    assert mh.explain_backend(q, k, v, masks.causal(align="top_left")).backend == "sdpa"


def test_auto_with_weights_uses_tiled_and_says_why_not_sdpa():
    q, k, v = qkv(1, 2, 2, 3, 4, 5)
    choice = mh.explain_backend(q, k, v, weights=True)
    assert choice.backend == "tiled"
    assert "does not return attention weights" in choice.reasons["sdpa"]


@pytest.mark.parametrize("return_weights", [False, True])
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_auto_never_picks_an_unsupported_backend(kind, return_weights):
    q, k, v = qkv(2, 2, 2, 5, 6, 3)
    mask = make_case(kind, 2, 2, 5, 6).mask
    for bias in (None, torch.zeros(5, 6, dtype=torch.float64, requires_grad=True)):
        call = prepare(q, k, v, mask, bias, None, 0.0, return_weights)
        chosen = registry.explain(call).backend
        assert registry.BACKENDS[chosen].why_not(call) is None


def test_sdpa_uses_is_causal_only_when_equivalent(monkeypatch):
    seen = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append((bool(kwargs.get("is_causal")), kwargs.get("attn_mask") is None))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    q, k, v = qkv(1, 2, 2, 4, 4, 5)
    mh.attention(q, k, v, masks.causal(), backend="sdpa")
    mh.attention(q[:, :, :2], k, v, masks.causal(align="top_left"), backend="sdpa")
    mh.attention(q[:, :, :2], k, v, masks.causal(), backend="sdpa")  # bottom-right, L != S
    assert seen == [(True, True), (True, True), (False, False)]


def test_auto_picks_the_branch_free_reference_while_exporting(monkeypatch):
    q, k, v = qkv(1, 2, 2, 4, 4, 5)
    monkeypatch.setattr(torch.compiler, "is_exporting", lambda: True)
    choice = mh.explain_backend(q, k, v, masks.sliding_window(2))
    assert choice.backend == "reference"
    assert "exported graph" in choice.reasons["tiled"]


def test_reference_exports_with_a_dense_mask():
    class Attend(torch.nn.Module):
        def forward(self, q, k, v, keep):
            return mh.attention(q, k, v, masks.dense(keep[:, None, None, :]))

    q, k, v = qkv(2, 2, 2, 5, 5, 4)
    keep = torch.tensor([[True] * 5, [True, True, True, False, False]])
    program = torch.export.export(Attend(), (q, k, v, keep))
    torch.testing.assert_close(program.module()(q, k, v, keep), Attend()(q, k, v, keep))


def test_export_puts_no_bound_on_the_length():
    from torch.utils._sympy.numbers import int_oo

    """While exporting, auto never asks flex's CPU threshold (L >= 4096): on a symbolic L
    that comparison would cap the exported length axis below 4096."""

    class Attend(torch.nn.Module):
        def forward(self, q, k, v, keep):
            return mh.attention(q, k, v, masks.causal() & masks.dense(keep[:, None, None, :]))

    q, k, v = qkv(2, 2, 2, 5, 5, 4, dtype=torch.float32)  # flex's CPU rule is float32 only
    keep = torch.tensor([[True] * 5, [False, False, True, True, True]])
    length = torch.export.Dim("length", min=2)  # no max
    shapes = ({2: length}, {2: length}, {2: length}, {1: length})
    program = torch.export.export(Attend(), (q, k, v, keep), dynamic_shapes=shapes)
    assert [r.upper for r in program.range_constraints.values()] == [int_oo]
    q, k, v = qkv(2, 2, 2, 3, 3, 4, dtype=torch.float32)
    keep = keep[:, 2:]
    torch.testing.assert_close(program.module()(q, k, v, keep), Attend()(q, k, v, keep))


# ---------------------------------------------------------------- backends from outside


def _toy_run(seen):
    """A backend written from outside: the naive formula in float64, logging every call."""

    def run(call):
        seen.append(call)
        keep = None if call.mask is None else call.mask.to_dense(*call.shape[3:5])
        out, weights = naive_attention(call.query, call.key, call.value, keep, scale=call.scale)
        return out, (weights if call.return_weights else None)

    return run


@pytest.fixture
def toy():
    """Registers "toy" (float64 on CPU, weights, no dropout) and removes it afterwards."""
    seen: list = []
    lead = {"cost": 1000.0}
    backend = backends.Backend(
        run=_toy_run(seen),
        rank=lambda call: backends.Rank(lead["cost"], "it is a toy that wins when told to"),
        capabilities=backends.Capabilities(
            label="the toy", dtypes=(torch.float64,), devices=("cpu",), weights=True
        ),
        unsupported=lambda call: "the toy takes L <= 8" if call.shape[3] > 8 else None,
    )
    backends.register("toy", backend)
    yield seen, lead
    backends.unregister("toy")


def test_a_registered_backend_runs_by_name_and_explain_lists_it(toy):
    seen, _ = toy
    q, k, v = qkv(2, 4, 2, 5, 7, 3)
    mask = masks.sliding_window(2)
    out = mh.attention(q, k, v, mask, backend="toy")
    assert len(seen) == 1
    want, _ = naive_attention(q, k, v, mask.to_dense(5, 7))
    torch.testing.assert_close(out, want, rtol=0, atol=0)  # the toy computed exactly this
    choice = mh.explain_backend(q, k, v, mask)
    assert choice.backend == "tiled"  # the toy ranks last
    assert choice.reasons["toy"] == (
        "supported, but tiled is expected to be faster: it skips the tiles the mask hides"
    )
    assert "not toy: supported" in str(choice)


def test_auto_follows_a_registered_backends_rank(toy):
    seen, lead = toy
    q, k, v = qkv(1, 2, 2, 4, 4, 3)
    lead["cost"] = -1.0  # ahead of every built-in tier
    choice = mh.explain_backend(q, k, v)
    assert choice.backend == "toy"
    assert choice.reasons["sdpa"].endswith(
        "expected to be faster: it is a toy that wins when told to"
    )
    mh.attention(q, k, v)
    assert len(seen) == 1
    # calls outside its capabilities or its own rule go to the built-ins
    reasons = mh.explain_backend(q.float(), k.float(), v.float()).reasons
    assert reasons["toy"] == "the toy takes float64; received torch.float32"
    long = qkv(1, 2, 2, 9, 9, 3)
    assert mh.explain_backend(*long).reasons["toy"] == "the toy takes L <= 8"
    assert mh.explain_backend(q, k, v, dropout_p=0.5).reasons["toy"] == "the toy has no dropout"
    with pytest.raises(ValueError, match=r"backend 'toy' cannot run this call: the toy takes L"):
        mh.attention(*long, backend="toy")
    assert len(seen) == 1


def test_register_and_unregister_refuse_what_they_cannot_do(toy):
    backend = registry.BACKENDS["toy"]
    with pytest.raises(ValueError, match=r"'toy' is already registered; pass replace=True.*"
                       r"Received: name='toy'"):  # fmt: skip
        backends.register("toy", backend)
    backends.register("toy", backend, replace=True)
    with pytest.raises(ValueError, match=r"other than 'auto'.*Received: name='auto'"):
        backends.register("auto", backend)
    with pytest.raises(TypeError, match=r"Received: name of type int"):
        backends.register(3, backend)
    with pytest.raises(TypeError, match=r"must be a multihead.backends.Backend.*Received: "
                       r"backend of type function"):  # fmt: skip
        backends.register("other", backend.run)
    with pytest.raises(ValueError, match=r"no backend named 'nope' is registered.*Received"):
        backends.unregister("nope")
    with pytest.raises(ValueError, match=r"one of \[.*'toy'.*\].*Received: backend='nope'"):
        mh.attention(*qkv(1, 1, 1, 2, 2, 2), backend="nope")


def test_a_backend_that_fails_on_trying_hands_the_call_to_the_next_choice(toy):
    seen, lead = toy
    tries = []

    def fails(call):
        tries.append(call)
        raise backends.BackendUnavailable("the flaky backend lost its device")

    flaky = backends.Backend(run=fails, rank=lambda call: backends.Rank(-5.0, "flaky"))
    backends.register("flaky", flaky)
    try:
        q, k, v = qkv(1, 2, 2, 4, 4, 3)
        lead["cost"] = -1.0  # the toy is auto's next choice once flaky failed
        with pytest.warns(RuntimeWarning, match=r"lost its device; this call and later ones "
                          r"like it run on 'toy'") as caught:  # fmt: skip
            out = mh.attention(q, k, v, backend="flaky")
        assert caught[0].filename == __file__  # the warning points at the caller
        assert len(tries) == 1 and len(seen) == 1
        torch.testing.assert_close(out, naive_attention(q, k, v)[0], rtol=0, atol=0)
        with pytest.warns(RuntimeWarning, match="run on 'toy'"):
            mh.attention(q, k, v)  # auto picks flaky first, then moves on
        assert len(tries) == 2 and len(seen) == 2
    finally:
        backends.unregister("flaky")


def test_the_half_kernel_is_named_when_it_runs(monkeypatch):
    """Before, tiled.run switched to the half kernel inside and explain_backend said "tiled"."""
    monkeypatch.setattr(half, "measured_faster", lambda call, rival: True)
    q, k, v = qkv(1, 2, 2, 8, 8, 4, dtype=torch.bfloat16)
    assert mh.explain_backend(q, k, v, masks.sliding_window(2)).backend == "half"
    calls = []
    monkeypatch.setattr(half, "_output", lambda call: calls.append(call) or call.query)
    mh.attention(q, k, v, backend="tiled")  # tiled is tiled: half inputs in float32
    assert calls == []
    mh.attention(q, k, v, backend="half")
    assert len(calls) == 1


def test_the_fastest_measured_backend_leads(monkeypatch):
    """Each backend that times itself runs against the leader so far: in bf16 the half
    kernel beat SDPA and the fused kernel, measured against the half kernel, led only then
    (before, the first backend that beat the rule's choice led, however fast the next)."""
    from multihead.backends import fused

    rivals = []
    monkeypatch.setattr(registry, "_CHOICES", {})
    monkeypatch.setattr(fused, "built", lambda: True)  # only chosen here, never run
    monkeypatch.setattr(half, "measured_faster", lambda call, rival: True)
    monkeypatch.setattr(fused, "measured_faster", lambda call, rival: rivals.append(rival) or True)
    q, k, v = qkv(1, 2, 2, 8, 8, 4, dtype=torch.bfloat16)
    assert _auto(q, k, v) == "fused" and rivals == [half.BACKEND.run]
    # explain_backend runs nothing: it reads what the measurements found, in the same order
    choice = mh.explain_backend(q, k, v)
    assert choice.backend == "fused" and rivals[1:] == [None]
    assert "measured faster than half" in choice.reasons["half"]


def test_no_backend_imports_the_registry():
    """The registry knows the backends; a backend never reaches back (flex once imported it to
    pick its own successor after a failed compile). Context parallelism prepares its call
    through the backends' shared module, not a private of functional."""
    import ast
    from pathlib import Path

    folder = Path(backends.__file__).parent
    for path in folder.glob("*.py"):
        if path.name in ("registry.py", "__init__.py"):
            continue
        tree = ast.parse(path.read_text())
        names = {
            alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom)
            for alias in node.names
        } | {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert not any("registry" in n for n in names), path.name
    context = Path(backends.__file__).parent.parent / "parallel" / "context.py"
    assert "functional" not in context.read_text()


def _auto(q, k, v, mask=None, **kw):
    """``auto``'s choice for a call, as ``attention`` makes it (through the remembered one)."""
    weights = kw.pop("weights", False)
    return registry.select(prepare(q, k, v, mask, kw.pop("bias", None), None, 0.0, weights), "auto")


def test_auto_remembers_its_choice_per_shape_class(monkeypatch):
    """A decoding step pays one lookup: calls of one shape class rank the backends once."""
    monkeypatch.setattr(registry, "_CHOICES", {})
    ranked = []
    real = registry._ranked
    monkeypatch.setattr(registry, "_ranked", lambda call: ranked.append(1) or real(call))
    cache = masks.causal()
    for s in range(100, 128):  # one new key per step: L=1 over a growing cache
        q, k, v = qkv(1, 4, 2, 1, s, 16, dtype=torch.float32)
        _auto(q, k, v, cache)
    assert len(ranked) == 1
    q, k, v = qkv(1, 4, 2, 1, 128, 16, dtype=torch.float32)
    _auto(q, k, v, cache)  # S=128 is the next power of two: a new class, ranked again
    assert len(ranked) == 2


@pytest.mark.parametrize(
    "first,second",
    [
        # causal with L = S is torch's is_causal (sdpa); L = 5, S = 6 is bottom-right (tiled)
        ((6, 6, masks.causal(), {}), (5, 6, masks.causal(), {})),
        ((6, 6, None, {}), (6, 6, None, {"weights": True})),
        (
            (6, 6, masks.sliding_window(2), {}),
            (6, 6, masks.dense(torch.ones(6, 6, dtype=bool)), {}),
        ),
        ((6, 6, None, {}), (6, 6, None, {"bias": mb.alibi(2)})),
        # sdpa has neither: a cap or sinks remembered as sdpa's would be silently dropped
        ((6, 6, None, {}), (6, 6, None, {"bias": mb.softcap(1.0)})),
        ((6, 6, None, {}), (6, 6, None, {"bias": mb.sinks(torch.zeros(2, dtype=torch.float64))})),
    ],
    ids=["plain_causal", "weights", "mask_kind", "computed_bias", "softcap", "sinks"],
)
def test_calls_whose_answer_differs_get_their_own(monkeypatch, first, second):
    """Everything the rules read is in the remembered choice's key: a call of the same sizes
    whose answer differs is answered for itself, in either order."""
    answers = []
    for order in ((first, second), (second, first)):
        monkeypatch.setattr(registry, "_CHOICES", {})
        got = {}
        for length_q, length_k, mask, kw in order:
            q, k, v = qkv(1, 2, 2, length_q, length_k, 4)
            call = prepare(q, k, v, mask, kw.get("bias"), None, 0.0, kw.get("weights", False))
            got[id(kw), length_q] = (registry.select(call, "auto"), registry.explain(call).backend)
        answers.append(got)
    assert answers[0] == answers[1]
    for chosen, explained in answers[0].values():
        assert chosen == explained
    assert len({chosen for chosen, _ in answers[0].values()}) == 2


def test_gradients_and_dropout_are_part_of_the_key(monkeypatch):
    monkeypatch.setattr(registry, "_CHOICES", {})
    q, k, v = qkv(1, 2, 2, 6, 6, 4)
    plain = prepare(q, k, v, masks.sliding_window(2), None, None, 0.0, True)
    assert registry.select(plain, "auto") == "tiled"
    dropped = prepare(q, k, v, masks.sliding_window(2), None, None, 0.2, True)
    assert registry.select(dropped, "auto") == registry.explain(dropped).backend
    with torch.no_grad():
        a = registry._key(prepare(q, k, v, None, None, None, 0.0, False))
    b = registry._key(prepare(q.requires_grad_(), k, v, None, None, None, 0.0, False))
    assert a != b


def test_registering_a_backend_forgets_the_remembered_choices():
    q, k, v = qkv(1, 2, 2, 4, 4, 3)
    before = _auto(q, k, v)
    lead = backends.Backend(
        run=lambda call: (call.query, None), rank=lambda call: backends.Rank(-10, "leads")
    )
    backends.register("leader", lead)
    try:
        assert _auto(q, k, v) == "leader"
    finally:
        backends.unregister("leader")
    assert _auto(q, k, v) == before


# ---------------------------------------------------------------- the call path


def _probe(frames, *, checks_inputs=False, cost=-10.0):
    """A backend that records the two frames above its ``run`` (function name, file) and
    computes the naive formula; with ``checks_inputs`` it raises ``NonFiniteInput`` on NaN or
    ±inf, as a backend that checks its inputs as it reads them does."""

    def run(call):
        caller = sys._getframe(1)
        frames.append([(f.f_code.co_name, Path(f.f_code.co_filename).name)
                       for f in (caller, caller.f_back)])  # fmt: skip
        if checks_inputs and not all(
            torch.isfinite(t).all() for t in (call.query, call.key, call.value)
        ):
            raise NonFiniteInput
        keep = None if call.mask is None else call.mask.to_dense(*call.shape[3:5])
        out, weights = naive_attention(call.query, call.key, call.value, keep, scale=call.scale)
        return out, (weights if call.return_weights else None)

    return backends.Backend(
        run=run,
        rank=lambda call: backends.Rank(cost, "the probe"),
        capabilities=backends.Capabilities(label="the probe", weights=True),
        checks_inputs=checks_inputs,
    )


@pytest.fixture
def probe():
    """``probe(**kw)`` registers "probe" (``_probe``) and returns the frames it records;
    removed afterwards."""
    frames: list = []

    def make(**kw):
        backends.register("probe", _probe(frames, **kw), replace=True)
        return frames

    yield make
    if "probe" in registry.BACKENDS:
        backends.unregister("probe")


@pytest.mark.parametrize("checks_inputs", [False, True], ids=["guard_checks", "backend_checks"])
@pytest.mark.parametrize("backend", ["auto", "probe"])
@pytest.mark.parametrize(
    "function", [mh.attention, mh.attention_with_weights], ids=["attention", "with_weights"]
)
def test_attention_reaches_the_backend_through_one_frame(probe, function, backend, checks_inputs):
    """attention -> registry.run -> the backend's run: the choice, the NaN rule and the
    fallback live in one function (before, a runner object was handed to the NaN guard, which
    called back into the runner: attention -> run_guarded -> Runner.__call__ -> run)."""
    frames = probe(checks_inputs=checks_inputs)
    q, k, v = qkv(1, 2, 2, 3, 4, 5)
    function(q, k, v, masks.causal(), backend=backend)
    assert frames == [[("run", "registry.py"), (function.__name__, "functional.py")]]


@pytest.mark.parametrize("checks_inputs", [False, True], ids=["guard_checks", "backend_checks"])
def test_the_nan_rule_holds_on_every_backend_and_checks_once(probe, monkeypatch, checks_inputs):
    """A backend that checks its inputs is run at once and the guard's pass over q, k and v is
    skipped; any other is run after that pass. Either way NaN in a key makes exactly the rows
    that may see it NaN (the naive formula alone would spread 0 * NaN to every row)."""
    probe(checks_inputs=checks_inputs)
    checked = []
    real = _nonfinite.finite
    monkeypatch.setattr(_nonfinite, "finite", lambda *t: checked.append(1) or real(*t))
    q, k, v = qkv(1, 2, 1, 4, 4, 3)
    clean = mh.attention(q, k, v, masks.causal(), backend="probe")
    assert len(checked) == (0 if checks_inputs else 1)
    v_bad = v.clone()
    v_bad[0, 0, 2] = torch.nan  # causal: rows 2 and 3 see key 2, rows 0 and 1 do not
    out, weights = mh.attention_with_weights(q, k, v_bad, masks.causal(), backend="probe")
    assert torch.isnan(out[:, :, 2:]).all() and torch.isnan(weights[:, :, 2:]).all()
    torch.testing.assert_close(out[:, :, :2], clean[:, :, :2], rtol=0, atol=0)
    assert torch.isfinite(weights[:, :, :2]).all()


def test_the_next_backend_after_a_failure_keeps_the_nan_rule(probe):
    """A backend that checks its inputs fails; the one that runs the call instead does not
    check them, so the guard's pass runs for it (before, the fallback ran inside the first
    backend's guard and skipped the pass: NaN in a key spread to rows that never see it)."""
    probe(cost=-1.0)  # auto's choice once flaky failed

    def fails(call):
        raise backends.BackendUnavailable("the flaky backend lost its device")

    flaky = backends.Backend(
        run=fails, rank=lambda call: backends.Rank(-5.0, "flaky"), checks_inputs=True
    )
    backends.register("flaky", flaky)
    try:
        q, k, v = qkv(1, 2, 2, 4, 4, 3)
        want = mh.attention(q, k, v, masks.causal(), backend="probe")
        v_bad = v.clone()
        v_bad[0, :, 3] = torch.nan  # only the last row sees key 3
        with pytest.warns(RuntimeWarning, match=r"lost its device; this call and later ones"):
            out = mh.attention(q, k, v_bad, masks.causal(), backend="flaky")
        assert torch.isnan(out[:, :, 3]).all()
        torch.testing.assert_close(out[:, :, :3], want[:, :, :3])
    finally:
        backends.unregister("flaky")


def test_torch_is_asked_once_per_call_whether_it_exports(monkeypatch):
    """The Call records whether a graph is traced or exported when it is made; the ranking
    rules read it there (before, every rule asked torch again: a decoding step ranks every
    backend on its first call of a shape class)."""
    monkeypatch.setattr(registry, "_CHOICES", {})  # the rules run: nothing is remembered yet
    asked = []
    real = torch.compiler.is_exporting
    monkeypatch.setattr(torch.compiler, "is_exporting", lambda: asked.append(1) or real())
    q, k, v = qkv(1, 2, 2, 4, 4, 3)
    mh.attention(q, k, v, masks.sliding_window(2))
    assert len(asked) == 1
    call = prepare(q, k, v, masks.sliding_window(2), None, None, 0.0, True)
    assert len(asked) == 2 and not call.exported and not call.traced
    registry.explain(call)  # every rank rule and every backend's why_not
    assert len(asked) == 2
    monkeypatch.setattr(torch.compiler, "is_exporting", lambda: True)
    exported = prepare(q, k, v, None, None, None, 0.0, False)
    assert exported.exported and exported.traced
    assert exported == replace(exported, exported=False, traced=False)  # not compared


def test_a_measured_backend_is_never_timed_against_one_that_compiles(monkeypatch):
    """flex leads long float32 windows by its rule, and compiles a kernel per shape. The fused
    kernel is timed against the backend flex was chosen over (tiled), not against flex: timing
    flex on the measurement's 256-row proxy compiled it for that shape alone, 5 s of a 7 s
    first call, to be thrown away when the kernel won."""
    from multihead.backends import flex, fused

    rivals = []
    monkeypatch.setattr(registry, "_CHOICES", {})
    monkeypatch.setattr(fused, "built", lambda: True)  # only chosen here, never run
    monkeypatch.setattr(flex, "measured_faster", lambda call: True)  # flex leads by its rule
    for verdict in (True, False):
        monkeypatch.setattr(registry, "_CHOICES", {})
        monkeypatch.setattr(
            fused, "measured_faster", lambda call, rival, v=verdict: rivals.append(rival) or v
        )
        q, k, v = qkv(1, 2, 2, 64, 64, 8, dtype=torch.float32)
        window = masks.sliding_window(4)
        assert _auto(q, k, v, window) == ("fused" if verdict else "flex")
        without = registry._choose(
            prepare(q, k, v, window, None, None, 0.0, False), skip=frozenset({"flex", "fused"})
        )
        assert without == "tiled" and rivals[-1] is registry.BACKENDS[without].run
    assert flex.BACKEND.compiles and not fused.BACKEND.compiles
    # explain names the backend the kernel was timed against
    monkeypatch.setattr(fused, "measured_faster", lambda call, rival: False if rival is None else 1)
    reasons = mh.explain_backend(q, k, v, window).reasons
    assert "did not measure faster than tiled" in reasons["fused"]
    assert flex.compile_log() == []
