"""``multihead walkthrough``: multi-head attention on a 3-token sentence, one stage at a time.

Every stage is printed with its shape, and the hand-computed result is checked against
``MultiHeadAttention`` at the end.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from ..modules import MultiHeadAttention, merge_heads, split_heads

__all__ = ["run"]

TOKENS = ("cat", "catches", "mouse")
EMBED_DIM, NUM_HEADS, SEED = 4, 2, 0


def _fmt(t: Tensor) -> str:
    rows = t.reshape(-1, t.shape[-1]).tolist()
    return "\n".join("    [" + "  ".join(f"{x:7.3f}" for x in row) + "]" for row in rows)


def _show(say: Callable[[str], None], title: str, t: Tensor, letters: str) -> None:
    say(f"\n{title}  shape {tuple(t.shape)} {letters}")
    if t.dim() == 4:
        for h in range(t.shape[1]):
            say(f"  head {h}:")
            say(_fmt(t[0, h]))
    else:
        say(_fmt(t[0]))


def run(say: Callable[[str], None] = print) -> float:
    """Print the walk-through; return the max abs difference from the module (raises if large)."""
    torch.manual_seed(SEED)
    mha = MultiHeadAttention(EMBED_DIM, NUM_HEADS).eval()
    x = torch.randn(1, len(TOKENS), EMBED_DIM)  # [B, L, E]
    d = EMBED_DIM // NUM_HEADS

    say("Multi-head attention, step by step")
    say(f"sentence: {' '.join(TOKENS)!r}   E (d_model) = {EMBED_DIM}   H = {NUM_HEADS}   D = {d}")
    _show(say, "1. token embeddings x", x, "(B, L, E)")

    say("\n2. how heads are made: view the last dim as (H, D), then swap L and H")
    toy = torch.arange(1.0, 13.0).reshape(1, 3, 4)
    say(f"  toy tensor 1..12, shape {tuple(toy.shape)} (B, L, E):")
    say(_fmt(toy[0]))
    viewed = toy.view(1, 3, NUM_HEADS, d)
    say(f"  .view(1, 3, {NUM_HEADS}, {d}) -> shape {tuple(viewed.shape)} (B, L, H, D)")
    moved = viewed.transpose(1, 2)
    say(f"  .transpose(1, 2) -> shape {tuple(moved.shape)} (B, H, L, D): heads before positions")
    for h in range(NUM_HEADS):
        say(f"  head {h} sees columns {h * d + 1}..{h * d + d} of every position:")
        say(_fmt(moved[0, h]))
    assert torch.equal(moved, split_heads(toy, NUM_HEADS))

    with torch.no_grad():
        q, k, v = mha.q_proj(x), mha.k_proj(x), mha.v_proj(x)
        _show(say, "3. projections Q = x Wq^T + bq", q, "(B, L, E)")
        _show(say, "   K = x Wk^T + bk", k, "(B, L, E)")
        _show(say, "   V = x Wv^T + bv", v, "(B, L, E)")

        qh, kh, vh = (split_heads(t, NUM_HEADS) for t in (q, k, v))
        _show(say, "4. Q split into heads", qh, "(B, H, L, D)")

        scores = qh @ kh.transpose(-2, -1) / math.sqrt(d)
        _show(
            say,
            f"5. scores Q K^T / sqrt(D) = / {math.sqrt(d):.3f}, rows = queries",
            scores,
            "(B, H, L, S)",
        )
        weights = torch.softmax(scores, dim=-1)
        _show(say, "6. weights = softmax over keys (each row sums to 1)", weights, "(B, H, L, S)")
        for h in range(NUM_HEADS):
            row = weights[0, h, 0]
            best = int(row.argmax())
            say(f"   head {h}: '{TOKENS[0]}' attends most to '{TOKENS[best]}' ({row[best]:.0%})")

        per_head = weights @ vh
        _show(say, "7. per-head output = weights V", per_head, "(B, H, L, D)")
        concat = merge_heads(per_head)
        _show(say, "8. concatenate heads (transpose back, reshape)", concat, "(B, L, E)")
        out = mha.out_proj(concat)
        _show(say, "9. output projection concat Wo^T + bo", out, "(B, L, E)")

        module_out = mha(x)
    diff = float((out - module_out).abs().max())
    say(f"\ncheck: step-by-step vs MultiHeadAttention(x): max abs difference {diff:.2e}")
    if diff > 1e-6:
        raise RuntimeError(f"step-by-step result differs from the module by {diff:.2e}")
    say("the hand computation and the module agree.")
    return diff
