"""Reading transformers-format model folders, shared by the bert, gpt2 and llama loaders.

A folder holds ``config.json``, weights (``model.safetensors``, a sharded
``model.safetensors.index.json`` or ``pytorch_model.bin``) and usually ``tokenizer.json``. Every
problem with a file is reported with the file's name and what is wrong with it, before any
model is built; weights that do not fit the config (missing, extra or misshapen tensors) are an
error, never a partial load. Needs the ``pretrained`` extra (safetensors, tokenizers).
"""

from __future__ import annotations

import json
import math
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

__all__ = [
    "WEIGHT_FILES",
    "assign",
    "model_folder",
    "parse_config",
    "read_config",
    "read_json",
    "read_tokenizer",
    "read_weights",
]

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
_LISTED = 20  # tensor names an error lists before summarizing the rest

C = TypeVar("C")


def model_folder(path: str | Path) -> Path:
    """``path`` as a Path; FileNotFoundError when it is not a directory."""
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"model directory not found. Received: path='{folder}'")
    return folder


def _size(file: Path) -> str:
    return f"{file.stat().st_size} bytes"


def read_json(folder: Path, name: str, *, required: bool = True) -> Any:
    """The parsed JSON object in ``folder / name``; None when absent and not ``required``.

    Raises:
        FileNotFoundError: the file is missing and required.
        ValueError: the file is empty, not UTF-8, not valid JSON, or not a JSON object.
    """
    file = folder / name
    if not file.is_file():
        if not required:
            return None
        raise FileNotFoundError(
            f"{name} is missing from {folder}. Received: {sorted(p.name for p in folder.iterdir())}"
        )
    raw = file.read_bytes()
    if not raw.strip():
        raise ValueError(
            f"{name} in {folder} is empty; it must hold a JSON object (write or download it "
            f"again). Received: {len(raw)} bytes"
        )
    try:
        value = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise ValueError(
            f"{name} in {folder} is not UTF-8 text (byte {err.start} cannot be decoded); it "
            f"must be a UTF-8 JSON file. Received: {raw[:40]!r}"
        ) from None
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{name} in {folder} is not valid JSON: {err.msg} at line {err.lineno}, column "
            f"{err.colno} (truncated or edited by hand?). Received: {raw[:60]!r}"
        ) from None
    if not isinstance(value, dict):
        raise ValueError(
            f"{name} in {folder} must hold a JSON object ({{...}}). "
            f"Received: a JSON {type(value).__name__}"
        )
    return value


def read_config(folder: Path) -> dict[str, Any]:
    """``config.json`` as a dict (see ``read_json`` for the errors)."""
    return read_json(folder, "config.json")


def _safetensors(file: Path, folder: Path) -> dict[str, Tensor]:
    try:
        from safetensors import SafetensorError
        from safetensors.torch import load_file
    except ImportError:  # pragma: no cover - the pretrained extra is part of the test extra
        raise ModuleNotFoundError(
            "reading .safetensors weights needs the safetensors package; run "
            "pip install 'multihead[pretrained]'. Received: no module named safetensors"
        ) from None
    if file.stat().st_size == 0:
        raise ValueError(
            f"{file.name} in {folder} is empty (0 bytes); download it again. Received: 0 bytes"
        )
    try:
        return load_file(str(file))
    except SafetensorError as err:
        raise ValueError(
            f"{file.name} in {folder} is truncated or corrupt ({err}); download it again. "
            f"Received: {_size(file)}"
        ) from None


def _torch_bin(file: Path, folder: Path) -> dict[str, Tensor]:
    if file.stat().st_size == 0:
        raise ValueError(
            f"{file.name} in {folder} is empty (0 bytes); download it again. Received: 0 bytes"
        )
    try:
        # weights_only: a checkpoint is data; never run code from it
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as err:
        # torch's own message suggests turning the safe loader off: never pass that on
        raise ValueError(
            f"{file.name} in {folder} is not a readable PyTorch checkpoint: the tensors-only "
            f"loader failed with {type(err).__name__}. The file is truncated, corrupt, or holds "
            "Python objects besides tensors; download it again or convert the model to "
            f"model.safetensors. Received: {_size(file)}"
        ) from None
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, Tensor) for k, v in state.items()
    ):
        raise ValueError(
            f"{file.name} in {folder} must hold a dict of tensors (a state dict). "
            f"Received: a {type(state).__name__}"
        )
    return state


def read_weights(folder: Path) -> dict[str, Tensor]:
    """Every tensor of the checkpoint, by its name in the file.

    Tries ``model.safetensors``, then the shards listed in ``model.safetensors.index.json``,
    then ``pytorch_model.bin`` (read with torch's tensors-only loader).

    Raises:
        FileNotFoundError: no weights file, or a shard the index lists is missing.
        ValueError: an empty, truncated or corrupt file (the message names it).
    """
    single = folder / "model.safetensors"
    if single.is_file():
        return _safetensors(single, folder)
    index_name = "model.safetensors.index.json"
    if (folder / index_name).is_file():
        index = read_json(folder, index_name)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(
                f"{index_name} in {folder} must map tensor names to shard files under "
                f"'weight_map'. Received: weight_map={weight_map!r}"
            )
        state: dict[str, Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            file = folder / str(shard)
            if not file.is_file():
                raise FileNotFoundError(
                    f"{index_name} in {folder} lists the shard {shard}, which is missing. "
                    f"Received: {sorted(p.name for p in folder.iterdir())}"
                )
            state.update(_safetensors(file, folder))
        return state
    binary = folder / "pytorch_model.bin"
    if binary.is_file():
        return _torch_bin(binary, folder)
    raise FileNotFoundError(
        f"no weights in {folder}: expected model.safetensors or pytorch_model.bin (or the "
        "shards of a model.safetensors.index.json). "
        f"Received: {sorted(p.name for p in folder.iterdir())}"
    )


def read_tokenizer(folder: Path, *, required: bool) -> Any:
    """``tokenizer.json`` as a ``tokenizers.Tokenizer`` with padding and truncation off; None
    when absent and not ``required``.

    Raises:
        FileNotFoundError: missing and required.
        ValueError: the tokenizers library cannot read it (the message names the file).
    """
    file = folder / "tokenizer.json"
    if not file.is_file():
        if not required:
            return None
        raise FileNotFoundError(
            f"tokenizer.json is missing from {folder}. "
            f"Received: {sorted(p.name for p in folder.iterdir())}"
        )
    try:
        from tokenizers import Tokenizer
    except ImportError:  # pragma: no cover - the pretrained extra is part of the test extra
        raise ModuleNotFoundError(
            "reading tokenizer.json needs the tokenizers package; run "
            "pip install 'multihead[pretrained]'. Received: no module named tokenizers"
        ) from None
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as err:
        raise ValueError(
            f"tokenizer.json in {folder} could not be read by the tokenizers library ({err}); "
            f"it is truncated or not a tokenizers file; download it again. "
            f"Received: {_size(file)}"
        ) from None
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


def _matches(value: Any, tp: Any) -> bool:
    """Whether a JSON value fits a config field's annotation (ints and floats >= 0)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arm) for arm in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0
    if tp is float:
        return (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and math.isfinite(value)
            and value >= 0
        )
    if tp is str:
        return isinstance(value, str)
    if origin is list:
        (arm,) = typing.get_args(tp)
        return isinstance(value, list) and all(_matches(v, arm) for v in value)
    if tp is dict or origin is dict:
        return isinstance(value, dict)
    raise TypeError(f"unsupported config annotation {tp!r}")  # a bug here, not bad input


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(arm) for arm in typing.get_args(tp))
    if origin is list:
        return f"a list of ({_describe(typing.get_args(tp)[0])})"
    names = {
        type(None): "null",
        bool: "true or false",
        int: "a non-negative int",
        float: "a number >= 0",
        str: "a string",
        dict: "an object",
    }
    return names.get(tp, names.get(origin, str(tp)))


def parse_config(
    cls: type[C],
    raw: Mapping[str, Any],
    *,
    source: str = "config.json",
    fixed: Mapping[str, Iterable[Any]] = (),
    choices: Mapping[str, Iterable[Any]] = (),
    positive: Iterable[str] = (),
) -> C:
    """Build the config dataclass ``cls`` from a parsed config.json, checking every field
    against its annotation (int: >= 0, float: finite and >= 0, ``X | None``, ``list[int]``).

    Args:
        fixed: fields that change the math, with the only values implemented; other values
            are refused (absent fields are fine).
        choices: fields whose value must be one of a set (e.g. activation names).
        positive: int fields that must be > 0 (sizes).

    Fields that ``cls`` does not declare are ignored. Every error names the field and ends
    with "Received: field=value".
    """

    def fail(field: str, expected: str) -> ValueError:
        return ValueError(
            f"{source}: {field} must be {expected}. Received: {field}={raw.get(field)!r}"
        )

    if not isinstance(raw, Mapping):
        raise ValueError(f"{source} must hold a JSON object. Received: {type(raw).__name__}")
    for field, allowed in dict(fixed).items():
        allowed = list(allowed)
        if field in raw and raw[field] not in allowed:
            raise fail(field, f"one of {allowed} (the only values implemented)")
    hints = typing.get_type_hints(cls)
    allowed_values = {k: list(v) for k, v in dict(choices).items()}
    values: dict[str, Any] = {}
    for spec in fields(cls):
        field = spec.name
        if field not in raw:
            if spec.default is MISSING and spec.default_factory is MISSING:
                raise ValueError(f"{source}: the required field {field} is missing")
            continue
        value = raw[field]
        if field in allowed_values:
            if value not in allowed_values[field]:
                raise fail(field, f"one of {allowed_values[field]}")
        elif not _matches(value, hints[field]):
            raise fail(field, _describe(hints[field]))
        values[field] = value
    config = cls(**values)
    for field in positive:
        if getattr(config, field) == 0:
            raise fail(field, "positive")
    return config


def assign(
    model: nn.Module,
    state: Mapping[str, Tensor],
    names: Mapping[str, str | tuple[str, Callable[[Tensor], Tensor]]],
    *,
    folder: Path,
    unused: Callable[[str], bool] = lambda name: False,
) -> None:
    """Load checkpoint tensors into ``model``: ``names`` maps each of the model's state-dict
    keys to a checkpoint name, or to ``(name, convert)`` when the stored tensor needs a
    transform (a slice of a fused projection, a transpose). Several keys may share one name
    (tied weights, fused projections).

    ``unused(name)`` says which checkpoint tensors may be left out on purpose (buffers older
    checkpoints saved, heads of other tasks); any other tensor left over is an error.

    Raises:
        ValueError: a tensor the model needs is missing, has another shape, or a checkpoint
            tensor is left unused (config.json and the weights disagree).
    """
    sources = {
        mine: (spec, None) if isinstance(spec, str) else spec for mine, spec in names.items()
    }
    missing = sorted({theirs for theirs, _ in sources.values() if theirs not in state})
    if missing:
        raise ValueError(
            f"the weights in {folder} lack {len(missing)} tensors the config needs, e.g. "
            f"{missing[:3]}. Received: {len(state)} tensors"
        )
    own = model.state_dict()
    ours: dict[str, Tensor] = {}
    for mine, (theirs, convert) in sources.items():
        tensor = state[theirs]
        if convert is not None:
            if tensor.dim() != own[mine].dim():
                raise ValueError(
                    f"weight {theirs} has shape {tuple(tensor.shape)}, which does not fit the "
                    f"config. Received: config.json and weights that disagree"
                )
            tensor = convert(tensor)
        if tuple(tensor.shape) != tuple(own[mine].shape):
            raise ValueError(
                f"weight {theirs} has shape {tuple(state[theirs].shape)} but the config implies "
                f"{tuple(own[mine].shape)}. Received: config.json and weights that disagree"
            )
        ours[mine] = tensor
    used = {theirs for theirs, _ in sources.values()}
    left = sorted(name for name in state if name not in used and not unused(name))
    if left:
        listed = ", ".join(left[:_LISTED])
        more = f" and {len(left) - _LISTED} more" if len(left) > _LISTED else ""
        raise ValueError(
            f"the weights in {folder} hold {len(left)} tensors the config does not use: "
            f"{listed}{more}. config.json and the weights disagree (more layers or other "
            "parts than the config describes); loading only some of them would give a "
            f"different model. Received: {len(state)} tensors, {len(used)} used"
        )
    model.load_state_dict(ours, strict=True)
