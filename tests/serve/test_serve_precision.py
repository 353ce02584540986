"""``multihead serve --precision``: the served embeddings are those of the model at the precision
asked for (bf16 linear layers here), /info says which, and onnxruntime refuses anything but
fp32."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from multihead import cli
from multihead.apps import embed_precision, precision
from multihead.bench.texts import sentences
from multihead.serve import Background, Engine, Limits, ServeOptions, create_app, load_engine


@pytest.fixture
def slow_bf16(monkeypatch):
    """bf16 matmuls measured at 0.6x fp32 (an AVX512-BF16 Xeon without AMX)."""
    monkeypatch.setattr(precision, "_measured", {})
    monkeypatch.setattr(precision, "_rates", lambda device, n: (250.0, 150.0))


def test_served_embeddings_honour_the_precision(pretrained, slow_bf16):
    said: list[str] = []
    engine = load_engine(precision="bf16", say=said.append)
    assert engine.precision == "bf16" and Engine(pretrained).precision == "fp32"
    assert "bf16 matmuls are 1.67x slower than fp32" in said[0]  # asked for: kept, with a warning
    texts = sentences(5, min_words=5, max_words=60, seed=7)
    bf16 = embed_precision.at_precision(pretrained, "bf16")[0].embed(texts).numpy()
    fp32 = pretrained.embed(texts).numpy()
    with Background(create_app(engine, Limits())) as running:
        served = np.array(httpx.post(running.url + "/embed", json={"inputs": texts}).json())
        info = httpx.get(running.url + "/info").json()
    assert info["precision"] == "bf16" and info["runtime"] == "torch"
    np.testing.assert_allclose(served, bf16, rtol=0, atol=1e-6)
    assert np.abs(served - fp32).max() > 1e-4  # not the fp32 model's


def test_auto_at_start_up_and_the_onnx_runtime(slow_bf16, tiny_bert):
    said: list[str] = []
    engine = load_engine(tiny_bert, precision="auto", say=said.append)
    assert engine.precision == "fp32"
    assert len(said) == 1 and said[0].startswith("multihead serve: --precision auto chose fp32: ")
    with pytest.raises(ValueError, match=r"--precision applies to the torch runtime .* "
                       r"Received: runtime='onnx', precision='bf16'"):  # fmt: skip
        load_engine(tiny_bert, runtime="onnx", precision="bf16")
    with pytest.raises(ValueError, match=r"precision must be one of auto, fp32, bf16\. "):
        load_engine(tiny_bert, precision="fp16")


def test_serve_takes_the_flag(monkeypatch, capsys):
    import multihead.serve

    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "--precision {auto,fp32,bf16}" in shown and "else fp32 (default: fp32)" in shown

    seen: dict = {}

    def run(options: ServeOptions) -> None:
        seen.update(vars(options))

    monkeypatch.setattr(multihead.serve, "run", run)
    assert cli.main(["serve"]) == 0 and seen["precision"] == "fp32"
    assert cli.main(["serve", "--precision", "auto"]) == 0 and seen["precision"] == "auto"
