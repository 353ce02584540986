"""Classes declare themselves saveable where they are defined: ``@saveable("multihead.Name")``
above the class records every instance's constructor arguments, so ``multihead.save`` can write
them as data. This module imports nothing from the package; ``multihead.io`` reads
``DECLARED`` when it needs a class, so no file patches another file's classes."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

__all__ = ["DECLARED", "INIT_ARGS", "record_init", "saveable"]

INIT_ARGS = "_multihead_init_args"  # instance attribute holding the recorded arguments

# name written to config.json -> class; filled as the declaring modules are imported
DECLARED: dict[str, type] = {}


def record_init(cls: type) -> None:
    """Wrap ``cls.__init__`` so every instance keeps the arguments it was built with."""
    init = cls.__init__  # type: ignore[misc]  # the class's own, read before it is wrapped
    if getattr(init, "_multihead_records", False):
        return
    signature = inspect.signature(init)
    extra = None  # a **kwargs parameter: its entries are recorded as keyword arguments
    for p in signature.parameters.values():
        if p.kind == p.VAR_POSITIONAL:
            raise TypeError(
                f"register needs a constructor without *args to record its arguments by name; "
                f"pass describe= and build= instead. Received: {cls.__name__}{signature}"
            )
        if p.kind == p.VAR_KEYWORD:
            extra = p.name

    @functools.wraps(init)
    def wrapped(self, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if type(self) is cls:  # a subclass records its own arguments, or none
            bound = signature.bind(self, *args, **kwargs)
            bound.apply_defaults()
            values = dict(bound.arguments)
            values.pop(next(iter(signature.parameters)))  # self
            if extra is not None:
                values.update(values.pop(extra, {}))
            object.__setattr__(self, INIT_ARGS, values)

    wrapped._multihead_records = True  # type: ignore[attr-defined]
    cls.__init__ = wrapped  # type: ignore[misc]


def saveable(name: str) -> Callable[[type], type]:
    """Class decorator: instances record their constructor arguments and ``multihead.save``
    writes the class under ``name`` (rebuilt by ``load`` as ``cls(**args)``)."""

    def apply(cls: type) -> type:
        record_init(cls)
        DECLARED[name] = cls
        return cls

    return apply
