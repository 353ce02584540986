"""generate (ids), generate_text (text) and stream_text (text piece by piece) against
transformers: its ``generate`` for the tokens and its tokenizer's ``decode`` for the text.

The checkpoints are ``decoders.build``'s tiny random GPT-2 and Llama with a byte-level BPE
tokenizer; a random model emits stray bytes >= 0x80, so its text is full of incomplete UTF-8,
which is what incremental decoding must get right. A scripted output layer (the next token of
a fixed text at every step) checks characters split across byte tokens exactly.
"""

from __future__ import annotations

import pytest
import torch
from decoders import EOS, build, transformers_model
from torch import Tensor, nn

from multihead.models import gpt2, llama

LOADERS = {"gpt2": gpt2, "llama": llama}
PROMPTS = ["The cat crossed the street", "A dog", "héllo wörld 日本"]


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def models(request, tmp_path_factory):
    """(our model, transformers' model, transformers' tokenizer) from one folder."""
    import transformers

    folder = build(request.param, tmp_path_factory.mktemp(request.param))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    return LOADERS[request.param].load(folder), transformers_model(folder), tokenizer


def _theirs(hf, tokenizer, prompt: str, new: int) -> tuple[list[int], str]:
    """transformers' greedy continuation of ``prompt``: its new ids (through the first EOS)
    and their text."""
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            do_sample=False,
            eos_token_id=EOS,
            pad_token_id=EOS,
        )
    tokens = out[0, ids.shape[1] :].tolist()
    text = tokenizer.decode(tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    return tokens, text


@pytest.mark.parametrize("prompt", PROMPTS)
def test_text_and_stream_equal_transformers(models, prompt):
    ours, hf, tokenizer = models
    want_ids, want_text = _theirs(hf, tokenizer, prompt, 20)
    assert "\ufffd" in want_text  # stray bytes: incomplete UTF-8 is exercised
    # ids in, ids out: the same tokens transformers picks (up to its stop at EOS)
    ids = torch.tensor([tokenizer(prompt).input_ids])
    got_ids = ours.generate(ids, 20, eos_token_id=EOS)
    assert type(got_ids) is Tensor
    assert got_ids[0, ids.shape[1] : ids.shape[1] + len(want_ids)].tolist() == want_ids
    # text in, text out: the prompt then transformers' decoded continuation
    text = ours.generate_text(prompt, 20)
    assert type(text) is str and text == prompt + want_text
    pieces = list(ours.stream_text(prompt, 20))
    assert all(type(p) is str and p for p in pieces)
    assert "".join(pieces) == want_text
    assert len(pieces) > 1  # piece by piece, not one string at the end


def test_a_list_gives_a_list_each_as_alone(models):
    ours, hf, tokenizer = models
    texts = ours.generate_text(PROMPTS, 12)
    assert type(texts) is list and len(texts) == len(PROMPTS)
    for prompt, text in zip(PROMPTS, texts):
        assert text == prompt + _theirs(hf, tokenizer, prompt, 12)[1]
        assert text == ours.generate_text(prompt, 12)
    assert ours.generate_text(tuple(PROMPTS[:1]), 3) == [ours.generate_text(PROMPTS[0], 3)]


def test_sampled_stream_equals_sampled_text(models):
    ours, _, _ = models
    options = {"do_sample": True, "temperature": 1.3, "top_k": 40, "top_p": 0.95}
    text = ours.generate_text(PROMPTS[0], 16, generator=torch.Generator().manual_seed(7), **options)
    stream = ours.stream_text(PROMPTS[0], 16, generator=torch.Generator().manual_seed(7), **options)
    assert PROMPTS[0] + "".join(stream) == text


class Scripted(nn.Module):
    """An output layer that ignores its input and makes token ``script[i]`` the most likely
    one at the i-th call (the model's other parts run as usual)."""

    def __init__(self, script: list[int], vocab: int) -> None:
        super().__init__()
        self.script, self.vocab, self.calls = script, vocab, 0
        self.weight = nn.Parameter(torch.zeros(vocab, 1))  # dtype and device for the cache

    def forward(self, x: Tensor) -> Tensor:
        logits = torch.zeros(*x.shape[:-1], self.vocab)
        logits[..., self.script[min(self.calls, len(self.script) - 1)]] = 1.0
        self.calls += 1
        return logits


TARGET = "naïve café — 日本語 😀 ok"


def test_characters_split_across_tokens_come_out_whole(tmp_path):
    """Every byte of the non-ASCII characters is its own token here; the stream yields a
    character only once its last byte has arrived, and a piece comes out as each token that
    completes text is produced (not all at the end)."""
    import transformers

    model = gpt2.load(build("gpt2", tmp_path, layers=1))
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(tmp_path / "tokenizer.json")
    )
    script = tokenizer(TARGET).input_ids
    assert len(script) > len(TARGET.encode()) // 2  # many characters span several tokens
    assert tokenizer.decode(script, clean_up_tokenization_spaces=False) == TARGET
    model.lm_head = Scripted(script, model.vocab_size)
    stream = model.stream_text("Say:", len(script))
    first = next(stream)
    assert first == "n" and model.lm_head.calls == 1  # yielded as soon as it was produced
    pieces = [first, *stream]
    assert "".join(pieces) == TARGET
    assert not any("\ufffd" in p for p in pieces)
    assert "😀" in pieces or any("😀" in p for p in pieces)
    assert max(len(p) for p in pieces) <= 2  # one character at a time (a merge may hold two)
    model.lm_head.calls = 0
    assert model.generate_text("Say:", len(script)) == "Say:" + TARGET


def test_the_stream_stops_at_the_end_of_sequence(tmp_path):
    model = gpt2.load(build("gpt2", tmp_path, layers=1))
    script = model.tokenizer.encode("ok then").ids
    model.lm_head = Scripted([*script, EOS, *script], model.vocab_size)
    assert "".join(model.stream_text("Say:", 30)) == "ok then"
    assert model.lm_head.calls == len(script) + 1
    model.lm_head.calls = 0
    assert model.generate_text("Say:", 30) == "Say:ok then"
    model.lm_head.calls = 0
    # with no stop token the script's tail follows
    assert "".join(model.stream_text("Say:", 2 * len(script) + 1, eos_token_id=[])) == (
        "ok thenok then"
    )


def test_text_and_ids_go_to_their_own_functions(models):
    ours, _, _ = models
    ids = torch.tensor([[5, 6, 7]])
    for text in ("a text", ["a text", "another"]):
        with pytest.raises(TypeError, match=r"generate takes token ids.*generate_text"):
            ours.generate(text, 2)
    with pytest.raises(TypeError, match=r"generate_text takes text.*generate\(input_ids"):
        ours.generate_text(ids, 2)
    with pytest.raises(TypeError, match=r"stream_text takes one prompt.*generate_text"):
        ours.stream_text(["a", "b"], 2)
    with pytest.raises(TypeError, match=r"non-empty list of strings"):
        ours.generate_text([], 2)
    # checked when called, before the first token is asked for
    with pytest.raises(ValueError, match=r"max_new_tokens must be >= 0"):
        ours.stream_text("a text", -1)
    with pytest.raises(ValueError, match=r"needs \d+ positions but the model has"):
        ours.stream_text("a text", 10**6)
    assert list(ours.stream_text("a text", 0)) == []
    assert ours.generate_text("a text", 0) == "a text"


def test_run_returns_one_record_for_every_flag(models):
    ours, _, _ = models
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 7, 7]])
    lengths = torch.tensor([4, 2])
    logits = ours(ids, lengths=lengths)
    assert type(logits) is Tensor
    layers = len(ours.decoder.layers)
    for side in ("right", "left"):
        full = ours.run(ids, lengths=lengths, padding_side=side, return_hidden=True)
        for weights in (True, False):
            for heads in (None, [3, 0]) if weights else (None,):
                for hidden in (True, False):
                    out = ours.run(
                        ids,
                        lengths=lengths,
                        padding_side=side,
                        weights=weights,
                        heads=heads,
                        return_hidden=hidden,
                    )
                    assert type(out) is type(full)
                    torch.testing.assert_close(out.logits, full.logits)
                    assert (out.hidden_states is None) != hidden
                    assert (out.weights is None) != weights
                    if weights:
                        pick = slice(None) if heads is None else heads
                        assert len(out.weights) == layers
                        for w, w_all in zip(out.weights, full.weights):
                            torch.testing.assert_close(w, w_all[:, pick])
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'return_weights'"):
        ours.run(ids, return_weights=True)


def test_padding_outside_the_vocabulary_is_never_read(models):
    """Padding must not matter, whatever it holds: an id past the vocabulary (a pad id from
    another tokenizer) raised IndexError in the embedding lookup before 0.2.0."""
    ours, _, _ = models
    rows = [[5, 6, 7, 8], [9, 10]]
    for side in ("right", "left"):
        plain, odd = (torch.full((2, 4), fill) for fill in (7, ours.vocab_size + 100))
        for ids in (plain, odd):
            for b, row in enumerate(rows):
                if side == "right":
                    ids[b, : len(row)] = torch.tensor(row)
                else:
                    ids[b, 4 - len(row) :] = torch.tensor(row)
        lengths = torch.tensor([4, 2])
        kw = {"lengths": lengths, "padding_side": side}
        real = torch.tensor([[True] * 4, [True, True, False, False]])
        if side == "left":
            real = real.flip(1)
        torch.testing.assert_close(ours(odd, **kw)[real], ours(plain, **kw)[real])
        want = ours.generate(plain, 3, **kw)
        got = ours.generate(odd, 3, **kw)
        assert torch.equal(got[:, 4:], want[:, 4:])
