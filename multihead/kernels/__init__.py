"""The package's C++ kernels in one place: their sources (``csrc/``), the one builder
(``build``: flags, the package build's records, the per-user cache) and the one load sequence
(``loader.Loader``). The fused attention backend (``backends/fused.py``) and the few-row
products (``modules/few_rows.py``) each hold a ``Loader`` of their kernel."""

from __future__ import annotations

from .build import FUSED, KERNELS, ROWS, Kernel
from .loader import Loader

__all__ = ["FUSED", "KERNELS", "ROWS", "Kernel", "Loader"]
