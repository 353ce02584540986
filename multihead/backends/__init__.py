"""Attention kernels, one file per backend, all called with one ``Call`` record.

``register(name, backend)`` adds a backend from outside: ``attention(..., backend=name)`` then
runs it and ``auto`` ranks it by its own rule (see ``Backend`` for the protocol).
"""

from .call import Call
from .protocol import Backend, BackendUnavailable, Capabilities, Rank
from .registry import BACKENDS, register, unregister

__all__ = [
    "BACKENDS",
    "Backend",
    "BackendUnavailable",
    "Call",
    "Capabilities",
    "Rank",
    "register",
    "unregister",
]
