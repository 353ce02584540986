"""Model families built from multihead's own modules, opened by ``load(folder)``.

Importing this package imports no family: ``load`` imports the one a folder's config.json
names, and ``register`` adds one from outside.
"""

from .families import load, register, supported

__all__ = ["load", "register", "supported"]
