"""The engine runs the model through one runtime protocol (torch or onnxruntime, or any object
with ``name``, ``embed`` and ``attention``)."""

from __future__ import annotations

import numpy as np
import pytest

from multihead.serve.engine import Engine, TorchRuntime


class Recording:
    """A runtime from outside: torch underneath, recording every call it receives."""

    name = "recording"

    def __init__(self, pretrained) -> None:
        self.inner = TorchRuntime(pretrained)
        self.calls: list[str] = []

    def embed(self, ids, *, max_tokens):
        self.calls.append(f"embed {len(ids)} {max_tokens}")
        return self.inner.embed(ids, max_tokens=max_tokens)

    def attention(self, ids):
        self.calls.append(f"attention {len(ids)}")
        return self.inner.attention(ids)


def test_default_runtime_is_torch(pretrained):
    assert Engine(pretrained).runtime == "torch"


def test_engine_calls_the_runtime_it_is_given(pretrained):
    runtime = Recording(pretrained)
    engine = Engine(pretrained, runtime=runtime, max_tokens=64)
    ids = [t.ids for t in engine.tokenize(["a cat", "a dog sat"], truncate=False)]
    got = engine.embed(ids)
    weights = engine.attention(ids[0])
    assert engine.runtime == "recording"
    assert runtime.calls == [f"embed 2 {engine.max_tokens}", f"attention {len(ids[0])}"]
    # the same numbers as the engine's own torch runtime: the protocol adds nothing
    plain = Engine(pretrained, max_tokens=64)
    np.testing.assert_array_equal(got, plain.embed(ids))
    np.testing.assert_array_equal(weights, plain.attention(ids[0]))
    assert weights.shape == (engine.layers, engine.heads, len(ids[0]), len(ids[0]))


@pytest.mark.parametrize("name", ["torch", "onnx"])
def test_runtime_names(name):
    from multihead.serve import engine as module

    assert {"torch": module.TorchRuntime, "onnx": module.OnnxRuntime}[name].name == name
