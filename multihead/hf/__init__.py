"""Every transformers model on multihead's attention: ``attn_implementation="multihead"``.

Importing this module registers the name ``"multihead"`` with transformers' two interfaces, the
attention function (``AttentionInterface``) and the mask function (``AttentionMaskInterface``;
without one transformers hands an unknown implementation no mask at all). After that::

    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="multihead")
    model = AutoModel.from_config(config, attn_implementation="multihead")
    model.set_attn_implementation("multihead")

run every attention call of the model through ``multihead.attention`` (or
``attention_with_weights`` when the weights are wanted): masks as masks whose tiles are known
(a sliding window skips what it hides), soft-capping and attention sinks inside the kernel,
grouped-query attention without repeated keys, ``output_attentions=True`` on the fast path.
``capture(model, layers=, heads=)`` records the weights of chosen heads only, or statistics
of them (``stats=``); ``ablate``, ``knockout`` and ``patch`` act on chosen heads inside the
kernel call (see the guide "Acting on attention"). They are ``multihead.acting``'s, which act
on the library's own models as well; importing this module lets them find a transformers
model's layers. ``fast_decoding(model)`` makes its ``generate()`` faster on the CPU: a
``LlamaForCausalLM``'s steps run in one C++ call each, any other model's float32 linear layers
on multihead's few-row kernel (a decoding step is mostly those products; see
``multihead.hf.decoding``). ``load_with_tokenizer(source)``
gives the pair ``(model, tokenizer)``, transformers' both, on this attention from a folder, a
GGUF file or the names ``"smollm2"``, ``"gemma3"`` (real small models installed offline; see
``multihead.hf.loading``); ``load`` is its deprecated name.

Needs the ``hf`` extra (transformers); ``import multihead`` never imports transformers.
"""

from __future__ import annotations

from .. import _extras

_extras.require("transformers", "hf", "multihead.hf")

from .._deprecation import MultiheadDeprecationWarning  # noqa: E402
from . import attribution as _attribution  # noqa: E402, F401  registers these models' Subject
from .attention import attention_forward  # noqa: E402  after the check for the extra
from .compress import compress, compress_context  # noqa: E402
from .decoding import (  # noqa: E402
    decoding_linears,
    decoding_path,
    decoding_step,
    fast_decoding,
)
from .loading import Loaded, load, load_with_tokenizer  # noqa: E402
from .mask_functions import make_mask  # noqa: E402
from .reader import attention_layers  # noqa: E402  registers the reader of these models
from .registration import NAME, register  # noqa: E402

# isort: split
from ..acting import Capture, Compression, ablate, capture, knockout, patch  # noqa: E402

__all__ = [
    "NAME",
    "Capture",
    "Compression",
    "Loaded",
    "MultiheadDeprecationWarning",
    "ablate",
    "attention_forward",
    "attention_layers",
    "capture",
    "compress",
    "compress_context",
    "decoding_linears",
    "decoding_path",
    "decoding_step",
    "fast_decoding",
    "knockout",
    "load",
    "load_with_tokenizer",
    "make_mask",
    "patch",
    "register",
]

register()
