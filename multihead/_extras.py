"""Lazy imports of optional dependencies, with an error that names the extra to install."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["require"]


def require(module: str, extra: str, feature: str) -> ModuleType:
    """Import ``module`` or raise ModuleNotFoundError saying which extra provides it.

    Args:
        module: the import name (``"onnxruntime"``).
        extra: the pyproject extra that installs it (``"export"``).
        feature: what needs it, for the message (``"multihead export onnx"``).
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(
            f"{feature} needs {module}; install it with pip install 'multihead[{extra}]'. "
            f"Received: {err}"
        ) from err
