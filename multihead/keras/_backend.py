"""Import Keras 3 on its torch backend, or explain why that is not possible.

Keras picks its backend once, at its first import, from ``KERAS_BACKEND`` (else
``~/.keras/keras.json``, else TensorFlow). ``multihead.keras`` runs on torch tensors, so it
sets ``KERAS_BACKEND=torch`` when nothing chose a backend yet, and refuses to run on another one.
"""

from __future__ import annotations

import os
import sys
from types import ModuleType

__all__ = ["import_keras"]

_FIX = (
    "multihead.keras runs on Keras' torch backend: set the environment variable "
    "KERAS_BACKEND=torch before the first `import keras` (in the shell, or with "
    "os.environ['KERAS_BACKEND'] = 'torch' at the top of the program)."
)


def import_keras() -> ModuleType:
    """Return the ``keras`` module, imported on the torch backend.

    Raises:
        ImportError: keras is not installed (the ``keras`` extra), Keras 2 is installed, or
            keras was (or would be) imported with a backend other than torch.
    """
    if "keras" not in sys.modules:
        chosen = os.environ.get("KERAS_BACKEND")
        if chosen is not None and chosen != "torch":
            raise ImportError(f"{_FIX} Received: KERAS_BACKEND={chosen!r}")
        # nothing chose yet: Keras would fall back to keras.json or TensorFlow
        os.environ["KERAS_BACKEND"] = "torch"
    try:
        import keras
    except ImportError as err:
        raise ImportError(
            "multihead.keras needs Keras 3: pip install 'multihead[keras]'. "
            f"Received: ImportError({err})"
        ) from err
    version = getattr(keras, "__version__", "0")
    if int(version.split(".")[0]) < 3:
        raise ImportError(
            "multihead.keras needs Keras 3 (Keras 2 has no torch backend): "
            f"pip install 'multihead[keras]'. Received: keras.__version__={version!r}"
        )
    backend = keras.backend.backend()
    if backend != "torch":
        raise ImportError(
            f"{_FIX} keras was already imported with another backend. "
            f"Received: keras.backend.backend()={backend!r}"
        )
    return keras
