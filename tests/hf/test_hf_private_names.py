"""transformers' private names are read in ``multihead/hf/_transformers.py`` only, and a name
transformers renames falls back to what transformers itself does instead of failing.

A renamed name is simulated as a later transformers would ship it: factories in
``masking_utils`` whose closures capture their variables under other names (the same
predicates), a missing ``_active_collector`` or ``_CAN_RECORD_REGISTRY``. The models' outputs
are then compared with eager attention and with the readable closures, in fp32, with the
tolerance of test_hf_attention.py.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import transformers as tf
from hf_archs import BY_NAME, VOCAB, Arch
from transformers import masking_utils as mu
from transformers.utils import output_capturing

import multihead.hf as mhf
from multihead.hf import _transformers
from multihead.hf import attention as hf_attention

OUT_RTOL = 2e-4
HF = Path(mhf.__file__).parent
ROOT = HF.parent


@pytest.fixture
def renamed(monkeypatch):
    """``and_masks``, ``sliding_window_overlay`` and ``padding_mask_function`` as if a later
    transformers named what their closures capture otherwise."""

    def and_masks(*functions):
        def and_mask(batch_idx, head_idx, q_idx, kv_idx):
            result = q_idx.new_ones((), dtype=torch.bool)
            for function in functions:
                result = result & function(batch_idx, head_idx, q_idx, kv_idx).to(result.device)
            return result

        return and_mask

    def sliding_window_overlay(window):
        def inner_mask(batch_idx, head_idx, q_idx, kv_idx):
            return kv_idx > q_idx - window

        return inner_mask

    def padding_mask_function(keep):
        def inner_mask(batch_idx, head_idx, q_idx, kv_idx):
            return keep[batch_idx, kv_idx]

        return inner_mask

    monkeypatch.setattr(mu, "and_masks", and_masks)
    monkeypatch.setattr(mu, "sliding_window_overlay", sliding_window_overlay)
    monkeypatch.setattr(mu, "padding_mask_function", padding_mask_function)
    _transformers._factory_codes.cache_clear()
    yield
    _transformers._factory_codes.cache_clear()


def _cases() -> dict[str, dict]:
    """Keywords transformers passes to a mask interface, one call per entry, built when the
    test runs (under the renamed factories)."""
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 4, 5, 0, 1, 2]])
    keep = torch.ones(2, 9, dtype=torch.bool)
    keep[1, :3] = False
    return {
        "sliding": dict(
            q_length=9, kv_length=9, mask_function=mu.sliding_window_causal_mask_function(3)
        ),
        "sliding decode": dict(
            q_length=1,
            kv_length=9,
            q_offset=8,
            mask_function=mu.sliding_window_causal_mask_function(3),
            attention_mask=keep,
        ),
        "packed": dict(
            q_length=9,
            kv_length=9,
            mask_function=mu.packed_sequence_compatibility_function(
                mu.causal_mask_function, positions, mu.find_packed_sequence_indices(positions)
            ),
        ),
        "chunked+padding": dict(
            q_length=9,
            kv_length=9,
            mask_function=mu.chunked_causal_mask_function(4, torch.tensor([0, 3])),
            attention_mask=keep,
        ),
        "padding inside": dict(
            q_length=9,
            kv_length=9,
            mask_function=mu.and_masks(mu.causal_mask_function, mu.padding_mask_function(keep)),
        ),
    }


@pytest.mark.parametrize("name", list(_cases()))
def test_a_renamed_closure_falls_back_to_transformers_lowering(renamed, name):
    keywords = {"batch_size": 2, **_cases()[name]}
    want = mu.sdpa_mask(**keywords, allow_is_causal_skip=False)
    mask = mhf.make_mask(**keywords, dtype=torch.float32, config=None, allow_is_causal_skip=True)
    got = mask.to_dense(keywords["q_length"], keywords["kv_length"])
    assert torch.equal(got.expand(want.shape), want)
    assert "predicate" in repr(mask).split("\n")[0]  # evaluated, not read


def test_the_reader_reads_a_factory_and_declines_anything_else():
    assert _transformers.read_mask_function(lambda b, h, q, k: q >= k) is None
    kind, values = _transformers.read_mask_function(mu.sliding_window_overlay(4))
    assert (kind, values) == ("sliding", {"sliding_window": 4})


def _model(arch: Arch) -> tf.PreTrainedModel:
    torch.manual_seed(0)
    return getattr(tf, arch.model).from_config(arch.make(), attn_implementation="eager").eval()


def _batch(arch: Arch) -> tuple[dict, torch.Tensor]:
    """Mistral: a left-padded batch longer than its window of 5; Llama: packed documents
    (position_ids that restart, no attention_mask), where transformers combines its
    predicates with and_masks."""
    g = torch.Generator().manual_seed(1)
    if arch.name == "llama":
        ids = torch.randint(3, VOCAB, (1, 10), generator=g)
        positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2]])
        batch = {"input_ids": ids, "position_ids": positions, "use_cache": False}
        return batch, torch.ones(1, 10, dtype=torch.bool)
    ids = torch.randint(3, VOCAB, (2, 12), generator=g)
    keep = torch.ones(2, 12, dtype=torch.long)
    keep[1, :3], ids[1, :3] = 0, 0
    return {"input_ids": ids, "attention_mask": keep}, keep.bool()


def _logits(model, arch: Arch, impl: str, monkeypatch) -> tuple[torch.Tensor, list[str]]:
    """The logits under ``impl`` and the first line of every mask multihead received."""
    seen: list[str] = []
    original = hf_attention.prepare

    def spy(q, k, v, mask, *args):
        seen.append(repr(mask).split("\n")[0])
        return original(q, k, v, mask, *args)

    monkeypatch.setattr(hf_attention, "prepare", spy)
    model.set_attn_implementation(impl)
    with torch.no_grad():
        out = model(**_batch(arch)[0]).logits
    monkeypatch.setattr(hf_attention, "prepare", original)
    return out, seen


@pytest.mark.parametrize(
    ("name", "read_as"), [("mistral", "sliding_window"), ("llama", "documents")]
)
def test_a_model_with_renamed_closures_matches_eager(monkeypatch, request, name, read_as):
    arch = BY_NAME[name]
    model = _model(arch)
    valid = _batch(arch)[1]
    eager, _ = _logits(model, arch, "eager", monkeypatch)
    readable, seen = _logits(model, arch, "multihead", monkeypatch)
    assert seen and all(read_as in line for line in seen)
    request.getfixturevalue("renamed")
    fallen_back, seen = _logits(model, arch, "multihead", monkeypatch)
    assert seen and all("predicate" in line for line in seen)
    scale = eager[valid].abs().max()
    for got in (readable, fallen_back):
        assert (got - eager)[valid].abs().max() <= OUT_RTOL * scale
    torch.testing.assert_close(fallen_back, readable, rtol=0, atol=1e-5 * scale.item())


def test_without_the_collector_the_weights_are_computed(monkeypatch):
    assert _transformers.collecting_attentions() is False  # outside a forward
    monkeypatch.delattr(output_capturing, "_active_collector")
    assert _transformers.collecting_attentions() is True


def test_without_the_registry_layers_are_found_from_the_class(monkeypatch):
    model = _model(BY_NAME["llama"])
    want = mhf.attention_layers(model)
    monkeypatch.delattr(output_capturing, "_CAN_RECORD_REGISTRY")
    assert mhf.attention_layers(model) == want and len(want) == 2
    assert _transformers.attn_implementation(model) == "eager"


# ---------------------------------------------------------------------------------------
# No module of multihead.hf but _transformers.py reads a private name of another library.

_INTERNALS = {"__closure__", "__code__", "__globals__", "co_freevars", "cell_contents"}


def _own_private_names() -> set[str]:
    """Every name starting with "_" that multihead itself defines (functions, classes,
    variables, dataclass fields, attributes it assigns): reading one of these is not
    reading another library's private name."""
    names: set[str] = set()
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
    return {n for n in names if n.startswith("_")}


def _foreign_private(node: ast.AST, own: set[str]) -> str | None:
    """What ``node`` reads of another library's private names, or None."""
    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("transformers"):
        parts = [*(node.module or "").split("."), *(a.name for a in node.names)]
        return node.module if any(p.startswith("_") for p in parts) else None
    if isinstance(node, ast.Import):
        found = [a.name for a in node.names if a.name.startswith("transformers")]
        return next((n for n in found if any(p.startswith("_") for p in n.split("."))), None)
    if isinstance(node, ast.Attribute):
        private = node.attr.startswith("_") and not node.attr.endswith("__")
        if node.attr in _INTERNALS or (private and node.attr not in own):
            return node.attr
    if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr"):
        name = getattr(node.args[1], "value", None) if len(node.args) > 1 else None
        if isinstance(name, str) and name.startswith("_") and name not in own:
            return name
    return None


def test_private_names_are_read_in_one_module():
    own = _own_private_names()
    found = []
    for path in sorted(HF.glob("*.py")):
        if path.name == "_transformers.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            what = _foreign_private(node, own)
            if what is not None:
                found.append(f"{path.name}:{node.lineno}: {what}")
    assert found == []


def test_the_check_sees_each_kind_of_access():
    own = _own_private_names()
    sources = [
        "from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY",
        "import transformers._private",
        "output_capturing._active_collector.get()",
        "getattr(config, '_attn_implementation', None)",
        "fn.__closure__",
        "fn.__code__.co_freevars",
    ]
    for source in sources:
        tree = ast.parse(source)
        assert any(_foreign_private(n, own) for n in ast.walk(tree)), source
    assert not any(_foreign_private(n, own) for n in ast.walk(ast.parse("block._owner")))
