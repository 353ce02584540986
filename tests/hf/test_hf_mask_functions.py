"""``make_mask``: transformers' mask functions as multihead masks, against transformers' own
lowering (``sdpa_mask``: the dense bool tensor its sdpa path receives) entry by entry, and
read as the built-in kinds wherever one says the same thing."""

from __future__ import annotations

import pytest
import torch
from transformers import masking_utils as mu

from multihead.hf import make_mask

B = 2


def _padding(length: int, left: int = 0, right: int = 0) -> torch.Tensor:
    keep = torch.ones(B, length, dtype=torch.bool)
    keep[1, :left] = False
    keep[1, length - right :] = False
    return keep


def _case(name: str) -> tuple[dict, str]:
    """(the keywords transformers passes to a mask interface, a word the result's
    description must hold: the kind it was read as)."""
    causal, sliding = mu.causal_mask_function, mu.sliding_window_causal_mask_function
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 4, 5, 0, 1, 2]])
    packed = mu.find_packed_sequence_indices(positions)
    cases = {
        # prefill and decoding with a DynamicCache (the queries are the last positions)
        "causal": (dict(q_length=9, kv_length=9), "causal"),
        "causal+left padding": (
            dict(q_length=9, kv_length=9, attention_mask=_padding(9, 3)),
            "key_padding",
        ),
        # the query of a decoding step over its whole cache sees every key the causal band
        # allows: only the padding is left
        "causal decode": (
            dict(q_length=1, kv_length=9, q_offset=8, attention_mask=_padding(9, 2)),
            "key_padding",
        ),
        "causal chunked prefill": (dict(q_length=3, kv_length=9, q_offset=6), "causal"),
        # a static cache: keys past the queries are empty slots
        "causal static cache": (dict(q_length=2, kv_length=12, q_offset=4), "causal"),
        "sliding": (dict(q_length=9, kv_length=9, mask_function=sliding(3)), "sliding_window"),
        "sliding decode": (
            dict(q_length=1, kv_length=9, q_offset=8, mask_function=sliding(3)),
            "sliding_window",
        ),
        # a sliding-window cache keeps the last keys only: they start at kv_offset
        "sliding cache": (
            dict(q_length=2, kv_length=5, q_offset=10, kv_offset=7, mask_function=sliding(4)),
            "sliding_window",
        ),
        "sliding static cache": (
            dict(q_length=2, kv_length=12, q_offset=6, mask_function=sliding(3)),
            "crop",
        ),
        "chunked": (
            dict(
                q_length=9,
                kv_length=9,
                mask_function=mu.chunked_causal_mask_function(4, torch.tensor([0, 2])),
                attention_mask=_padding(9, 2),
            ),
            "documents",
        ),
        "packed": (
            dict(
                q_length=9,
                kv_length=9,
                mask_function=mu.packed_sequence_compatibility_function(causal, positions, packed),
            ),
            "documents",
        ),
        "packed sliding": (
            dict(
                q_length=9,
                kv_length=9,
                mask_function=mu.packed_sequence_compatibility_function(
                    sliding(2), positions, packed
                ),
            ),
            "sliding_window",
        ),
        "bidirectional+right padding": (
            dict(
                q_length=9,
                kv_length=9,
                mask_function=mu.bidirectional_mask_function,
                attention_mask=_padding(9, 0, 4),
            ),
            "key_padding",
        ),
        "bidirectional sliding": (
            dict(
                q_length=9,
                kv_length=9,
                mask_function=mu.sliding_window_bidirectional_mask_function(2),
            ),
            "sliding_window",
        ),
        "cross attention": (
            dict(
                q_length=5,
                kv_length=9,
                mask_function=mu.bidirectional_mask_function,
                attention_mask=_padding(9, 0, 3),
            ),
            "key_padding",
        ),
        "a row with nothing visible": (
            dict(
                q_length=4,
                kv_length=4,
                attention_mask=torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]]).bool(),
            ),
            "key_padding",
        ),
        # not a factory transformers ships: evaluated from the function itself
        "custom or": (
            dict(
                q_length=9, kv_length=9, mask_function=mu.or_masks(causal, lambda b, h, q, k: k < 2)
            ),
            "predicate",
        ),
        "custom per batch": (
            dict(
                q_length=6,
                kv_length=6,
                mask_function=mu.and_masks(causal, lambda b, h, q, k: (k + b) % 3 != 0),
            ),
            "predicate",
        ),
        "custom under vmap": (
            dict(
                q_length=6,
                kv_length=6,
                mask_function=mu.and_masks(causal, lambda b, h, q, k: k != 1),
                use_vmap=True,
            ),
            "dense",
        ),
    }
    keywords, kind = cases[name]
    return {"batch_size": B, "mask_function": causal, **keywords}, kind


CASES = [
    "causal",
    "causal+left padding",
    "causal decode",
    "causal chunked prefill",
    "causal static cache",
    "sliding",
    "sliding decode",
    "sliding cache",
    "sliding static cache",
    "chunked",
    "packed",
    "packed sliding",
    "bidirectional+right padding",
    "bidirectional sliding",
    "cross attention",
    "a row with nothing visible",
    "custom or",
    "custom per batch",
    "custom under vmap",
]


@pytest.mark.parametrize("name", CASES)
def test_every_entry_equals_transformers_lowering(name):
    keywords, kind = _case(name)
    want = mu.sdpa_mask(**keywords, allow_is_causal_skip=False)
    mask = make_mask(**keywords, dtype=torch.float32, config=None, allow_is_causal_skip=True)
    got = mask.to_dense(keywords["q_length"], keywords["kv_length"])
    assert torch.equal(got.expand(want.shape), want)
    assert kind in repr(mask).split("\n")[0]
    if kind not in ("predicate", "dense"):  # a structured kind: tiles known without evaluation
        assert not mask.arbitrary and "predicate" not in repr(mask).split("\n")[0]


def test_no_mask_where_every_query_sees_every_key():
    common = dict(
        batch_size=B, q_length=5, kv_length=5, mask_function=mu.bidirectional_mask_function
    )
    assert make_mask(**common) is None
    assert make_mask(**common, attention_mask=torch.ones(B, 5, dtype=torch.bool)) is None
    assert make_mask(**common, attention_mask=_padding(5, 1)) is not None


def test_a_window_skips_the_tiles_it_hides():
    """The point of reading the predicate: a sliding window at L = 4096 is a band whose tiles
    are known, so a block-skipping backend visits about L x window entries, not L x L."""
    mask = make_mask(
        batch_size=1,
        q_length=4096,
        kv_length=4096,
        mask_function=mu.sliding_window_causal_mask_function(256),
    )
    assert mask.visible_distances(4096, 4096) == (-255, 0)
    tile = mask.tile(4096, 4096, 2048, 2176)
    assert (tile.start, tile.stop) == (2048 - 255, 2176)
