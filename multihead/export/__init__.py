"""Shipping a model out of Python: ONNX export and onnxruntime sessions that run the graphs.

Needs the ``export`` extra (onnx, onnxscript, onnxruntime), imported only when used.
"""

from __future__ import annotations

from .onnx import (
    DEFAULT_OPSET,
    MIN_OPSET,
    ExportOptions,
    GraphSpec,
    check_opset,
    check_target,
    exports,
    graph_spec,
    load_for_export,
    run,
    to_onnx,
)
from .runtime import OnnxBert, quantize_int8, session

__all__ = [
    "DEFAULT_OPSET",
    "MIN_OPSET",
    "ExportOptions",
    "GraphSpec",
    "OnnxBert",
    "check_opset",
    "check_target",
    "exports",
    "graph_spec",
    "load_for_export",
    "quantize_int8",
    "run",
    "session",
    "to_onnx",
]
