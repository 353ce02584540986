"""Tiny random-weight GPT-2 and Llama checkpoints written by transformers itself.

No pretrained decoder is available offline, so the tests build models with transformers'
``GPT2LMHeadModel`` / ``LlamaForCausalLM`` (Llama with grouped-query attention and RoPE),
``save_pretrained`` them, and add a small byte-level BPE ``tokenizer.json`` trained here.
Weights are drawn with std 0.2 (transformers' default 0.02 gives near-uniform logits whose
near-ties would make greedy comparisons depend on rounding); the models stay tiny so every
test runs in seconds.
"""

from __future__ import annotations

from pathlib import Path

import torch

from multihead.bench.texts import sentences

VOCAB = 300  # 256 byte symbols, the special tokens, and a few dozen merges
EOS = 0


def write_tokenizer(folder: Path, *, bos: bool) -> None:
    """A byte-level BPE tokenizer (GPT-2's scheme); with ``bos`` it prepends <s> (Llama)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<|endoftext|>", "<s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(sentences(300, max_words=30, seed=1), trainer)
    if bos:
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", 1)]
        )
    tokenizer.save(str(folder / "tokenizer.json"))


def build(kind: str, folder: Path, *, layers: int = 2, seed: int = 0, **extra) -> Path:
    """Write a random ``kind`` ("gpt2" or "llama") checkpoint with a tokenizer to ``folder``."""
    import transformers

    torch.manual_seed(seed)
    if kind == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=VOCAB,
            n_positions=128,
            n_embd=32,
            n_layer=layers,
            n_head=4,
            initializer_range=0.2,
            bos_token_id=EOS,
            eos_token_id=EOS,
            **extra,
        )
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,  # grouped-query attention: 2 query heads per kv head
            max_position_embeddings=256,
            initializer_range=0.2,
            rope_theta=500.0,  # a short wavelength, so tiny tests exercise large angles
            bos_token_id=1,
            eos_token_id=EOS,
            **extra,
        )
        model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(folder)
    write_tokenizer(folder, bos=kind == "llama")
    return folder


def transformers_model(folder: Path):
    """The same folder loaded by transformers with its plain (eager) attention."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
    return model.eval()


def pad(rows: list[list[int]], side: str, value: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ids padded to one length on ``side`` with ``value`` (any id: padding must not
    matter), and their lengths."""
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), value, dtype=torch.long)
    for i, row in enumerate(rows):
        if side == "right":
            ids[i, : len(row)] = torch.tensor(row)
        else:
            ids[i, width - len(row) :] = torch.tensor(row)
    return ids, torch.tensor([len(r) for r in rows])
