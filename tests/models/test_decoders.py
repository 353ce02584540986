"""GPT-2 and Llama loaders against transformers, loaded from the same folders.

transformers writes each tiny random checkpoint (``decoders.build``) and runs it with its eager
attention as the reference; the Llama has grouped-query attention and RoPE.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest
import torch
from decoders import EOS, VOCAB, build, pad, transformers_model

from multihead import cli
from multihead.apps import explain
from multihead.apps.explain import ExplainOptions
from multihead.models import gpt2, llama
from multihead.models.causal_lm import filter_top_k, filter_top_p

LOADERS = {"gpt2": gpt2, "llama": llama}
# prompts of 3 to 23 tokens, so each batch has rows padded by very different amounts
ROWS = [
    [5, 17, 230],
    [9, 2, 44, 61, 120, 33, 250, 8, 19, 71, 4, 3, 200, 190, 11],
    [(i * 37 + 11) % (VOCAB - 2) + 2 for i in range(23)],
]


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def pair(request, tmp_path_factory):
    """(kind, our model, transformers' model) from one folder."""
    folder = build(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, LOADERS[request.param].load(folder), transformers_model(folder)


def _theirs_logits(hf, ids, lengths, side):
    """transformers on a padded batch, with positions counted from each row's first real
    token (what its generate() does; its forward alone would count the left padding)."""
    real = _real(ids, lengths, side)
    positions = (real.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        return hf(ids, attention_mask=real.long(), position_ids=positions).logits


def _real(ids, lengths, side):
    ar = torch.arange(ids.shape[1])[None]
    return ar < lengths[:, None] if side == "right" else ar >= ids.shape[1] - lengths[:, None]


@pytest.mark.parametrize("side", ["right", "left"])
def test_logits_equal_transformers(pair, side):
    """<= 1e-5 in fp32 at every real token. Padding positions are left out: their logits are
    meaningless in both (transformers lets a padding query see padding keys, we let it see
    nothing)."""
    _, ours, hf = pair
    ids, lengths = pad(ROWS, side)
    mine = ours(ids, lengths=lengths, padding_side=side)
    theirs = _theirs_logits(hf, ids, lengths, side)
    real = _real(ids, lengths, side)
    assert mine.shape == theirs.shape == (3, 23, VOCAB)
    assert (mine - theirs)[real].abs().max() <= 1e-5


def test_greedy_generation_equals_transformers(pair):
    """64 new tokens, token for token, for a left-padded batch (the layout transformers'
    generate needs); our right-padded batch gives every row the same tokens, after its own
    last real token."""
    _, ours, hf = pair
    left, lengths = pad(ROWS, "left")
    mine = ours.generate(left, 64, lengths=lengths, padding_side="left")
    with torch.no_grad():
        theirs = hf.generate(
            left,
            attention_mask=_real(left, lengths, "left").long(),
            max_new_tokens=64,
            do_sample=False,
            eos_token_id=None,  # 64 tokens whatever comes, like ours
            pad_token_id=EOS,
        )
    assert mine.shape == (3, 23 + 64)
    assert torch.equal(mine, theirs)
    right, _ = pad(ROWS, "right")
    batch = ours.generate(right, 64, lengths=lengths)
    for b, n in enumerate(lengths.tolist()):
        assert torch.equal(batch[b, :n], right[b, :n])
        assert torch.equal(batch[b, n : n + 64], mine[b, 23:])
        assert (batch[b, n + 64 :] == ours.pad_token_id).all()


def test_cached_decoding_equals_full_recompute_at_every_step(pair):
    """A prefill of rows of different lengths, then 12 cached steps of one token and one step of
    up to three tokens per row: at every step each row's logits equal the model run on that
    row's whole sequence alone, from scratch (<= 1e-5)."""
    _, ours, _ = pair
    rows = [list(r) for r in ROWS]
    ids, lengths = pad(rows, "right")
    cache = ours.new_cache(len(rows))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        hidden = ours.extend(ids, lengths, cache)
        last = ours.lm_head(hidden[torch.arange(3), lengths - 1])
        for step in range(13):
            for b, row in enumerate(rows):
                alone = ours(torch.tensor([row]))[0, -1]
                assert (last[b] - alone).abs().max() <= 1e-5, (step, b)
            counts = [1] * 3 if step < 12 else [3, 1, 2]
            new = [torch.randint(2, VOCAB, (c,), generator=g).tolist() for c in counts]
            for row, tokens in zip(rows, new):
                row.extend(tokens)
            step_ids, step_counts = pad(new, "right")
            hidden = ours.extend(step_ids, step_counts, cache)
            last = ours.lm_head(hidden[torch.arange(3), step_counts - 1])
    assert cache.lengths.tolist() == [len(r) for r in rows]


def test_row_in_a_batch_equals_the_row_alone(pair):
    """Logits (<= 1e-5) and generated tokens (exactly) of each row of a padded batch equal
    those of the row run by itself, whatever the padding side."""
    _, ours, _ = pair
    alone = [ours.generate(torch.tensor([row]), 12)[0, len(row) :] for row in ROWS]
    for side in ("right", "left"):
        ids, lengths = pad(ROWS, side)
        logits = ours(ids, lengths=lengths, padding_side=side)
        tokens = ours.generate(ids, 12, lengths=lengths, padding_side=side)
        real = _real(ids, lengths, side)
        for b, row in enumerate(ROWS):
            assert (logits[b][real[b]] - ours(torch.tensor([row]))[0]).abs().max() <= 1e-5
            start = len(row) if side == "right" else ids.shape[1]
            assert torch.equal(tokens[b, start : start + 12], alone[b])


def test_transformers_style_attention_mask(pair):
    """attention_mask (1 = real token) says the same as lengths and padding_side."""
    _, ours, _ = pair
    for side in ("right", "left"):
        ids, lengths = pad(ROWS, side)
        mask = _real(ids, lengths, side).long()
        expected = ours(ids, lengths=lengths, padding_side=side)
        torch.testing.assert_close(ours(ids, attention_mask=mask), expected, rtol=0, atol=0)
        tokens = ours.generate(ids, 4, lengths=lengths, padding_side=side)
        assert torch.equal(ours.generate(ids, 4, attention_mask=mask), tokens)
    holes = torch.ones(3, 5, dtype=torch.long)
    holes[0, 2] = 0
    with pytest.raises(ValueError, match="must mark each row's real tokens as one block"):
        ours(torch.ones(3, 5, dtype=torch.long), attention_mask=holes)
    with pytest.raises(ValueError, match="pass lengths or attention_mask, not both"):
        ours(ids, lengths=lengths, attention_mask=mask)


def test_seeded_sampling_is_reproducible(pair):
    _, ours, _ = pair
    ids, lengths = pad(ROWS, "right")

    def sample(seed, **kw):
        g = torch.Generator().manual_seed(seed)
        return ours.generate(ids, 12, lengths=lengths, do_sample=True, generator=g, **kw)

    first = sample(3, temperature=1.5, top_k=50, top_p=0.9)
    assert torch.equal(first, sample(3, temperature=1.5, top_k=50, top_p=0.9))
    assert not torch.equal(first, sample(4, temperature=1.5, top_k=50, top_p=0.9))
    # top_k=1 leaves one candidate: sampling is then greedy decoding
    assert torch.equal(sample(5, top_k=1), ours.generate(ids, 12, lengths=lengths))


@pytest.mark.parametrize("temperature", [1e-45, 5e-324, 1e-30])
def test_tiny_temperature_samples_the_greedy_token(pair, temperature):
    """logits / 1e-45 overflows to +-inf (softmax NaN: torch.multinomial refused it); the
    scores are shifted by their maximum first, so a tiny temperature is the greedy limit."""
    _, ours, _ = pair
    ids, lengths = pad(ROWS, "right")
    g = torch.Generator().manual_seed(0)
    sampled = ours.generate(
        ids, 12, lengths=lengths, do_sample=True, temperature=temperature, generator=g
    )
    assert torch.equal(sampled, ours.generate(ids, 12, lengths=lengths))


def test_sampling_filters_equal_transformers_warpers():
    """Top-k and top-p keep the same tokens as transformers' logits warpers."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    scores = torch.randn(6, 500, generator=torch.Generator().manual_seed(0)) * 3
    for k in (1, 5, 499):
        theirs = TopKLogitsWarper(k)(None, scores.clone())
        assert torch.equal(filter_top_k(scores, k).isinf(), theirs.isinf())
    for p in (0.05, 0.5, 0.9, 0.999):
        theirs = TopPLogitsWarper(p)(None, scores.clone())
        mine = filter_top_p(scores, p)
        assert torch.equal(mine.isinf(), theirs.isinf())
        assert torch.equal(mine[~mine.isinf()], scores[~mine.isinf()])


class _Recorder:
    """A streamer (transformers' put / end protocol) that keeps what it is given."""

    def __init__(self):
        self.puts, self.ends = [], 0

    def put(self, value):
        self.puts.append(value.clone())

    def end(self):
        self.ends += 1


def test_a_streamer_gets_what_transformers_gives_it(pair):
    """generate(streamer=) calls put and end as transformers' generate does on the same
    weights: the prompt, then each step's new token of every row, then end() once."""
    _, ours, hf = pair
    left, lengths = pad(ROWS, "left")
    mine, theirs = _Recorder(), _Recorder()
    ours.generate(left, 16, lengths=lengths, padding_side="left", streamer=mine)
    with torch.no_grad():
        hf.generate(
            left,
            attention_mask=_real(left, lengths, "left").long(),
            max_new_tokens=16,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=EOS,
            streamer=theirs,
        )
    assert len(mine.puts) == len(theirs.puts) == 17 and mine.ends == theirs.ends == 1
    for got, want in zip(mine.puts, theirs.puts):
        assert torch.equal(got, want)
    with pytest.raises(TypeError, match="put"):
        ours.generate(left, 2, streamer=print)


def test_eos_stops_a_row_and_pads_it(pair):
    _, ours, _ = pair
    ids, lengths = pad(ROWS, "right")
    free = ours.generate(ids, 10, lengths=lengths)
    stop = int(free[1, lengths[1] + 4])  # the fifth new token of row 1
    out = ours.generate(ids, 10, lengths=lengths, eos_token_id=stop)
    for b, n in enumerate(lengths.tolist()):
        new = free[b, n : n + 10].tolist()
        cut = new.index(stop) + 1 if stop in new else 10
        assert out[b, n : n + cut].tolist() == new[:cut]
        assert (out[b, n + cut : n + 10] == ours.pad_token_id).all()


def test_text_in_text_out(pair):
    _, ours, _ = pair
    prompts = ["The cat crossed the street", "A dog"]
    texts = ours.generate_text(prompts, 8)
    assert isinstance(texts, list) and len(texts) == 2
    for prompt, text in zip(prompts, texts):
        assert text.startswith(prompt) and len(text) > len(prompt)
        # the same as generating from the ids and decoding them
        encoding = ours.tokenizer.encode(prompt)
        ids = ours.generate(torch.tensor([encoding.ids]), 8, eos_token_id=EOS)[0].tolist()
        if EOS in ids[len(encoding.ids) :]:
            ids = ids[: ids.index(EOS, len(encoding.ids)) + 1]
        assert text == ours.tokenizer.decode(ids, skip_special_tokens=True)
    assert isinstance(ours.generate_text("One text", 3), str)


def test_explain_on_a_decoder(pair, tmp_path, capsys):
    """``multihead explain --model`` reads the folder's model_type and shows causal heads:
    GPT-2 through the command line, Llama (whose tokenizer adds a start token) through
    ``explain.run``."""
    kind, ours, _ = pair
    text = "The animal crossed the street because it was tired"
    if kind == "gpt2":
        argv = ["explain", text, "--focus", "street", "--model", str(ours.path)]
        assert cli.main([*argv, "--out", str(tmp_path)]) == 0
        printed = capsys.readouterr().out
        assert "causal: each token sees only earlier ones" in printed
        # byte-level BPE tokens are shown as text: "street", not "Ġstreet"
        shown = next(line for line in printed.splitlines() if line.startswith("tokens: "))
        assert "Ġ" not in shown and " ed" in shown  # "tired" in pieces: "t i r ed"
        assert (tmp_path / "attention.html").stat().st_size > 5_000
        return
    lines = []
    options = ExplainOptions(text=text, focus="street", model=ours.path, out=tmp_path)
    got = explain.run(options, say=lines.append)
    assert got.tokens[0] == "<s>"
    pieces = ours.tokenizer.encode(" street", add_special_tokens=False).tokens
    assert pieces[0].startswith("Ġ")  # the byte-level marker of a leading space
    shown = [ours.tokenizer.decoder.decode([p]).strip() for p in pieces]
    assert got.tokens[got.focus : got.focus + len(pieces)] == shown == ["s", "t", "r", "e", "et"]
    n = len(got.tokens)
    assert got.weights.shape == (2, 4, n, n)
    torch.testing.assert_close(got.weights.sum(-1), torch.ones(2, 4, n))
    assert (got.weights.triu(1) == 0).all()  # no token attends to a later one
    expected = ours.run(torch.tensor([ours.tokenizer.encode(text).ids]))
    torch.testing.assert_close(got.weights, torch.stack([w[0] for w in expected.weights]))


def test_explain_on_a_multihead_save_folder_of_a_decoder(pair, tmp_path):
    """A decoder written by ``multihead.save`` (no model_type: format_version and its class)
    is explained as the folder it came from (the same weights, to fp32 rounding: 1e-6)."""
    import multihead as mh

    _, ours, _ = pair
    saved = mh.save(ours, tmp_path / "saved")
    text = "The animal crossed the street"
    options = ExplainOptions(text=text, focus="street", out=tmp_path / "out")
    got = explain.run(replace(options, model=saved), say=lambda line: None)
    direct = explain.run(replace(options, model=ours.path), say=lambda line: None)
    assert got.tokens == direct.tokens and got.focus == direct.focus
    assert (got.weights - direct.weights).abs().max() <= 1e-6


def test_weights_and_hidden_states_equal_transformers(pair):
    """run(..., return_hidden=True) against transformers' attentions and
    hidden states on a left-padded batch (<= 1e-5 at real positions)."""
    _, ours, hf = pair
    ids, lengths = pad(ROWS, "left")
    real = _real(ids, lengths, "left")
    out = ours.run(ids, lengths=lengths, padding_side="left", return_hidden=True)
    positions = (real.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        theirs = hf(
            ids,
            attention_mask=real.long(),
            position_ids=positions,
            output_attentions=True,
            output_hidden_states=True,
        )
    for mine, ref in zip(out.hidden_states, theirs.hidden_states, strict=True):
        assert (mine - ref)[real].abs().max() <= 1e-5
    rows = real[:, None, :, None] & real[:, None, None, :]  # real queries x real keys
    for mine, ref in zip(out.weights, theirs.attentions, strict=True):
        assert (mine - ref)[rows.expand_as(mine)].abs().max() <= 1e-5
        assert (mine[~rows.expand_as(mine)] == 0).all()


def test_decode_layout_keeps_values_and_ties(pair):
    """Loaded fp32 decoders run their one-row products on the multi-core kernel
    (``RowsLinear``, modules/few_rows.py), which reads (out, in)-contiguous weights (the (in, out)
    layout of ``decode_layout`` served the BLAS's one-core product before); the parameters keep
    their shapes, values and tying, and give the same logits (to rounding) and tokens as
    plain ``nn.Linear`` layers."""
    from multihead.modules.few_rows import RowsLinear

    kind, ours, _ = pair
    fresh = type(ours)(ours.config).eval()
    fresh.load_state_dict({k: v.contiguous() for k, v in ours.state_dict().items()})
    attn = ours.decoder.layers[0].self_attn
    assert type(attn.q_proj) is RowsLinear and type(ours.lm_head) is RowsLinear
    assert attn.q_proj.weight.shape == (32, 32) and attn.q_proj.weight.stride() == (32, 1)
    assert type(fresh.decoder.layers[0].self_attn.q_proj) is torch.nn.Linear
    if kind == "gpt2":
        assert ours.lm_head.weight is ours.wte.weight  # still tied
    ids, lengths = pad(ROWS, "right")
    with torch.no_grad():
        assert (ours(ids, lengths=lengths) - fresh(ids, lengths=lengths)).abs().max() <= 1e-5
    assert torch.equal(
        ours.generate(ids, 8, lengths=lengths), fresh.generate(ids, 8, lengths=lengths)
    )


def test_cache_holds_kv_heads_only(pair):
    kind, ours, _ = pair
    cache = ours.new_cache(2, max_length=40)
    heads = 2 if kind == "llama" else 4  # the Llama has H=4 query heads, H_kv=2
    assert cache.num_kv_heads == heads
    assert cache.bytes_per_token == 2 * heads * (8 + 8) * 4  # layers x H_kv x (D + D_v) x fp32
    assert cache.nbytes == cache.bytes_per_token * 2 * 40


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda m, ids: m(ids.float()), r"input_ids must be a \(B, L\) integer tensor"),
        (lambda m, ids: m(ids, lengths=torch.tensor([3, 0, 2])), r"lengths must have B=3 entries"),
        (lambda m, ids: m(ids + VOCAB), rf"token ids in \[0, {VOCAB}\)"),
        (lambda m, ids: m(ids, padding_side="top"), "padding_side must be 'right' or 'left'"),
        (lambda m, ids: m.generate(ids, -1), "max_new_tokens must be >= 0"),
        (lambda m, ids: m.generate(ids, 2, do_sample=True, temperature=0), "temperature must be"),
        (
            lambda m, ids: m.generate(ids, 2, do_sample=True, temperature=float("inf")),
            r"temperature must be a finite number > 0 .*Received: temperature=inf",
        ),
        (
            lambda m, ids: m.generate(ids, 2, do_sample=True, temperature=float("nan")),
            r"temperature must be a finite number > 0 .*Received: temperature=nan",
        ),
        (
            lambda m, ids: m.generate(ids, 2, do_sample=True, top_p=1.5),
            r"top_p must be in \(0, 1\]",
        ),
        (lambda m, ids: m.generate(ids, 2, do_sample=True, top_k=0), "top_k must be a positive"),
        (lambda m, ids: m.generate(ids, 2, eos_token_id="x"), "eos_token_id must be a token id"),
        (lambda m, ids: m.generate_text(["ok", 5], 2), "a string or a non-empty list of strings"),
    ],
    ids=[
        "float_ids",
        "zero_length",
        "out_of_vocab",
        "padding_side",
        "negative_new",
        "temperature",
        "temperature_inf",
        "temperature_nan",
        "top_p",
        "top_k",
        "eos",
        "texts",
    ],
)
def test_bad_calls(pair, call, match):
    _, ours, _ = pair
    ids = torch.tensor([[5, 6, 7], [8, 9, 10], [11, 12, 13]])
    with pytest.raises((ValueError, TypeError), match=match):
        call(ours, ids)


def test_gpt2_runs_out_of_positions_before_any_work(tmp_path_factory):
    """GPT-2's learned table has n_positions=128 rows; Llama's rotary positions have no end."""
    folder = _folder(tmp_path_factory, "gpt2")
    model = gpt2.load(folder)
    ids = torch.randint(2, VOCAB, (1, 100))
    with pytest.raises(ValueError, match="needs 140 positions but the model has 128"):
        model.generate(ids, 40)
    with pytest.raises(ValueError, match="needs 129 positions but the model has 128"):
        model(torch.randint(2, VOCAB, (1, 129)))
    with pytest.raises(ValueError, match="text 0 has no tokens"):
        model.generate_text("", 2)  # GPT-2's tokenizer adds no start token


def test_llama_runs_out_of_its_trained_context_before_any_work(tmp_path_factory):
    """Llama stops at max_position_embeddings (256 here) as GPT-2 stops at n_positions: it
    generated past it, and allocated for 10**9 new tokens, before."""
    model = llama.load(_folder(tmp_path_factory, "llama"))
    ids = torch.randint(2, VOCAB, (1, 100))
    with pytest.raises(ValueError, match="needs 300 positions but the model has 256"):
        model.generate(ids, 200)
    with pytest.raises(ValueError, match="needs 1000000100 positions but the model has 256"):
        model.generate(ids, 10**9)
    with pytest.raises(ValueError, match="needs 257 positions but the model has 256"):
        model(torch.randint(2, VOCAB, (1, 257)))
    assert model.generate(ids, 156).shape == (1, 256)


def _with_context(factory, kind, positions):
    folder = _folder(factory, kind)
    config = json.loads((folder / "config.json").read_text())
    config["n_positions" if kind == "gpt2" else "max_position_embeddings"] = positions
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_kv_cache_larger_than_free_memory_is_refused(tmp_path_factory, monkeypatch):
    """The cache is layers x B x H_kv x T x (D + D_v) x itemsize bytes, written out here for
    the tiny Llama (2 layers, H_kv=2, D=D_v=8, fp32), plus two int64 (B, T + new) buffers:
    one byte less free memory than that is refused, before any allocation; exactly that
    much is enough."""
    from multihead.models import generation

    model = llama.load(_folder(tmp_path_factory, "llama"))
    ids, lengths = pad(ROWS, "right")  # B=3, longest prompt 23
    new = 40
    total = 23 + new
    cache = 2 * 3 * 2 * total * (8 + 8) * 4
    buffers = 2 * 3 * (total + new) * 8
    monkeypatch.setattr(generation, "_free_bytes", lambda device: cache + buffers - 1)
    with pytest.raises(ValueError) as err:
        model.generate(ids, new, lengths=lengths)
    message = str(err.value)
    assert "2 layers x B=3 x H_kv=2 x T=63 tokens x (D=8 + D_v=8) x 4 bytes" in message
    assert f"KV cache of {cache / 1024:.1f} KiB" in message
    assert "ask for fewer new tokens" in message and "Received: max_new_tokens=40" in message
    monkeypatch.setattr(generation, "_free_bytes", lambda device: cache + buffers)
    assert model.generate(ids, new, lengths=lengths).shape == (3, total)


def test_a_billion_new_tokens_fail_fast_on_memory(tmp_path_factory):
    """With a context of 2**40 positions the limit is memory: 10**12 new tokens would need a
    cache of hundreds of TiB, which no machine has free; refused at once (it allocated a
    16 GB id tensor and ran 94 s before dying, before)."""
    model = llama.load(_with_context(tmp_path_factory, "llama", 2**40))
    ids = torch.randint(2, VOCAB, (1, 10))
    started = time.perf_counter()
    with pytest.raises(ValueError, match=r"needs a KV cache of [0-9.]+ TiB .* free on cpu"):
        model.generate(ids, 10**12)
    assert time.perf_counter() - started < 5


@pytest.mark.parametrize(
    ("kind", "change", "match"),
    [
        ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
        ("gpt2", {"activation_function": "swish"}, "activation_function must be one of"),
        ("gpt2", {"n_head": 5}, "n_head must divide n_embd=32"),
        ("gpt2", {"model_type": "gptj"}, r"model_type must be one of \['gpt2'\]"),
        ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1.0}}, "rope_type"),
        ("llama", {"head_dim": 7}, "head_dim must be even"),
        ("llama", {"num_key_value_heads": 3}, "num_key_value_heads must divide"),
        ("llama", {"hidden_act": "gelu"}, r"hidden_act must be one of \['silu'\]"),
        ("llama", {"vocab_size": "300"}, "vocab_size must be a positive int"),
        ("llama", {"num_key_value_heads": 0}, "num_key_value_heads must be a positive int or null"),
        ("gpt2", {"n_inner": 0}, r"n_inner must be a positive int or null\. Received: n_inner=0"),
        ("gpt2", {"n_layer": 0}, r"n_layer must be a positive int\. Received: n_layer=0"),
        # transformers' GPT2Config defaults (50256) in a small vocabulary: never generated, so
        # never a stop, and padding the output with ids the model cannot embed
        ("gpt2", {"eos_token_id": 50256}, r"eos_token_id must be a token id in \[0, vocab_size"),
        ("gpt2", {"bos_token_id": -1}, r"bos_token_id must be .*Received: bos_token_id=-1"),
        ("llama", {"eos_token_id": [2, 900]}, r"eos_token_id=\[2, 900\]"),
        ("llama", {"pad_token_id": 10**6}, r"pad_token_id must be a token id"),
    ],
    ids=lambda x: x if isinstance(x, str) else next(iter(x)) if isinstance(x, dict) else "",
)
def test_unsupported_config_names_the_field(tmp_path_factory, kind, change, match):
    folder = _folder(tmp_path_factory, kind)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=match):
        LOADERS[kind].load(folder)


def _folder(factory, kind):
    """A fresh copy of a tiny checkpoint (tests below break its files)."""
    base = factory.getbasetemp() / f"pristine-{kind}"
    if not base.exists():
        build(kind, base)
    folder = factory.mktemp(kind)
    for file in base.iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    return folder


def test_llama_with_a_head_dim_of_its_own(tmp_path):
    """head_dim=16 with E=32 and H=4 (Gemma and Qwen3 decouple D from E / H): logits and
    greedy tokens as transformers."""
    folder = build("llama", tmp_path / "wide", head_dim=16)
    ours, hf = llama.load(folder), transformers_model(folder)
    assert ours.decoder.layers[0].self_attn.q_proj.weight.shape == (64, 32)
    ids, lengths = pad(ROWS, "left")
    real = _real(ids, lengths, "left")
    mine = ours(ids, lengths=lengths, padding_side="left")
    assert (mine - _theirs_logits(hf, ids, lengths, "left"))[real].abs().max() <= 1e-5
    with torch.no_grad():
        theirs = hf.generate(
            ids, attention_mask=real.long(), max_new_tokens=8, do_sample=False,
            eos_token_id=None, pad_token_id=EOS,
        )  # fmt: skip
    assert torch.equal(ours.generate(ids, 8, lengths=lengths, padding_side="left"), theirs)


def test_no_tokenizer_means_ids_only(tmp_path_factory):
    folder = _folder(tmp_path_factory, "gpt2")
    (folder / "tokenizer.json").unlink()
    model = gpt2.load(folder)
    assert model.tokenizer is None
    assert model.generate(torch.tensor([[5, 6]]), 3).shape == (1, 5)
    with pytest.raises(ValueError, match="has no tokenizer"):
        model.generate_text("text", 3)
    with pytest.raises(ValueError, match="has no tokenizer"):
        model.stream_text("text", 3)
    with pytest.raises(FileNotFoundError, match=r"explain needs the model's tokenizer\.json"):
        explain.run(ExplainOptions(text="a text", model=folder), say=lambda s: None)
