"""Reading model folders in Hugging Face's layout, shared by the model families' loaders and
``multihead.load``.

A folder holds ``config.json``, weights (``model.safetensors``, a sharded
``model.safetensors.index.json`` or ``pytorch_model.bin``) and usually ``tokenizer.json``. Every
problem with a file is reported with the file's name and what is wrong with it. config.json is
checked against the weights' header (names, shapes, dtypes) on a model built on the meta device
before any real model is built, so a config that claims sizes the weights do not have allocates
nothing; weights that do not fit the config (missing, extra, misshapen or integer tensors) are
an error, never a partial load. File names read from a config stay inside the folder. Needs the
``pretrained`` extra (safetensors, tokenizers).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any, TypeVar

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from ._extras import require

__all__ = [
    "WEIGHT_FILES",
    "Weights",
    "assign",
    "build_on_meta",
    "check_unstored",
    "file_in",
    "match",
    "model_folder",
    "read_config",
    "read_json",
    "read_tokenizer",
    "weights",
]

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
_LISTED = 20  # tensor names an error lists before summarizing the rest

C = TypeVar("C")
M = TypeVar("M")


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
    except RecursionError:
        raise ValueError(
            f"{name} in {folder} nests lists or objects too deeply to be a model config "
            f"(thousands of levels); it is corrupt or crafted. Received: {raw[:40]!r}"
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


def file_in(folder: Path, name: Any, *, source: str, field: str) -> Path:
    """``folder / name`` for a file name read from ``source``; a name that is not a string, is
    absolute or climbs out of the folder (``..``) is refused, so a config cannot point the
    loader at files elsewhere (a symlink the folder's owner placed is still followed)."""
    path = PurePath(name) if isinstance(name, str) else None
    if path is None or not path.parts or path.is_absolute() or ".." in path.parts:
        raise ValueError(
            f"{source} in {folder}: {field} must name a file inside the model folder (a "
            f"relative path without '..'), e.g. 'model.safetensors'. Received: {field}={name!r}"
        )
    return folder / path


# safetensors' dtype names (the header's "dtype" field) -> torch dtypes
_SAFETENSORS_DTYPES = {
    name: getattr(torch, attr)
    for name, attr in {
        "F64": "float64",
        "F32": "float32",
        "F16": "float16",
        "BF16": "bfloat16",
        "F8_E4M3": "float8_e4m3fn",
        "F8_E5M2": "float8_e5m2",
        "I64": "int64",
        "I32": "int32",
        "I16": "int16",
        "I8": "int8",
        "U64": "uint64",
        "U32": "uint32",
        "U16": "uint16",
        "U8": "uint8",
        "BOOL": "bool",
    }.items()
    if hasattr(torch, attr)
}


def _need_safetensors() -> Any:
    require("safetensors.torch", "pretrained", "reading .safetensors weights")
    import safetensors

    return safetensors


@contextlib.contextmanager
def _safetensors_errors(file: Path, folder: Path) -> Iterator[None]:
    """safetensors' own errors (a pickle, an empty or a cut file) as a ValueError naming it."""
    safetensors = _need_safetensors()
    if file.stat().st_size == 0:
        raise ValueError(
            f"{file.name} in {folder} is empty (0 bytes); download it again. Received: 0 bytes"
        )
    try:
        yield
    except (safetensors.SafetensorError, OSError) as err:
        raise ValueError(
            f"{file.name} in {folder} is truncated or corrupt, or not a safetensors file "
            f"({err}); download or save it again. Received: {_size(file)}"
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


def _meta(t: Tensor) -> Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


@dataclass
class Weights:
    """A checkpoint's tensors: first their names, shapes and dtypes (``header``: meta tensors,
    read from the safetensors headers without touching the data), then the data (``read``).

    Attributes:
        folder: the model folder.
        header: tensor name -> a meta tensor of the stored shape and dtype.
        files: tensor name -> the name of the file that holds it (for messages).
    """

    folder: Path
    header: dict[str, Tensor]
    files: dict[str, str]
    _read: Callable[[], dict[str, Tensor]] = dataclasses.field(repr=False)
    _rename: Callable[[str], str] = dataclasses.field(default=lambda name: name, repr=False)

    def read(self) -> dict[str, Tensor]:
        """Every tensor, under the same names as ``header``."""
        return {self._rename(k): v for k, v in self._read().items()}

    def renamed(self, rename: Callable[[str], str]) -> Weights:
        """The same weights with every tensor name passed through ``rename`` (a prefix
        stripped, old names modernized)."""
        both = lambda name: rename(self._rename(name))  # noqa: E731
        return Weights(
            self.folder,
            {rename(k): v for k, v in self.header.items()},
            {rename(k): v for k, v in self.files.items()},
            self._read,
            both,
        )

    def file(self, name: str) -> str:
        """The name of the file holding tensor ``name``, for a message."""
        return self.files.get(name, "the weights")


def _safetensors_weights(files: list[Path], folder: Path) -> Weights:
    from safetensors import safe_open
    from safetensors.torch import load_file

    header: dict[str, Tensor] = {}
    where: dict[str, str] = {}
    for file in files:
        with _safetensors_errors(file, folder), safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - a safe_open handle is not a dict
                piece = f.get_slice(name)
                kind = piece.get_dtype()
                if kind not in _SAFETENSORS_DTYPES:
                    raise ValueError(
                        f"tensor {name} in {file.name} has the dtype {kind}, which torch cannot "
                        f"hold. Received: {name}.dtype={kind}"
                    )
                shape = tuple(piece.get_shape())
                header[name] = torch.empty(shape, dtype=_SAFETENSORS_DTYPES[kind], device="meta")
                where[name] = file.name

    def read() -> dict[str, Tensor]:
        state: dict[str, Tensor] = {}
        for file in files:
            with _safetensors_errors(file, folder):
                state.update(load_file(str(file)))
        return state

    return Weights(folder, header, where, read)


def weights(folder: Path, file: Path | None = None) -> Weights:
    """The checkpoint in ``folder``: ``file`` (a safetensors file) when given; else
    ``model.safetensors``, then the shards listed in ``model.safetensors.index.json`` (each
    confined to the folder), then ``pytorch_model.bin`` (read with torch's tensors-only
    loader, whole: its format has no separate header).

    Raises:
        FileNotFoundError: no weights file, or a shard the index lists is missing.
        ValueError: an empty, truncated or corrupt file, a pickle where safetensors belong, a
            shard path outside the folder (the message names the file).
    """
    if file is not None:
        return _safetensors_weights([file], folder)
    single = folder / "model.safetensors"
    if single.is_file():
        return _safetensors_weights([single], folder)
    index_name = "model.safetensors.index.json"
    if (folder / index_name).is_file():
        index = read_json(folder, index_name)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(
                f"{index_name} in {folder} must map tensor names to shard files under "
                f"'weight_map'. Received: weight_map={weight_map!r}"
            )
        shards = []
        for shard in sorted(set(map(str, weight_map.values()))):
            path = file_in(folder, shard, source=index_name, field="weight_map")
            if not path.is_file():
                raise FileNotFoundError(
                    f"{index_name} in {folder} lists the shard {shard}, which is missing. "
                    f"Received: {sorted(p.name for p in folder.iterdir())}"
                )
            shards.append(path)
        return _safetensors_weights(shards, folder)
    binary = folder / "pytorch_model.bin"
    if binary.is_file():
        state = _torch_bin(binary, folder)
        return Weights(
            folder,
            {k: _meta(v) for k, v in state.items()},
            dict.fromkeys(state, binary.name),
            lambda: state,
        )
    raise FileNotFoundError(
        f"no weights in {folder}: expected model.safetensors or pytorch_model.bin (or the "
        "shards of a model.safetensors.index.json). "
        f"Received: {sorted(p.name for p in folder.iterdir())}"
    )


class _Budget(TorchFunctionMode):
    """Counts torch calls and stops a build that makes far more than the weights justify."""

    def __init__(self, limit: int, message: str) -> None:
        super().__init__()
        self.limit, self.message, self.calls = limit, message, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        if self.calls > self.limit:
            raise ValueError(self.message)
        return func(*args, **(kwargs or {}))


# torch calls a model build may make per stored tensor (creation and initialization of a
# parameter take about 10; fused checkpoint tensors feed up to 3 parameters), and a base for
# the parts that store nothing (a sinusoidal table, rotary frequencies)
_CALLS_PER_TENSOR = 200
_CALLS_BASE = 10_000


# memory a model may hold beyond what its file stores (tables computed at build time, such as
# sinusoidal positions or rotary frequencies: a few MB in real models), on top of four times
# the stored bytes (the model is built in fp32 while a file may hold 1-byte fp8 weights)
_UNSTORED_BYTES = 256 * 2**20


def check_unstored(skeleton: nn.Module, stored: Weights, *, source: str = "config.json") -> None:
    """Refuse a meta-built model whose tensors would take far more memory than the weights
    hold: a table the file does not store (a sinusoidal encoding's ``max_len``) can still be
    sized by config.json alone.

    Raises:
        ValueError: naming the largest such tensor and its shape.
    """
    tensors: dict[int, tuple[str, torch.Tensor]] = {
        id(t): (name, t) for name, t in skeleton.named_parameters()
    }
    tensors.update({id(t): (name, t) for name, t in skeleton.named_buffers()})
    need = sum(t.numel() * t.element_size() for _, t in tensors.values())
    have = sum(t.numel() * t.element_size() for t in stored.header.values())
    if need > 4 * have + _UNSTORED_BYTES:
        name, biggest = max(tensors.values(), key=lambda item: item[1].numel())
        raise ValueError(
            f"{source} in {stored.folder} describes a model of {need / 2**30:.1f} GiB but the "
            f"weights hold {have / 2**20:.1f} MiB; its largest tensor, {name} of shape "
            f"{tuple(biggest.shape)}, is sized by {source} alone. Fix the size in {source}. "
            f"Received: {name}.shape={tuple(biggest.shape)}"
        )


def build_on_meta(
    make: Callable[[], M], stored: Weights, *, source: str = "config.json"
) -> M | None:
    """``make()`` run on the meta device: shapes only, no memory, so a config whose sizes
    disagree with the weights is caught before any allocation. A build that runs far longer
    than the number of stored tensors justifies (a layer count of a billion) is stopped, and
    sizes torch cannot hold are a ValueError. None when the model cannot be built without
    memory at all (a constructor of the user's that reads tensor values): the caller then
    checks the weights after the real build.

    Raises:
        ValueError: the build ran over its budget, or a size is negative or overflows.
    """
    n = len(stored.header)
    files = ", ".join(sorted(set(stored.files.values()))) or "the weights"
    limit = _CALLS_BASE + _CALLS_PER_TENSOR * n
    budget = _Budget(
        limit,
        f"{source} in {stored.folder} describes a model far larger than {files} holds: "
        f"building it stopped after {limit} tensor operations while the file has {n} "
        f"tensors. A layer count or size in {source} is wrong for these weights. "
        f"Received: {n} stored tensors",
    )
    try:
        with torch.device("meta"), budget:
            return make()
    except (RuntimeError, NotImplementedError) as err:
        text = str(err)
        if "overflow" in text or "negative dimension" in text:
            raise ValueError(
                f"{source} in {stored.folder}: the model it describes cannot be built ({text}); "
                f"a size in it is out of range. Received: {type(err).__name__}"
            ) from None
        return None


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
    Tokenizer = require("tokenizers", "pretrained", "reading tokenizer.json").Tokenizer
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


def _listed(names: list[str]) -> str:
    more = f" and {len(names) - _LISTED} more" if len(names) > _LISTED else ""
    return ", ".join(names[:_LISTED]) + more


def match(
    own: Mapping[str, Tensor],
    stored: Mapping[str, Tensor],
    names: Mapping[str, str | tuple[str, Callable[[Tensor], Tensor]]],
    *,
    weights: Weights,
    unused: Callable[[str], bool] = lambda name: False,
) -> dict[str, Tensor]:
    """Pair a model's state dict ``own`` with checkpoint tensors ``stored``: ``names`` maps
    each of the model's keys to a checkpoint name, or to ``(name, convert)`` when the stored
    tensor needs a transform (a slice of a fused projection, a transpose); several keys may
    share one name (tied weights, fused projections). Works on meta tensors too, so a config
    is checked against a file's header before anything is allocated.

    ``unused(name)`` says which checkpoint tensors may be left out on purpose (buffers older
    checkpoints saved, heads of other tasks); any other tensor left over is an error.

    Returns:
        The model's key -> its tensor (converted).

    Raises:
        ValueError: a tensor the model needs is missing, has another shape, holds integers
            where the model has floats (or the reverse), or a checkpoint tensor is left
            unused (config.json and the weights disagree). The tensor, its file and both
            shapes are named.
    """
    sources = {
        mine: (spec, None) if isinstance(spec, str) else spec for mine, spec in names.items()
    }
    _check_present(sources, stored, weights)
    paired: dict[str, Tensor] = {}
    for mine, (theirs, convert) in sources.items():
        tensor, target = stored[theirs], own[mine]
        if tensor.is_floating_point() != target.is_floating_point():
            raise ValueError(
                f"weight {theirs} is stored as {tensor.dtype} in {weights.file(theirs)} but the "
                f"model needs {'floating-point' if target.is_floating_point() else 'integer'} "
                f"values there ({target.dtype}); the file was not written for this model. "
                f"Received: {theirs}.dtype={tensor.dtype}"
            )
        if convert is not None:
            if tensor.dim() != target.dim():
                raise ValueError(
                    f"weight {theirs} has shape {tuple(tensor.shape)} in {weights.file(theirs)}, "
                    f"which does not fit the config (a {target.dim()}-d tensor of shape "
                    f"{tuple(target.shape)} is taken from it). "
                    f"Received: {theirs}.shape={tuple(tensor.shape)}"
                )
            tensor = convert(tensor)
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(
                f"weight {theirs} has shape {tuple(stored[theirs].shape)} in "
                f"{weights.file(theirs)} but the config implies {tuple(target.shape)}; "
                "config.json and the weights disagree. "
                f"Received: {theirs}.shape={tuple(stored[theirs].shape)}"
            )
        paired[mine] = tensor
    _check_used(sources, stored, weights, unused)
    return paired


def _check_present(sources: Mapping[str, tuple], stored: Mapping[str, Tensor], weights) -> None:
    """Every checkpoint tensor ``sources`` names must be stored."""
    missing = sorted({theirs for theirs, _ in sources.values() if theirs not in stored})
    if missing:
        raise ValueError(
            f"the weights in {weights.folder} lack {len(missing)} tensors the config needs: "
            f"{_listed(missing)}. config.json and the weights disagree (fewer layers or other "
            f"parts than the config describes). Received: {len(stored)} tensors"
        )


def _check_used(
    sources: Mapping[str, tuple],
    stored: Mapping[str, Tensor],
    weights,
    unused: Callable[[str], bool],
) -> None:
    """Every stored tensor must be used, or one ``unused`` says may be left out."""
    used = {theirs for theirs, _ in sources.values()}
    left = sorted(name for name in stored if name not in used and not unused(name))
    if left:
        raise ValueError(
            f"the weights in {weights.folder} hold {len(left)} tensors the config does not "
            f"use: {_listed(left)}. config.json and the weights disagree (more layers or "
            "other parts than the config describes); loading only some of them would give a "
            f"different model. Received: {len(stored)} tensors, {len(used)} used"
        )


def assign(
    model: nn.Module,
    state: Mapping[str, Tensor],
    names: Mapping[str, str | tuple[str, Callable[[Tensor], Tensor]]],
    *,
    weights: Weights,
    unused: Callable[[str], bool] = lambda name: False,
) -> None:
    """Load checkpoint tensors into ``model`` (see ``match`` for ``names``, ``unused`` and
    the errors): never a partial load."""
    paired = match(model.state_dict(), state, names, weights=weights, unused=unused)
    model.load_state_dict(paired, strict=True)
