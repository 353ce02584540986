"""How a process gets a kernel's compiled module: the one load sequence both kernels use.

The package build's module when its record matches this process, else a build in the per-user
cache (compiled there on first use); nothing at all when the kernel's environment variable is
``0``. A failure is kept with its reason, so a process tries once and says the same reason
every time it is asked (``multihead doctor``, ``explain_backend``, the fallbacks' warnings).
"""

from __future__ import annotations

import os
from types import ModuleType

from . import build
from .build import Kernel

__all__ = ["Loader"]


class Loader:
    """One kernel as this process loads it.

    Args:
        kernel: the kernel's description (``build.FUSED``, ``build.ROWS``).
        name: what messages call it ("the C++ kernel", "the decoding kernel").

    Attributes:
        module: the loaded module, or None (not loaded yet, or it cannot be).
        error: why it cannot be loaded (one line), or None (loaded, or not tried yet).
        origin: where the module came from, "the package build (folder)" or "the per-user
            cache (folder)"; "" while none is loaded.
    """

    def __init__(self, kernel: Kernel, name: str) -> None:
        self.kernel = kernel
        self.name = name
        self.module: ModuleType | None = None
        self.error: str | None = None
        self.origin = ""

    def switched_off(self) -> bool:
        """Whether the kernel's environment variable turns it off (``=0``)."""
        return os.environ.get(self.kernel.switch, "1") == "0"

    def load(self) -> ModuleType:
        """The module: the package build's when it matches this process, else the per-user
        cache's, compiled now when it holds none.

        Raises:
            RuntimeError: the kernel is turned off or cannot be built; the reason is kept
                (``error``) and raised again at every later call, which tries nothing.
        """
        if self.module is not None:
            return self.module
        if self.error is not None:
            raise RuntimeError(self.error)
        if self.switched_off():
            self.error = f"turned off by {self.kernel.switch}=0"
            raise RuntimeError(self.error)
        module, _ = build.packaged(self.kernel)
        if module is not None:
            self.module, self.origin = module, f"the package build ({self.kernel.folder})"
            return module
        missing = build.compiler_missing()
        if missing is not None:
            self.error = f"{self.name} cannot be built: {missing}"
            raise RuntimeError(self.error)
        try:
            self.module = build.compile_in_cache(self.kernel)
        except Exception as e:  # any failure of the toolchain: the callers fall back
            self.error = f"{self.name} could not be built: {build.first_error(e)}"
            raise RuntimeError(self.error) from e
        folder = build.cache_dir() / build.cached_name(self.kernel)
        self.origin = f"the per-user cache ({folder})"
        return self.module

    def load_error(self) -> str | None:
        """None when the module is loaded (loading it now, compiling if need be), else why
        not, in one line."""
        try:
            self.load()
        except RuntimeError:
            return self.error
        return None

    def found(self) -> tuple[bool, str]:
        """(whether a build loads without compiling anything, why the package build's does
        not: "" when it does): the package build's matching this process, or one already in
        the per-user cache."""
        packaged, why = build.packaged(self.kernel)
        return packaged is not None or build.in_cache(self.kernel), why
