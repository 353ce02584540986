"""The package build's C++ kernels (everything else about the package is in pyproject.toml).

Installed into an environment that already holds torch and a C++ compiler (``pip install
--no-build-isolation``, as the README's commands do), every kernel of
``multihead/kernels/build.py``'s ``KERNELS`` is compiled with torch's C++ extension
tooling (the kernels at the same time, one per core) and placed inside the package, with a
record of what it was built from. Without torch in the build environment (pip's default build
isolation), without a compiler, or when a kernel fails to compile, the package installs
without it and says so; at run time the kernel is then compiled on demand into the per-user
cache (``multihead doctor``).
``MULTIHEAD_BUILD_KERNELS=0`` builds the package without them (a wheel to publish).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import threading
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent


def _say(message: str) -> None:
    print(f"multihead: {message}", file=sys.stderr, flush=True)


def _builder():
    """multihead/kernels/build.py, loaded by path: the package itself is not importable while
    it is being built."""
    path = HERE / "multihead" / "kernels" / "build.py"
    spec = importlib.util.spec_from_file_location("_multihead_kernels_build", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while decorating
    spec.loader.exec_module(module)
    return module


def _kernels() -> dict:
    """setup()'s ext_modules and cmdclass for the kernels, or nothing (with the reason said)."""
    if os.environ.get("MULTIHEAD_BUILD_KERNELS", "1") == "0":
        # a wheel to publish: a kernel compiled with -march=native belongs to the machine it
        # was built on (users' installs compile their own, or their cache does)
        _say("MULTIHEAD_BUILD_KERNELS=0: the package is built without its C++ kernels")
        return {}
    try:
        import torch  # noqa: F401
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        _say(
            "torch is not importable where the package is built, so its C++ kernels are not "
            "compiled now (install torch first, then this package with --no-build-isolation; "
            "or compile them later with `multihead doctor`)"
        )
        return {}
    ext = _builder()
    missing = ext.compiler_missing()
    if missing is not None:
        _say(f"the C++ kernels are not compiled: {missing}; everything else installs and runs")
        return {}

    class BuildKernels(BuildExtension):
        """torch's extension builder, where the kernels compile at the same time, one failing
        leaves the others and the package installable, and every built kernel gets its
        record beside it."""

        _lock = threading.Lock()

        def finalize_options(self) -> None:
            super().finalize_options()
            if self.parallel is None:  # no -j given: each kernel is one source file, one core
                self.parallel = max(1, min(len(ext.KERNELS), os.cpu_count() or 1))

        def _own_folders(self) -> None:
            """Each kernel's objects in a folder of its own: torch's compile writes one
            build.ninja per folder, so two kernels sharing one would overwrite each other's."""
            with self._lock:
                if getattr(self.compiler, "_multihead_folders", False):
                    return
                shared = self.compiler.compile

                def compile(sources, output_dir=None, *args, **kwargs):
                    folder = Path(output_dir or self.build_temp) / Path(sources[0]).stem
                    return shared(sources, str(folder), *args, **kwargs)

                self.compiler.compile = compile
                self.compiler._multihead_folders = True

        def build_extension(self, extension) -> None:
            kernel = next(k for k in ext.KERNELS if k.module == extension.name)
            self._own_folders()
            try:
                super().build_extension(extension)
            except Exception as e:  # any failure: the package still installs without it
                _say(f"{kernel.label} could not be compiled: {ext.first_error(e)}")
                return
            text = json.dumps(ext.record(kernel), indent=1) + "\n"
            built = Path(self.get_ext_fullpath(extension.name))
            (built.parent / kernel.record_path.name).write_text(text, encoding="utf-8")
            if self.inplace or getattr(self, "editable_mode", False):
                # an editable install copies the module into the sources: its record too
                (HERE / "multihead" / kernel.record_path.relative_to(ext.PACKAGE)).write_text(
                    text, encoding="utf-8"
                )

        def get_outputs(self) -> list[str]:
            records = [
                str(Path(self.get_ext_fullpath(k.module)).parent / k.record_path.name)
                for k in ext.KERNELS
            ]
            return [*super().get_outputs(), *(r for r in records if Path(r).exists())]

    modules = [
        CppExtension(
            kernel.module,
            [f"multihead/{kernel.source}"],
            # its headers: an edited header rebuilds it (a build newer than the sources is kept)
            depends=[str(path) for path in kernel.files[1:]],
            extra_compile_args=ext.cflags(),
            extra_link_args=ext.ldflags(),
        )
        for kernel in ext.KERNELS
    ]
    return {"ext_modules": modules, "cmdclass": {"build_ext": BuildKernels}}


setup(**_kernels())
