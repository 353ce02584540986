"""A tiny Llama in a GGUF file, written here with the ``gguf`` package from a transformers
checkpoint (tests/models/decoders.py), as llama.cpp's ``convert_hf_to_gguf.py`` writes one:
float32 tensors under llama.cpp's names, the query and key rows permuted into its rotary
layout (transformers permutes them back as it reads the file), the byte-level BPE vocabulary
and merges of the folder's ``tokenizer.json``. Loading the file must give the folder's model.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# transformers' Llama names (after "model.layers.N.") -> llama.cpp's (after "blk.N.")
_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_MODEL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_CONTROL, _NORMAL = 3, 1  # llama.cpp's token types


def _rotary_layout(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's permutation of a query or key projection: each head's rows from halves
    (transformers' rotate_half) to interleaved pairs."""
    rows = weight.shape[0] // heads // 2
    return weight.reshape(heads, 2, rows, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_gguf(folder: Path, path: Path) -> Path:
    """Write the Llama checkpoint in ``folder`` (config, weights, tokenizer.json) to ``path``."""
    import gguf
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    config = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    tokenizer = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    tokens = sorted(tokenizer["model"]["vocab"], key=tokenizer["model"]["vocab"].get)
    special = {t["content"] for t in tokenizer["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([_CONTROL if t in special else _NORMAL for t in tokens])
    merges = tokenizer["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_add_bos_token(True)  # the folder's tokenizer prepends <s>
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    for name, tensor in model.state_dict().items():
        weight = tensor.detach().numpy()
        if name in _MODEL_NAMES:
            writer.add_tensor(_MODEL_NAMES[name], weight)
            continue
        layer, part = name.split(".")[2], ".".join(name.split(".")[3:-1])
        short = _LAYER_NAMES[part]
        if short in heads:
            weight = np.ascontiguousarray(_rotary_layout(weight, heads[short]))
        writer.add_tensor(f"blk.{layer}.{short}.weight", weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
