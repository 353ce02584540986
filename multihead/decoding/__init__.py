"""A decoding step, one new token per sequence, in one place. From the bottom up:

- ``routes``: a step's attention calls on a short path (one query row over a KV cache; what
  the call needs worked out on the step's first layer and kept for the others). Both the
  library's own attention and transformers' ``attn_implementation="multihead"`` take it.
- ``python_step``: the library's own decoders' step without the module calls, the same
  operations in the same order (so the same bits), still one Python call per operation.
- ``native_step``: the same step in one C++ call (``kernels/csrc/native_step.h``, built into
  the few-row kernel's module) over the layers' gathered tensors; where it applies it goes
  first, ``python_step`` second, the modules' path last.
- ``hf``: the transformers adapter, ``multihead.hf.fast_decoding(model)``: the native step for
  a ``LlamaForCausalLM``, the few-row linears for every other model.

``MULTIHEAD_STEP_PATH=0`` turns ``python_step`` off, ``MULTIHEAD_NATIVE_STEP=0`` ``native_step``.
Importing this package imports none of them.
"""
