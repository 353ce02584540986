"""Every check on user input, and its message, lives here.

Messages say what was expected, what was received, and how to fix it. They end with
"Received: name=value" so a person can find the offending argument at a glance.
"""

from __future__ import annotations

import functools
import inspect
import math
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import ParamSpec, TypeVar, cast

import torch
from torch import Tensor

__all__: list[str] = []

P = ParamSpec("P")
R = TypeVar("R")


def tracing() -> bool:
    """True while torch.compile, torch.export or the ONNX exporter traces a graph.

    Checks that read tensor values on the host (ranges, data-dependent branches) are skipped
    then: each read would be a graph break under torch.compile and a guard under export. The
    traced graph's callers own those checks; the same call run eagerly still makes them.
    """
    return torch.compiler.is_compiling() or torch.compiler.is_exporting() or in_onnx_export()


def in_onnx_export() -> bool:
    """``torch.onnx.is_in_onnx_export()``, without importing ``torch.onnx`` (a tenth of a second,
    which the first attention call of a process would pay): an export runs only once that
    module is imported."""
    onnx = sys.modules.get("torch.onnx")
    return onnx is not None and onnx.is_in_onnx_export()


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _shape(t: Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int. Received: {name}={value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be a positive int. Received: {name}={value}")
    return value


def check_indices(
    name: str, value: object, count: int, *, kind: str, every: str, size: str
) -> list[int]:
    """``value`` as a non-empty list of distinct ints in [0, ``count``), or a ValueError that
    says so: ``kind`` names what they index ("query-head"), ``every`` what None chooses
    ("head"), ``size`` how many there are ("H=8")."""
    ok = (
        isinstance(value, (list, tuple))
        and len(value) > 0
        and all(isinstance(x, int) and not isinstance(x, bool) for x in value)
    )
    if not ok:
        raise ValueError(
            f"{name} must be a non-empty list of {kind} indices (ints), or None for every "
            f"{every}. Received: {name}={value!r}"
        )
    chosen = list(cast("list[int] | tuple[int, ...]", value))
    bad = [x for x in chosen if not 0 <= x < count]
    if bad:
        raise ValueError(
            f"{name} must be {kind} indices in [0, {count}) ({size}). "
            f"Received: {name}={chosen!r}, out of range: {bad}"
        )
    if len(set(chosen)) != len(chosen):
        raise ValueError(f"{name} must not repeat an index. Received: {name}={chosen!r}")
    return chosen


def check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False. Received: {name}={value!r}")
    return value


def check_heads(embed_dim: int, num_heads: int, num_kv_heads: int | None) -> int:
    """Validate a head layout and return the number of key/value heads."""
    check_positive_int("embed_dim", embed_dim)
    check_positive_int("num_heads", num_heads)
    if embed_dim % num_heads:
        raise ValueError(
            f"embed_dim must be divisible by num_heads so every head gets the same head dim; "
            f"head counts that divide {embed_dim}: "
            f"{', '.join(map(str, _divisors(embed_dim)))}. "
            f"Received: embed_dim={embed_dim}, num_heads={num_heads}"
        )
    if num_kv_heads is None:
        return num_heads
    check_positive_int("num_kv_heads", num_kv_heads)
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads must be a multiple of num_kv_heads (each key/value head serves an equal "
            f"group of query heads); try num_kv_heads in "
            f"{', '.join(map(str, _divisors(num_heads)))}. "
            f"Received: num_heads={num_heads}, num_kv_heads={num_kv_heads}"
        )
    return num_kv_heads


def check_rank(name: str, t: object, rank: int, letters: str) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(
            f"{name} must be a torch.Tensor. Received: {name} of type {type(t).__name__}"
        )
    if t.dim() != rank:
        raise ValueError(
            f"{name} must be a {rank}-D tensor {letters}. Received: {name}.shape={_shape(t)}"
        )
    return t


def check_qkv(query: Tensor, key: Tensor, value: Tensor) -> tuple[int, int, int, int, int, int]:
    """Check kernel inputs (B, H, L, D), (B, H_kv, S, D), (B, H_kv, S, D_v).

    Returns (B, H, H_kv, L, S, D).
    """
    check_rank("query", query, 4, "(B, H, L, D)")
    check_rank("key", key, 4, "(B, H_kv, S, D)")
    check_rank("value", value, 4, "(B, H_kv, S, D_v)")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not t.is_floating_point():
            raise TypeError(
                f"{name} must be a floating-point tensor; cast it with .float(). "
                f"Received: {name}.dtype={t.dtype}"
            )
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(
            "query, key and value must share one dtype; cast them with .to(dtype). "
            f"Received: query.dtype={query.dtype}, key.dtype={key.dtype}, value.dtype={value.dtype}"
        )
    if not (query.device == key.device == value.device):
        raise ValueError(
            "query, key and value must be on one device; move them with .to(device). "
            f"Received: query.device={query.device}, key.device={key.device}, "
            f"value.device={value.device}"
        )
    b, h, l_q, d = query.shape
    bk, h_kv, s, dk = key.shape
    bv, h_v, s_v, _ = value.shape
    if not (b == bk == bv):
        raise ValueError(
            "query, key and value must have the same batch size B. "
            f"Received: query.shape={_shape(query)}, key.shape={_shape(key)}, "
            f"value.shape={_shape(value)}"
        )
    if dk != d:
        raise ValueError(
            "query and key must have the same head dim D (the last dimension). "
            f"Received: query.shape={_shape(query)}, key.shape={_shape(key)}"
        )
    if h_v != h_kv or s_v != s:
        raise ValueError(
            "key and value must have the same number of heads H_kv and the same length S. "
            f"Received: key.shape={_shape(key)}, value.shape={_shape(value)}"
        )
    if h_kv == 0 or h % h_kv:
        raise ValueError(
            "the query head count H must be a multiple of the key/value head count H_kv "
            "(grouped-query attention); try H_kv in "
            f"{', '.join(map(str, _divisors(h))) if h else '(none: H is 0)'}. "
            f"Received: query heads H={h}, key/value heads H_kv={h_kv}"
        )
    return b, h, h_kv, l_q, s, d


def check_dropout(dropout_p: object, name: str = "dropout_p") -> float:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"{name} must be a float in [0, 1). Received: {name}={dropout_p!r}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(
            f"{name} must be in [0, 1) (1 would drop every weight). Received: {name}={dropout_p}"
        )
    return float(dropout_p)


def check_scale(scale: object, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim) if head_dim else 1.0
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None. Received: scale={scale!r}")
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite float. Received: scale={scale}")
    return float(scale)


def _fits(shape: tuple[int, ...], target: tuple[int, ...], *, allow_one: bool) -> bool:
    return len(shape) == len(target) and all(
        got == want or (allow_one and got == 1) for got, want in zip(shape, target)
    )


def check_mask_tensor_dtype(name: str, t: Tensor) -> None:
    """Reject integer and float tensors where a boolean mask (True = may attend) is expected."""
    if t.dtype == torch.bool:
        return
    if t.is_floating_point():
        raise TypeError(
            f"{name} must be a bool tensor (True = may attend). A float tensor is an additive "
            "bias: pass it as bias=..., or convert nn.MultiheadAttention-style masks with "
            f"multihead.masks.from_torch(...). Received: {name}.dtype={t.dtype}"
        )
    raise TypeError(
        f"{name} must be a bool tensor (True = may attend). For a 1 = attend integer mask use "
        f"multihead.masks.from_keras(...) or .bool(). Received: {name}.dtype={t.dtype}"
    )


def check_index_tensor(name: str, t: object, ranks: tuple[int, ...], letters: str) -> Tensor:
    if not isinstance(t, Tensor):
        t = torch.as_tensor(t)
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise TypeError(f"{name} must be an integer tensor. Received: {name}.dtype={t.dtype}")
    if t.dim() not in ranks:
        raise ValueError(f"{name} must have shape {letters}. Received: {name}.shape={_shape(t)}")
    return t


def _blocking_ancestor(path: Path) -> Path | None:
    """The first existing ancestor of ``path`` (itself included) that is not a folder."""
    for p in (path, *path.parents):
        if p.exists():
            return None if p.is_dir() else p
    return None


def check_out_dir(name: str, path: str | Path) -> Path:
    """An output folder, checked before any long work starts: an existing folder, or a new one
    in an existing folder, writable either way (tried by creating and removing a file there).
    Nothing is created: a missing parent folder is an error, not made.

    Raises:
        ValueError: an existing file where a folder must be, or a folder that cannot be
            written in.
        FileNotFoundError: the folder that should hold the new one does not exist.
    """
    folder = Path(path)
    blocker = _blocking_ancestor(folder)
    if blocker is not None:
        raise ValueError(
            f"{name} must be a folder, but {blocker} is an existing file; choose another "
            f"folder. Received: {name}={str(path)!r}"
        )
    if folder.is_dir():
        check_writable(name, folder, path)
        return folder
    _check_parent(name, folder, path)
    return folder


def _check_parent(name: str, target: Path, path: str | Path) -> None:
    """``target``'s parent is an existing folder that can be written in."""
    parent = target.parent
    if not parent.is_dir():
        raise FileNotFoundError(
            f"{name}: the folder {parent} does not exist, and folders are not created for you; "
            f"make it first (mkdir -p {parent}) or choose another path. "
            f"Received: {name}={str(path)!r}"
        )
    check_writable(name, parent, path)


def check_writable(name: str, folder: Path, path: str | Path) -> None:
    """A file can be created in ``folder`` (tried: permissions alone do not say it for root,
    read-only file systems or /proc)."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".multihead-probe-", dir=folder)
    except OSError as err:
        raise ValueError(
            f"{name}: cannot write in the folder {folder} ({err.strerror}); choose a writable "
            f"location or fix its permissions. Received: {name}={str(path)!r}"
        ) from None
    os.close(fd)
    os.unlink(probe)


def check_out_file(name: str, path: str | Path, suffix: str) -> Path:
    """An output file path ending in ``suffix``, in an existing folder that can be written in
    (checked before any long work; nothing is created)."""
    target = Path(path)
    if target.is_dir():
        raise ValueError(
            f"{name} must be a file path ending in {suffix}, but it is an existing folder; "
            f"give a file name, e.g. {target / ('embeddings' + suffix)}. "
            f"Received: {name}={str(path)!r}"
        )
    if target.suffix != suffix:
        raise ValueError(
            f"{name} must end in {suffix} (the file written is exactly this path). "
            f"Received: {name}={str(path)!r}"
        )
    blocker = _blocking_ancestor(target.parent)
    if blocker is not None:
        raise ValueError(
            f"{name} must be in a folder, but {blocker} is an existing file; choose another "
            f"path. Received: {name}={str(path)!r}"
        )
    _check_parent(name, target, path)
    return target


def check_utf8_text(name: str, text: str) -> str:
    """Reject text that is not valid Unicode (command-line bytes that are not UTF-8)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(
            f"{name} is not valid UTF-8 text (byte {err.start} cannot be decoded); re-encode it "
            f"as UTF-8, e.g. with iconv. Received: {name}={text!r}"
        ) from None
    return text


def read_utf8_lines(path: Path) -> list[str]:
    """The lines of a UTF-8 text file, with an error naming the file and the bad byte."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8").splitlines()
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise ValueError(
            f"{path} is not UTF-8 text: byte {err.start} (line {line}) is "
            f"{data[err.start : err.start + 1]!r}; convert the file to UTF-8 (e.g. "
            f"iconv -f latin1 -t utf-8). Received: {path}"
        ) from None


# keywords of torch.nn.MultiheadAttention and scaled_dot_product_attention -> what to do here
_FOREIGN_KEYWORDS = {
    "attn_mask": "an nn.MultiheadAttention mask (True = blocked) goes in as "
    "mask=masks.from_torch(attn_mask=...); a scaled_dot_product_attention bool mask (True = "
    "may attend, as here) as mask=..., a float one as bias=...",
    "key_padding_mask": "pass mask=masks.from_torch(key_padding_mask=...) or "
    "mask=masks.key_padding(keep) with keep True for real tokens",
    "need_weights": "call multihead.attention_with_weights(...) or module.run(...) for an "
    "AttentionOutput(output, weights) (weights are per head, never averaged)",
    "average_attn_weights": "weights are always per head (B, H, L, S); average with .mean(1)",
    "is_causal": "pass mask=masks.causal(align='top_left') (torch's is_causal is top-left "
    "aligned; masks.causal() is bottom-right aligned, as in FlashAttention)",
    "enable_gqa": "nothing to pass: grouped-query attention follows from key.shape[1] (H_kv)",
    "batch_first": "modules here are always batch-first: (B, L, E) in and out; transpose "
    "(L, B, E) inputs with .transpose(0, 1)",
    "add_bias_kv": "append the extra key/value to the key and value inputs",
    "add_zero_attn": "append a zero key/value to the key and value inputs",
}


def torch_keywords(where: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorate a public function a torch user calls: a keyword it does not take, but
    ``torch.nn.MultiheadAttention`` or ``scaled_dot_product_attention`` does, is refused with a
    TypeError naming this library's equivalent. Any other unknown keyword keeps Python's own
    message, and the signature stays the function's own (for readers and type checkers)."""

    def decorate(fn: Callable[P, R]) -> Callable[P, R]:
        taken = frozenset(inspect.signature(fn).parameters)

        @functools.wraps(fn)
        def checked(*args: P.args, **kwargs: P.kwargs) -> R:
            try:
                return fn(*args, **kwargs)
            except TypeError:
                # an unknown keyword fails the call before the body runs, so this is the cause
                foreign = [k for k in kwargs if k in _FOREIGN_KEYWORDS and k not in taken]
                if not foreign:
                    raise
                raise _foreign_keyword(where, foreign[0], kwargs[foreign[0]]) from None

        return checked

    return decorate


def _foreign_keyword(where: str, name: str, value: object) -> TypeError:
    received = (
        f"{name} of shape {tuple(value.shape)}"
        if isinstance(value, Tensor)
        else f"{name}={value!r}"
    )
    return TypeError(
        f"{where} does not take torch's {name!r}: {_FOREIGN_KEYWORDS[name]}. Received: {received}"
    )
