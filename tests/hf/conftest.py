"""The tiny transformers Llama folder and the same model as a GGUF file, shared by the tests of
loading (``test_hf_load.py``, ``test_one_way_to_load.py``): one module's worth each."""

from __future__ import annotations

import pytest
from models.decoders import build
from tiny_gguf import write_gguf


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build("llama", tmp_path_factory.mktemp("llama"), layers=2)


@pytest.fixture(scope="module")
def gguf_file(folder, tmp_path_factory):
    return write_gguf(folder, tmp_path_factory.mktemp("gguf") / "tiny.gguf")
