"""Config dataclasses checked against their own annotations: ``parse_config`` builds one from a
parsed JSON object, so the dataclass is the one list of fields and of what each may hold
(``Size``: an int > 0). The model families' configs and ``multihead.io`` use it."""

from __future__ import annotations

import collections.abc
import math
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, fields
from typing import Any, TypeVar

__all__ = ["POSITIVE", "Size", "describe_annotation", "fits_annotation", "parse_config"]

C = TypeVar("C")


class _Positive:
    """Annotation marker: the number must be > 0 (a size or a count)."""

    def __repr__(self) -> str:
        return "positive"


POSITIVE = _Positive()
Size = typing.Annotated[int, POSITIVE]  # a config field that counts or sizes something: an int > 0

_SEQUENCES = (list, tuple, collections.abc.Sequence, collections.abc.Iterable)
_MAPPINGS = (dict, collections.abc.Mapping)


def fits_annotation(value: Any, tp: Any, *, non_negative: bool = False) -> bool:
    """Whether a value read from a config fits a type annotation (``int``, ``float``, ``bool``,
    ``str``, ``X | None``, ``Literal``, lists, sequences, tuples, dicts, classes). A bool is
    not an int and an int is a float; ``non_negative``: numbers must also be >= 0 (floats
    finite). Annotations that say nothing checkable (``Any``, callables) accept anything."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(
            fits_annotation(value, arm, non_negative=non_negative) for arm in typing.get_args(tp)
        )
    if origin is typing.Annotated:
        base, *marks = typing.get_args(tp)
        fits = fits_annotation(value, base, non_negative=non_negative)
        return fits and (POSITIVE not in marks or value > 0)
    if origin is typing.Literal:
        return any(value == v and type(value) is type(v) for v in typing.get_args(tp))
    scalar = _fits_scalar(value, tp, non_negative)
    if scalar is not None:
        return scalar
    if origin in _SEQUENCES or tp in _SEQUENCES:
        return _fits_sequence(value, tp, non_negative)
    return _fits_mapping_or_class(value, tp, origin)


def _fits_mapping_or_class(value: Any, tp: Any, origin: Any) -> bool:
    if origin in _MAPPINGS or tp in _MAPPINGS:
        return isinstance(value, dict)
    if isinstance(tp, type) and tp is not object:
        return isinstance(value, tp)
    return True  # Any, callables, type variables: nothing a config value can be checked against


def _fits_scalar(value: Any, tp: Any, non_negative: bool) -> bool | None:
    """``fits_annotation`` for None, bool, int, float and str; None for any other annotation."""
    if tp is type(None) or tp is None:
        return value is None
    if tp is bool or tp is str:
        return isinstance(value, tp)
    if tp is int:
        return (
            isinstance(value, int)
            and not isinstance(value, bool)
            and (value >= 0 or not non_negative)
        )
    if tp is float:
        return (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and (not non_negative or (math.isfinite(value) and value >= 0))
        )
    return None


def _fits_sequence(value: Any, tp: Any, non_negative: bool) -> bool:
    """``fits_annotation`` for lists, sequences and tuples (fixed length or ``...``)."""
    if not isinstance(value, (list, tuple)):
        return False
    arms = typing.get_args(tp)
    if typing.get_origin(tp) is tuple and arms and arms[-1] is not Ellipsis:
        return len(arms) == len(value) and all(
            fits_annotation(v, arm, non_negative=non_negative) for v, arm in zip(value, arms)
        )
    return not arms or all(fits_annotation(v, arms[0], non_negative=non_negative) for v in value)


def describe_annotation(tp: Any, *, non_negative: bool = False) -> str:
    """An annotation in words, for messages ("true or false", "a non-negative int or null")."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(
            describe_annotation(arm, non_negative=non_negative) for arm in typing.get_args(tp)
        )
    if origin is typing.Annotated:
        base, *marks = typing.get_args(tp)
        if POSITIVE in marks and base is int:
            return "a positive int"
        return describe_annotation(base, non_negative=non_negative)
    if origin is typing.Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(tp)))
    if origin in _SEQUENCES or tp in _SEQUENCES:
        arms = [a for a in typing.get_args(tp) if a is not Ellipsis]
        inner = " or ".join(describe_annotation(a, non_negative=non_negative) for a in arms)
        return f"a list of ({inner})" if inner else "a list"
    return _describe_plain(tp, origin, non_negative)


def _describe_plain(tp: Any, origin: Any, non_negative: bool) -> str:
    """``describe_annotation`` for an annotation without arms: a scalar, a mapping, a class."""
    names = {
        type(None): "null",
        bool: "true or false",
        int: "a non-negative int" if non_negative else "an int",
        float: "a number >= 0" if non_negative else "a number",
        str: "a string",
        dict: "an object",
    }
    if tp in names:
        return names[tp]
    if origin in _MAPPINGS or tp in _MAPPINGS:
        return "an object"
    if isinstance(tp, type):
        return f"a {tp.__name__}"
    return str(tp)


def parse_config(
    cls: type[C],
    raw: Mapping[str, Any],
    *,
    source: str = "config.json",
    fixed: Mapping[str, Iterable[Any]] | tuple[()] = (),
    choices: Mapping[str, Iterable[Any]] | tuple[()] = (),
) -> C:
    """Build the config dataclass ``cls`` from a parsed config.json, checking every field
    against its annotation (int: >= 0, ``Size``: > 0, float: finite and >= 0, ``X | None``,
    ``list[int]``): the dataclass is the one list of fields and what each may hold.

    Args:
        fixed: fields that change the math, with the only values implemented; other values
            are refused (absent fields are fine).
        choices: fields whose value must be one of a set (e.g. activation names).

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
    hints = typing.get_type_hints(cls, include_extras=True)
    allowed_values = {k: list(v) for k, v in dict(choices).items()}
    values: dict[str, Any] = {}
    for spec in fields(cls):  # type: ignore[arg-type]  # cls is a dataclass, as documented
        field = spec.name
        if field not in raw:
            if spec.default is MISSING and spec.default_factory is MISSING:
                raise ValueError(f"{source}: the required field {field} is missing")
            continue
        value = raw[field]
        if field in allowed_values:
            if value not in allowed_values[field]:
                raise fail(field, f"one of {allowed_values[field]}")
        elif not fits_annotation(value, hints[field], non_negative=True):
            raise fail(field, describe_annotation(hints[field], non_negative=True))
        values[field] = value
    return cls(**values)
