"""Save and load models built from the library: ``config.json`` (the architecture as data, no
pickle) plus ``model.safetensors`` (the weights).

A saved folder holds::

    config.json         {"format_version": 1, "model": {"class": NAME, "args": {...}}, ...}
    model.safetensors   the state dict, one tensor per name

``args`` are the constructor arguments. A library module passed as an argument (a layer list,
an injected attention, feed-forward or norm module) is written the same way, recursively, so a
decoder layer that takes its parts as arguments needs nothing beyond one ``register`` call::

    multihead.io.register(TransformerDecoderLayer)     # or @register above the class

``register`` records each instance's constructor arguments when it is built, so ``describe`` can
later write them out; the library's own modules declare the same with ``@saveable`` in their
files. This module is the mechanism only: each model family registers its own layout at the end
of its file (BERT in the Hugging Face layout, so ``transformers`` loads the folder too), and is
imported on demand from the qualified class name a folder names. ``multihead.models.load``
opens folders of other kinds. Needs ``safetensors`` (the ``pretrained`` extra).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import os
import shutil
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ._saveable import DECLARED, INIT_ARGS, record_init
from ._version import __version__

__all__ = ["FORMAT_VERSION", "build", "describe", "load", "register", "registered", "save"]

FORMAT_VERSION = 1
CONFIG = "config.json"
WEIGHTS = "model.safetensors"
TOKENIZER_FILES = (  # a tokenizer a family saves beside the weights; a new save replaces them
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "special_tokens_map.json",
)


@dataclass(frozen=True)
class _Codec:
    """How one class is written and rebuilt.

    describe: instance -> constructor arguments (data, or modules described recursively).
    build: (arguments, folder or None) -> instance; the folder is given at the top level only.
    module: instance -> the nn.Module whose state dict holds the weights.
    names: instance -> {state dict name: name in the file} (default: the same names).
    header: instance -> extra top-level config.json fields (e.g. Hugging Face's).
    files: (instance, folder) -> None, writes extra files (e.g. a tokenizer).
    restore: (instance, folder) -> None, reads them back after a top-level build.
    init: the class whose constructor ``build`` calls with the arguments: its annotations
        check each argument's type before the call (None: no such check).
    whole: ``build`` reads the folder itself, weights included (a model with a loader of
        its own): ``load`` returns what it built.
    """

    cls: type
    name: str
    describe: Callable[[Any], dict[str, Any]]
    build: Callable[[dict[str, Any], Path | None], Any]
    module: Callable[[Any], nn.Module] = lambda obj: obj
    names: Callable[[Any], dict[str, str]] | None = None
    header: Callable[[Any], dict[str, Any]] | None = None
    files: Callable[[Any, Path], None] | None = None
    restore: Callable[[Any, Path], None] | None = None
    init: type | None = None
    whole: bool = False


_BY_NAME: dict[str, _Codec] = {}
_BY_CLASS: dict[type, _Codec] = {}


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _recorded(obj: Any) -> dict[str, Any]:
    """The constructor arguments recorded by ``register``; plain attributes of the same name
    override them, so a value changed after construction (``layer.dropout = 0.2``) is saved."""
    args = getattr(obj, INIT_ARGS, None)
    if args is None:
        raise ValueError(
            f"{type(obj).__name__} was built before multihead.io.register({type(obj).__name__}) "
            "ran, so its constructor arguments were not recorded; register the class before "
            f"building it. Received: {type(obj).__name__} without recorded arguments"
        )
    out = dict(args)
    for key in out:
        current = obj.__dict__.get(key)
        if isinstance(current, (bool, int, float, str)):
            out[key] = current
    return out


def register(
    cls: type | None = None,
    *,
    name: str | None = None,
    describe: Callable[[Any], dict[str, Any]] | None = None,
    build: Callable[[dict[str, Any]], Any] | None = None,
    files: Callable[[Any, Path], None] | None = None,
    restore: Callable[[Any, Path], None] | None = None,
    module: Callable[[Any], nn.Module] | None = None,
    names: Callable[[Any], dict[str, str]] | None = None,
    header: Callable[[Any], dict[str, Any]] | None = None,
    load_folder: Callable[[Path], Any] | None = None,
) -> Any:
    """Make a class saveable; usable as ``register(Cls)`` or as a ``@register`` decorator.

    By default the constructor's arguments are recorded on every new instance and the class is
    rebuilt with ``Cls(**args)``; give ``describe`` (instance -> arguments) and ``build``
    (arguments -> instance) for classes whose constructor cannot be replayed. The name written
    to config.json is ``module.QualName`` unless ``name`` is given; classes inside ``multihead``
    are imported on demand when a folder is loaded, others must be registered before ``load``.
    ``files(obj, folder)`` writes extra files beside the weights (e.g. a tokenizer) and
    ``restore(obj, folder)`` reads them back when the object is the folder's top-level model.

    A model family with a file layout of its own also gives ``module`` (instance -> the
    ``nn.Module`` holding the weights), ``names`` (state dict name -> name in the file),
    ``header`` (extra top-level config.json fields) or, instead of ``build``, ``load_folder``
    (folder -> instance, weights included; such a class loads only as a whole folder).
    """

    def apply(target: type) -> type:
        if not isinstance(target, type):
            raise TypeError(f"register expects a class. Received: {target!r}")
        rebuild = build if load_folder is None else _whole_only(target, load_folder)
        if (describe is None) != (rebuild is None):
            raise ValueError(
                "give both describe and build (or load_folder), or neither. Received: "
                f"describe={describe is not None}, build={rebuild is not None}"
            )
        if describe is None:
            record_init(target)
        make: Callable[[dict[str, Any], Path | None], Any]
        if load_folder is not None:
            make = _whole_only(target, load_folder)
        elif build is not None:
            make = lambda args, folder: build(args)  # noqa: E731
        else:
            make = lambda args, folder: target(**args)  # noqa: E731
        codec = _Codec(
            target,
            name or _qualified(target),
            describe or _recorded,
            make,
            module=module or (lambda obj: obj),
            names=names,
            header=header,
            files=files,
            restore=restore,
            init=None if rebuild else target,
            whole=load_folder is not None,
        )
        _add(codec)
        return target

    return apply if cls is None else apply(cls)


def _whole_only(cls: type, load_folder: Callable[[Path], Any]) -> Callable[..., Any]:
    def rebuild(args: dict[str, Any], folder: Path | None) -> Any:
        if folder is None:
            raise ValueError(
                f"a {cls.__name__} can only be loaded as a whole folder (it reads files of its "
                f"own), not as a part of another model. Received: a nested {cls.__name__}"
            )
        return load_folder(folder)

    return rebuild


def _add(codec: _Codec) -> None:
    _BY_NAME[codec.name] = codec
    _BY_CLASS[codec.cls] = codec


def _constructor(cls: type) -> Callable[[dict[str, Any], Path | None], Any]:
    """Build ``cls`` from its recorded constructor arguments (the folder is not needed)."""
    return lambda args, folder: cls(**args)


def _sync_declared() -> None:
    """Take in the classes declared with ``@saveable`` in their own files since the last call
    (their modules may be imported after this one)."""
    for name, cls in list(DECLARED.items()):
        if cls not in _BY_CLASS:
            _add(_Codec(cls, name, _recorded, _constructor(cls), init=cls))


def _class_codec(cls: type) -> _Codec | None:
    _sync_declared()
    return _BY_CLASS.get(cls)


def registered() -> list[str]:
    """The class names ``load`` can build right now."""
    _sync_declared()
    return sorted(_BY_NAME)


# ---------------------------------------------------------------------------------------------
# describing and building


def _codec_for(obj: Any, where: str) -> _Codec:
    codec = _class_codec(type(obj))
    if codec is None:
        raise TypeError(
            f"{where}: {type(obj).__name__} is not a registered class, so it cannot be written "
            "as data; call multihead.io.register on it (or on the class that builds it). "
            f"Received: {_qualified(type(obj))}"
        )
    return codec


def _encode_scalar(value: Any) -> tuple[bool, Any]:
    """(True, its JSON form) for None, bool, int, str, float and torch.dtype; else (False,
    None)."""
    if value is None or isinstance(value, (bool, int, str)):
        return True, value
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            return True, {"float": str(value)}  # JSON has no NaN or infinity
        return True, value
    if isinstance(value, torch.dtype):
        return True, {"dtype": str(value).removeprefix("torch.")}
    return False, None


def _encode(value: Any, where: str) -> Any:
    scalar, encoded = _encode_scalar(value)
    if scalar:
        return encoded
    if isinstance(value, (list, tuple)):
        items = [_encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if isinstance(value, list) else {"tuple": items}
    if isinstance(value, dict):
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise TypeError(f"{where}: dict keys must be strings. Received: keys {bad[:3]}")
        return {"dict": {k: _encode(v, f"{where}.{k}") for k, v in value.items()}}
    if _class_codec(type(value)) is not None:
        return describe(value, where)
    if isinstance(value, nn.Module):
        _codec_for(value, where)  # raises, naming the class
    raise TypeError(
        f"{where}: a {type(value).__name__} cannot be written as data (allowed: None, bool, int, "
        "float, str, torch.dtype, lists, tuples, dicts and registered modules). "
        f"Received: {where}={value!r}"[:400]
    )


def describe(obj: Any, where: str = "model") -> dict[str, Any]:
    """``{"class": name, "args": {...}}`` for a registered object, nested modules included."""
    codec = _codec_for(obj, where)
    args = codec.describe(obj)
    return {
        "class": codec.name,
        "args": {k: _encode(v, f"{where}.args.{k}") for k, v in args.items()},
    }


def _lookup(name: Any, where: str) -> _Codec:
    if not isinstance(name, str):
        raise ValueError(f"{where}.class must be a string. Received: {where}.class={name!r}")
    if name not in _BY_NAME and name.startswith("multihead."):
        _import_declaring(name)
        _sync_declared()
    if name not in _BY_NAME:
        # the message lists the library's layers too, not only what this process imported
        importlib.import_module("multihead.modules")
        raise ValueError(
            f"{where}.class names a class that is not registered; import the module that "
            f"registers it before loading. Known: {', '.join(registered())}. "
            f"Received: {where}.class={name!r}"
        )
    return _BY_NAME[name]


def _import_declaring(name: str) -> None:
    """Import what declares the library class ``name``: the library's classes register
    themselves when their module is imported, and a folder records either the defining module's
    path (``multihead.apps.forecast.CausalForecaster``) or the public name
    (``multihead.TransformerEncoderLayer``), which the package imports lazily on first use."""
    module, _, attr = name.rpartition(".")
    try:
        found = importlib.import_module(module)
    except ImportError:
        return
    with contextlib.suppress(AttributeError, ImportError):
        getattr(found, attr)


# nesting levels a config may use (a module inside a list inside a module ... ); the deepest the
# library writes is under 10, and Python's own stack would give out near 300
_MAX_DEPTH = 64


def _decode(value: Any, where: str, depth: int) -> Any:
    if depth > _MAX_DEPTH:
        raise ValueError(
            f"the config nests values more than {_MAX_DEPTH} levels deep; no model saved by "
            f"multihead does, so it is corrupt or crafted. Received: {where[:200]}"
        )
    if isinstance(value, list):
        return [_decode(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
    if not isinstance(value, dict):
        return value
    if "class" in value:
        return _build(value, where, None, depth + 1)
    if len(value) != 1:
        raise ValueError(
            f"{where} must be a value, a module {{'class', 'args'}} or one of {{'tuple'}}, "
            f"{{'dict'}}, {{'dtype'}}, {{'float'}}. Received: keys {sorted(value)}"
        )
    ((kind, inner),) = value.items()
    expected = {
        "tuple": (list, "a list"),
        "dict": (dict, "an object"),
        "float": (str, "one of 'nan', 'inf', '-inf'"),
        "dtype": (str, "a torch dtype name such as 'float32'"),
    }
    if kind not in expected:
        raise ValueError(
            f"{where} has an unknown tag; expected tuple, dict, dtype or float. Received: {kind!r}"
        )
    kind_type, words = expected[kind]
    if not isinstance(inner, kind_type):
        raise ValueError(
            f"{where}.{kind} must be {words}. Received: {where}.{kind}={inner!r}"[:400]
        )
    return _decode_tagged(kind, inner, where, depth, words)


def _decode_tagged(kind: str, inner: Any, where: str, depth: int, words: str) -> Any:
    """The value of a ``{kind: inner}`` tag whose ``inner`` has the tag's JSON type."""
    if kind == "tuple":
        return tuple(_decode(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(inner))
    if kind == "dict":
        return {k: _decode(v, f"{where}.{k}", depth + 1) for k, v in inner.items()}
    if kind == "float":
        if inner.lower() not in ("nan", "inf", "-inf", "infinity", "-infinity"):
            raise ValueError(f"{where}.float must be {words}. Received: {where}.float={inner!r}")
        return float(inner)
    dtype = getattr(torch, inner, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{where}.dtype is not a torch dtype. Received: {inner!r}")
    return dtype


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """The constructor's resolved annotations; empty when they cannot be resolved (names
    imported only for type checkers), so nothing is checked rather than something wrongly."""
    try:
        return typing.get_type_hints(cls.__init__)  # type: ignore[misc]
    except Exception:
        return {}


def _check_types(codec: _Codec, args: dict[str, Any], where: str) -> None:
    """Each argument against its constructor annotation (``norm_first: bool`` refuses
    ``"no"``): the class's own signature is the one list of what each field may hold."""
    from .configs import describe_annotation, fits_annotation

    if codec.init is None:
        return
    hints = _hints(codec.init)
    for name, value in args.items():
        if name in hints and not fits_annotation(value, hints[name]):
            shown = (
                value
                if isinstance(value, (bool, int, float, str, type(None)))
                else type(value).__name__
            )
            raise ValueError(
                f"{where}.args.{name} must be {describe_annotation(hints[name])} "
                f"({codec.name}'s constructor says so). Received: {where}.args.{name}={shown!r}"
            )


def build(spec: dict[str, Any], where: str = "model", folder: Path | None = None) -> Any:
    """Rebuild (with fresh weights) what ``describe`` wrote."""
    return _build(spec, where, folder, 0)


def _build(spec: Any, where: str, folder: Path | None, depth: int) -> Any:
    if not isinstance(spec, dict) or "class" not in spec:
        raise ValueError(
            f"{where} must be an object with a class field. Received: {where}={spec!r}"[:300]
        )
    codec = _lookup(spec["class"], where)
    raw_args = spec.get("args", {})
    if not isinstance(raw_args, dict):
        raise ValueError(f"{where}.args must be an object. Received: {where}.args={raw_args!r}")
    args = {k: _decode(v, f"{where}.args.{k}", depth + 1) for k, v in raw_args.items()}
    _check_types(codec, args, where)
    try:
        return codec.build(args, folder)
    except TypeError as err:
        raise ValueError(
            f"{where}: {codec.name} cannot be built from the saved arguments ({err}). "
            f"Received: {where}.args keys {sorted(args)}"
        ) from err


# ---------------------------------------------------------------------------------------------
# save / load


def _unwrap(model: Any) -> Any:
    """Strip DistributedDataParallel and torch.compile wrappers."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif type(model).__name__ == "OptimizedModule" and hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def save(model: Any, folder: str | Path) -> Path:
    """Write ``model`` into ``folder`` (created if needed): config.json and model.safetensors.

    ``model`` is any registered module (MultiHeadAttention, encoder stacks, positional
    encodings, the application models, ...), a ``models.bert.Bert`` or a ``Pretrained`` (then
    in the Hugging Face layout, tokenizer files included). DistributedDataParallel and
    ``torch.compile`` wrappers are removed first. Returns the folder.

    The save is atomic: everything is written into a temporary sibling folder that then takes
    the place of ``folder`` whole, so a crash or a kill at any point leaves the previous
    checkpoint or the new one, each loadable, never a mix (temporaries a killed save left
    behind are removed by the next save to the same place). The files a save writes
    (config.json, model.safetensors, tokenizer and sentence-transformers files) are replaced
    as one set: those of a previous save that this model does not have are gone afterwards.
    Anything else in ``folder`` (notes, logs, subfolders) is carried over into the new folder
    unchanged (hard links where the file system allows, else copies), and the folder keeps its
    permissions. A symlinked ``folder`` is written where the link points.

    Raises:
        TypeError: the model or one of its arguments is not registered (named).
        ValueError: ``folder`` is the working directory or one of its parents (the swap
            would pull the working directory away from under the process).
    """
    from safetensors.torch import save_file

    from ._atomic import replace_folder

    model = _unwrap(model)
    codec = _codec_for(model, "model")
    folder = Path(folder)
    dest = Path(os.path.abspath(folder.resolve() if folder.is_symlink() else folder))
    cwd = Path.cwd()
    if dest == cwd or dest in cwd.parents:
        raise ValueError(
            "save writes a new folder and swaps it into place, so it cannot write into the "
            "working directory or a folder above it; give a folder of its own, e.g. "
            f"'checkpoints/model'. Received: folder='{folder}'"
        )
    module = codec.module(model)
    state = module.state_dict()
    names = codec.names(model) if codec.names else {k: k for k in state}
    unnamed = sorted(set(state) - set(names))
    if unnamed:
        raise ValueError(
            f"{codec.name} has tensors with no name in the file layout: {unnamed[:5]}. "
            f"Received: {len(unnamed)} unnamed tensors"
        )
    tensors: dict[str, Tensor] = {}
    seen: set[tuple[int, int]] = set()
    for key, value in state.items():
        t = value.detach().cpu().contiguous()
        ident = (t.untyped_storage().data_ptr(), t.storage_offset())
        if ident in seen:  # tied weights: safetensors refuses shared memory
            t = t.clone()
        seen.add(ident)
        tensors[names[key]] = t
    config = dict(codec.header(model)) if codec.header else {}
    config.update(
        {
            "format_version": FORMAT_VERSION,
            "model": describe(model),
            "weights": WEIGHTS,
            "multihead_version": __version__,
        }
    )
    dest.parent.mkdir(parents=True, exist_ok=True)
    with replace_folder(dest) as tmp:
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        if codec.files:
            codec.files(model, tmp)
        (tmp / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        if dest.is_dir():
            _carry_over(dest, tmp)
    return folder


# every name a save may write: a previous save's files under these names are replaced as a set
_OWNED = frozenset({CONFIG, WEIGHTS, "sentence_bert_config.json", *TOKENIZER_FILES})


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target, follow_symlinks=False)
    except OSError:  # another file system, or one without hard links
        shutil.copy2(source, target, follow_symlinks=False)


def _carry_over(old: Path, new: Path) -> None:
    """Bring the entries of ``old`` that a save does not own into ``new``, and its permissions
    (a private folder stays private after the swap)."""
    shutil.copymode(old, new)
    for entry in sorted(old.iterdir()):
        if entry.name in _OWNED or (new / entry.name).exists():
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.copytree(entry, new / entry.name, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(str(entry), str(new / entry.name))


def load(folder: str | Path) -> Any:
    """Rebuild what ``save`` wrote: the same class, arguments and weights, in eval mode.

    Nothing is allocated before config.json agrees with the weights: the model is first built
    on the meta device (shapes only) and compared with the safetensors header, tensor by
    tensor. Folders of other kinds (a Hugging Face BERT, GPT-2 or Llama checkpoint) open with
    ``multihead.models.load`` (which is ``multihead.load``).

    Raises:
        FileNotFoundError: the folder, config.json or the weights file is missing.
        ValueError: config.json is not UTF-8 JSON, nests too deeply, or has an unknown format
            version or class, or a field of the wrong type (named, with its file); the
            weights file is empty, corrupt or outside the folder; or the weights do not match
            the architecture (missing, unexpected, mis-shaped or integer tensors, named), or
            mix floating-point dtypes among tensors built in one (the odd one named).
    """
    from . import folder_reading

    folder = Path(folder)
    spec, config = _saved_spec(folder)

    def built() -> Any:
        try:
            return build(spec, "model", folder)
        except ValueError as err:
            if str(err).startswith(CONFIG):  # already names the file (a meta-build limit)
                raise
            raise ValueError(f"{CONFIG} in {folder}: {err}") from None

    if _reads_whole_folder(spec):
        return built()
    weights = folder_reading.file_in(
        folder, config.get("weights", WEIGHTS), source=CONFIG, field="weights"
    )
    if not weights.is_file():
        raise FileNotFoundError(
            f"the weights file {weights.name} is missing from {folder}. "
            f"Received: {sorted(p.name for p in folder.iterdir())}"
        )
    stored = folder_reading.weights(folder, weights)
    skeleton = folder_reading.build_on_meta(built, stored, source=CONFIG)
    if skeleton is not None:
        _check_layout(skeleton, stored)
    obj = built()
    codec = _codec_for(obj, "model")
    module = codec.module(obj)
    own = module.state_dict()
    names = _file_names(codec, obj, own)
    state = folder_reading.match(own, stored.read(), names, weights=stored)
    _check_dtypes(own, state, names, stored)
    _match_dtypes(module, state)
    module.load_state_dict(state, strict=True)
    module.eval()
    if codec.restore:
        codec.restore(obj, folder)
    return obj


def _saved_spec(folder: Path) -> tuple[Any, dict[str, Any]]:
    """The ``model`` field and the whole config.json of a ``save`` folder, checked."""
    from . import folder_reading

    if not folder.is_dir():
        raise FileNotFoundError(f"model folder not found. Received: folder='{folder}'")
    if not (folder / CONFIG).is_file():
        raise FileNotFoundError(
            f"{CONFIG} is missing from {folder}; multihead.save writes it. "
            f"Received: {sorted(p.name for p in folder.iterdir())}"
        )
    config = folder_reading.read_config(folder)
    if "format_version" not in config:
        raise ValueError(
            f"{CONFIG}: the field format_version is missing, so {folder} was not written by "
            "multihead.save (a Hugging Face folder opens with multihead.models.load). "
            f"Received: fields {sorted(config)[:10]}"
        )
    version = config["format_version"]
    if version != FORMAT_VERSION:
        raise ValueError(
            f"{CONFIG}: format_version {version!r} is not one this multihead reads "
            f"({FORMAT_VERSION}); a newer multihead may have written it, so upgrade. "
            f"Received: format_version={version!r}"
        )
    if "model" not in config:
        raise ValueError(f"{CONFIG}: the field model is missing. Received: fields {sorted(config)}")
    return config["model"], config


def _file_names(codec: _Codec, obj: Any, state: dict[str, Tensor]) -> dict[str, str]:
    """State dict name -> name in the weights file."""
    return codec.names(obj) if codec.names else {k: k for k in state}


def _check_layout(skeleton: Any, stored: Any) -> None:
    """The meta-device model against the weights' header: names, shapes and dtypes agree
    before anything is allocated."""
    from . import folder_reading

    codec = _codec_for(skeleton, "model")
    expected = codec.module(skeleton).state_dict()
    names = _file_names(codec, skeleton, expected)
    folder_reading.match(expected, stored.header, names, weights=stored)
    folder_reading.check_unstored(codec.module(skeleton), stored, source=CONFIG)


def _reads_whole_folder(spec: Any) -> bool:
    """Whether the top-level class loads the folder itself (an unknown class: no; ``build``
    then says what is wrong with it)."""
    if not isinstance(spec, dict):
        return False
    try:
        return _lookup(spec.get("class"), "model").whole
    except ValueError:
        return False


def _check_dtypes(
    own: dict[str, Tensor], state: dict[str, Tensor], names: dict[str, str], stored: Any
) -> None:
    """The saved dtypes are the built model's cast as a whole: every floating-point tensor
    built in one dtype was saved in one dtype (a model cast to bfloat16 whole, or packed bf16
    weights beside float32 ones, as built). Each parameter takes the dtype it was saved in, so
    a mix within one would load and then fail in the first matmul."""
    groups: dict[torch.dtype, dict[torch.dtype, list[str]]] = {}
    for key, t in state.items():
        if t.is_floating_point() and own[key].is_floating_point():
            groups.setdefault(own[key].dtype, {}).setdefault(t.dtype, []).append(names[key])
    for saved in groups.values():
        if len(saved) < 2:
            continue
        usual = max(saved, key=lambda d: len(saved[d]))
        odd = sorted((name, d) for d, found in saved.items() if d != usual for name in found)
        name, dtype = odd[0]
        more = f" (and {len(odd) - 1} more)" if len(odd) > 1 else ""
        raise ValueError(
            f"the weights in {stored.file(name)} in {stored.folder} mix floating-point dtypes: "
            f"{len(saved[usual])} tensors are {usual} but {name} is {dtype}{more}, where the "
            "model holds one dtype; it would fail in its first matmul. Save the model again "
            "with multihead.save, or convert those tensors of the file to "
            f"{usual}. Received: {name}.dtype={dtype}"
        )


def _match_dtypes(module: nn.Module, state: dict[str, Tensor]) -> None:
    """Give each parameter and buffer the dtype it was saved in (a bf16 model stays bf16);
    tied parameters are one object, so they stay tied."""
    for key, t in state.items():
        owner_name, _, attr = key.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        current = getattr(owner, attr)
        if isinstance(current, Tensor) and current.dtype != t.dtype:
            current.data = current.data.to(t.dtype)


# ---------------------------------------------------------------------------------------------
# the library's own classes and the torch modules they take as parts


def _torch_module(cls: type, fields: Callable[[Any], dict[str, Any]]) -> None:
    _add(
        _Codec(cls, f"torch.nn.{cls.__name__}", fields, lambda args, folder: cls(**args), init=cls)
    )


def _register_torch() -> None:
    def norm(mod: nn.LayerNorm) -> dict[str, Any]:
        return {
            "normalized_shape": list(mod.normalized_shape),
            "eps": mod.eps,
            "elementwise_affine": mod.elementwise_affine,
            "bias": getattr(mod, "bias", None) is not None,
        }

    _torch_module(nn.LayerNorm, norm)
    if hasattr(nn, "RMSNorm"):
        _torch_module(
            nn.RMSNorm,
            lambda mod: {
                "normalized_shape": list(mod.normalized_shape),
                "eps": mod.eps,
                "elementwise_affine": mod.elementwise_affine,
            },
        )
    _torch_module(
        nn.Linear,
        lambda mod: {
            "in_features": mod.in_features,
            "out_features": mod.out_features,
            "bias": mod.bias is not None,
        },
    )
    _torch_module(
        nn.Embedding,
        lambda mod: {
            "num_embeddings": mod.num_embeddings,
            "embedding_dim": mod.embedding_dim,
            "padding_idx": mod.padding_idx,
        },
    )
    _torch_module(nn.Dropout, lambda mod: {"p": mod.p})
    _torch_module(nn.GELU, lambda mod: {"approximate": mod.approximate})
    for cls in (nn.ReLU, nn.SiLU, nn.Tanh, nn.Identity):
        _torch_module(cls, lambda mod: {})
    _torch_module(nn.ModuleList, lambda mod: {"modules": list(mod)})
    register(
        nn.Sequential,
        name="torch.nn.Sequential",
        describe=lambda mod: {"modules": list(mod)},
        build=lambda args: nn.Sequential(*args["modules"]),
    )


_register_torch()
