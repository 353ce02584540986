"""Model families built from multihead's own modules, opened by ``load(folder)``.

Each family is one ``Family`` record registered once (``register``): the built-in ones (BERT,
GPT-2, Llama) at the end of their own files, which ``load`` imports when a folder names them.
Importing this package imports no family.
"""

from .families import Family, all_families, family, load, register, supported

__all__ = ["Family", "all_families", "family", "load", "register", "supported"]
