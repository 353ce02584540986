"""Keras chooses its backend once, at its first import: these tests run it on torch.

The variable is set here, when pytest collects this folder and before any test imports Keras,
so the tests do not depend on ``multihead.keras`` choosing the backend for them.
"""

from __future__ import annotations

import os

import pytest

os.environ["KERAS_BACKEND"] = "torch"


@pytest.fixture(scope="session")
def keras():
    """The keras module (torch backend), imported once for every Keras test."""
    import keras

    import multihead.keras  # noqa: F401  (registers multihead's layers)

    assert keras.backend.backend() == "torch"
    return keras
