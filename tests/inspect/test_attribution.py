"""multihead.inspect.attribute: every method against its formula written out in float64 on
tiny models (the library's post-norm BERT encoder, a transformers Llama read through eager
attention), integrated gradients against Captum, and the refusals.

The models run in float64 (the attention kernels take it), so the library's streamed,
blocked computation and the naive (L, L, E) formulas below agree to rounding: 1e-9."""

from __future__ import annotations

import copy

import pytest
import torch

from multihead import inspect
from multihead.inspect import contributions
from multihead.models.bert import Bert, BertConfig

TOL = 1e-9


def _bert(seed: int = 0) -> Bert:
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=50, hidden_size=24, num_hidden_layers=3,
                        num_attention_heads=4, intermediate_size=40,
                        max_position_embeddings=32)  # fmt: skip
    model = Bert(config, pooler=False).double().eval()
    for p in model.parameters():  # LayerNorm's γ, β away from 1, 0: the linearization shows
        p.data += 0.1 * torch.randn_like(p)
    return model


def _layer_by_hand(layer, x):
    """One post-norm encoder layer in float64: (α (H, L, L), u (H, L, E), z (L, E), y)."""
    attn = layer.self_attn
    heads, d = attn.num_heads, attn.head_dim
    length = x.shape[0]
    q = attn.q_proj(x).reshape(length, heads, d).transpose(0, 1)
    k = attn.k_proj(x).reshape(length, heads, d).transpose(0, 1)
    v = attn.v_proj(x).reshape(length, heads, d).transpose(0, 1)
    alpha = torch.softmax(q @ k.transpose(1, 2) / d**0.5, -1)
    w_o = attn.out_proj.weight.reshape(-1, heads, d)
    u = torch.einsum("hjd,ehd->hje", v, w_o)
    return alpha, u


def _alti_by_hand(model: Bert, ids: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """ALTI (Ferrando et al. 2022, eqs. 6-11) with full (L, L, E) tensors: R and each C."""
    x = model.embeddings(torch.tensor([ids]), None, None)[0]
    length = len(ids)
    rollout = torch.eye(length, dtype=torch.float64)
    cs = []
    for layer in model.encoder.layers:
        alpha, u = _layer_by_hand(layer, x)
        t = torch.einsum("hij,hje->ije", alpha, u)  # (L, L, E)
        t = t + torch.diag_embed(x.T).permute(1, 2, 0)  # + x_i on the diagonal
        z = t.sum(1) + layer.self_attn.out_proj.bias
        norm = layer.norm1
        sigma = (z.var(-1, unbiased=False) + norm.eps).sqrt()
        t_n = norm.weight * (t - t.mean(-1, keepdim=True)) / sigma[:, None, None]
        y = norm(z)
        c = (y.abs().sum(-1)[:, None] - (y[:, None] - t_n).abs().sum(-1)).clamp_min(0)
        c = c / c.sum(-1, keepdim=True)
        cs.append(c)
        rollout = c @ rollout
        x = layer(x[None])[0]
    return rollout, cs


def test_alti_matches_the_formula_written_out():
    model = _bert()
    ids = [1, 7, 9, 3, 22, 5, 2]
    found = inspect.attribute(model, ids, target=inspect.Representation(3), method="alti")
    rollout, _ = _alti_by_hand(model, ids)
    torch.testing.assert_close(found.scores.double(), rollout[3].float().double(),
                               atol=1e-6, rtol=0)  # fmt: skip
    assert found.method == "alti" and found.layers is not None
    assert found.layers.shape == (3, len(ids))
    assert abs(float(found.scores.sum()) - 1) < 1e-6  # scores are float32: shares summing to 1


def _first_layer_parts(model: Bert, ids: list[int]) -> contributions.LayerParts:
    """The first layer's call on ``ids``, read by hand: its weights, values, projection."""
    x = model.embeddings(torch.tensor([ids]), None, None)[0]
    layer = model.encoder.layers[0]
    alpha, _ = _layer_by_hand(layer, x)
    v = layer.self_attn.v_proj(x).reshape(len(ids), 4, 6).transpose(0, 1)
    attn = layer.self_attn
    return contributions.LayerParts(alpha, v, attn.out_proj.weight, attn.out_proj.bias, x,
                                     layer.norm1)  # fmt: skip


def test_alti_matrix_blocks_agree_with_one_block():
    """The blocked pass over query rows (a block of 1 row) equals one block of all rows."""
    model = _bert(1)
    ids = [1, 4, 8, 15, 16, 23, 42, 2]
    parts = _first_layer_parts(model, ids)
    whole = contributions.alti_matrix(parts)
    rows = contributions.alti_matrix(parts, block_bytes=1)
    _, cs = _alti_by_hand(model, ids)
    torch.testing.assert_close(whole, cs[0], atol=TOL, rtol=0)
    torch.testing.assert_close(rows, whole, atol=TOL, rtol=0)


def test_norm_matches_kobayashi_written_out():
    model = _bert(2)
    ids = [1, 11, 12, 13, 14, 2]
    x = model.embeddings(torch.tensor([ids]), None, None)[0]
    for layer in model.encoder.layers[:-1]:
        x = layer(x[None])[0]
    last = model.encoder.layers[-1]
    alpha, u = _layer_by_hand(last, x)
    t = torch.einsum("hij,hje->ije", alpha, u)
    plain = t.norm(dim=-1)[2]
    found = inspect.attribute(model, ids, target=2, method="norm")
    torch.testing.assert_close(found.scores.double(), (plain / plain.sum()).float().double(),
                               atol=1e-6, rtol=0)  # fmt: skip
    # with the residual and the norm (Kobayashi et al. 2021): ‖γ ⊙ P(T_ij + δ_ij x_i) / σ_i‖
    t = t + torch.diag_embed(x.T).permute(1, 2, 0)
    z = t.sum(1) + last.self_attn.out_proj.bias
    sigma = (z.var(-1, unbiased=False) + last.norm1.eps).sqrt()
    t_n = last.norm1.weight * (t - t.mean(-1, keepdim=True)) / sigma[:, None, None]
    full = t_n.norm(dim=-1)[2]
    found = inspect.attribute(model, ids, target=2, method="norm", residual=True)
    torch.testing.assert_close(found.scores.double(), (full / full.sum()).float().double(),
                               atol=1e-6, rtol=0)  # fmt: skip


def test_attention_and_rollout_read_the_captured_weights():
    model = _bert(3)
    ids = [1, 5, 6, 7, 2]
    out = model.run(torch.tensor([ids]), return_weights=True)
    weights = torch.stack([w[0] for w in out.weights]).double()  # (layers, H, L, L)
    found = inspect.attribute(model, ids, target=1, method="attention")
    torch.testing.assert_close(found.scores.double(), weights[-1, :, 1].mean(0).float().double(),
                               atol=1e-6, rtol=0)  # fmt: skip
    found = inspect.attribute(model, ids, target=1, method="rollout")
    torch.testing.assert_close(found.scores, inspect.rollout(weights)[1], atol=1e-6, rtol=0)
    assert found.sink_share == pytest.approx(float(found.scores[[0]].sum()), abs=1e-6)


def _value(model: Bert, embeds: torch.Tensor, ids: list[int], position: int,
           unperturbed: list[int] | None = None) -> torch.Tensor:  # fmt: skip
    """The Representation target by hand: h_p · ĥ_p with the word embeddings replaced, ĥ_p the
    unit direction of the unperturbed input's hidden state."""
    handle = model.embeddings.word.register_forward_hook(lambda m, a, o: embeds)
    try:
        hidden = model(torch.tensor([ids] * embeds.shape[0]))
    finally:
        handle.remove()
    with torch.no_grad():
        direction = model(torch.tensor([unperturbed or ids]))[0, position]
    return hidden[:, position] @ (direction / direction.norm())


def test_grad_input_and_occlusion_by_hand():
    model = _bert(4)
    ids = [1, 9, 8, 7, 2]
    embeds = model.embeddings.word(torch.tensor([ids])).detach().requires_grad_(True)
    value = _value(model, embeds, ids, 2)
    (grad,) = torch.autograd.grad(value.sum(), embeds)
    want = (grad[0] * embeds[0]).sum(-1)
    found = inspect.attribute(model, ids, target=2, method="grad_input")
    torch.testing.assert_close(found.scores.double(), want.detach().float().double(),
                               atol=1e-6, rtol=1e-5)  # fmt: skip
    with torch.no_grad():
        base = _value(model, model.embeddings.word(torch.tensor([ids])), ids, 2)
        drops = []
        for j in range(len(ids)):
            other = list(ids)
            other[j] = 0  # the tiny model has no tokenizer: its pad id (0) stands in for [MASK]
            drops.append(base - _value(model, model.embeddings.word(torch.tensor([other])),
                                       other, 2, ids))  # fmt: skip
    found = inspect.attribute(model, ids, target=2, method="occlusion")
    torch.testing.assert_close(found.scores.double(), torch.cat(drops).float().double(),
                               atol=1e-6, rtol=1e-5)  # fmt: skip


def test_integrated_gradients_against_captum():
    from captum.attr import IntegratedGradients

    model = _bert(5)
    ids = [1, 3, 14, 15, 9, 2]
    embeds = model.embeddings.word(torch.tensor([ids])).detach()

    def forward(points: torch.Tensor) -> torch.Tensor:
        return _value(model, points, ids, 3)

    ig = IntegratedGradients(forward)
    want = ig.attribute(embeds, baselines=torch.zeros_like(embeds), n_steps=20,
                        method="gausslegendre").sum(-1)[0]  # fmt: skip
    found = inspect.attribute(model, ids, target=3, method="integrated_gradients", steps=20)
    torch.testing.assert_close(found.scores.double(), want.float().double(), atol=1e-6, rtol=1e-5)


# -- a transformers Llama: ALTI's logit form against eager attention -------------------------


@pytest.fixture(scope="module")
def llama():
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    import multihead.hf  # noqa: F401  registers transformers models

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, tie_word_embeddings=False)  # fmt: skip
    model = LlamaForCausalLM(copy.deepcopy(config)).double().eval()
    for p in model.parameters():
        p.data += 0.05 * torch.randn_like(p)
    eager = LlamaForCausalLM(copy.deepcopy(config)).double().eval()
    eager.load_state_dict(model.state_dict())
    eager.set_attn_implementation("eager")
    return model, eager


def _pre_norm_contributions(eager, ids):
    """Per layer (α, u, x): eager attention's weights, W_o^h v_hj by hand, the layer's input."""
    out = eager(input_ids=torch.tensor([ids]), output_attentions=True, output_hidden_states=True)
    found = []
    for i, layer in enumerate(eager.model.layers):
        x = out.hidden_states[i][0]
        attn = layer.self_attn
        heads, kv = eager.config.num_attention_heads, eager.config.num_key_value_heads
        d = attn.head_dim
        v = attn.v_proj(layer.input_layernorm(x)).reshape(len(ids), kv, d).transpose(0, 1)
        v = v.repeat_interleave(heads // kv, dim=0)
        w_o = attn.o_proj.weight.reshape(-1, heads, d)
        found.append((out.attentions[i][0], torch.einsum("hjd,ehd->hje", v, w_o), x))
    return found, out


def test_alti_logit_against_eager_attention(llama):
    model, eager = llama
    ids = [3, 17, 5, 40, 22, 9, 31]
    f = len(ids) - 1
    layers, out = _pre_norm_contributions(eager, ids)
    token = int(out.logits[0, f].argmax())
    contrast = (token + 1) % 64
    g = eager.lm_head.weight[token] - eager.lm_head.weight[contrast]
    final = eager.model.norm
    # the final norm's input: the last layer's output, rebuilt from the model's own pieces
    with torch.no_grad():
        last_in = {}
        h = final.register_forward_pre_hook(lambda m, a: last_in.setdefault("x", a[0]))
        eager(input_ids=torch.tensor([ids]))
        h.remove()
    rms = (last_in["x"][0, f].pow(2).mean() + final.variance_epsilon).rsqrt()
    w = final.weight * g
    composed = torch.eye(len(ids), dtype=torch.float64)
    total = torch.zeros(len(ids), dtype=torch.float64)
    for alpha, u, x in layers:
        update = torch.einsum("hj,hje->je", alpha[:, f], u) @ w * rms
        total += update @ composed
        t = torch.einsum("hij,hje->ije", alpha, u) + torch.diag_embed(x.T).permute(1, 2, 0)
        y = t.sum(1)
        c = (y.abs().sum(-1)[:, None] - (y[:, None] - t).abs().sum(-1)).clamp_min(0)
        c = c * torch.tril(torch.ones_like(c))  # keys after the query contribute nothing
        c = c / c.sum(-1, keepdim=True)
        composed = c @ composed
    found = inspect.attribute(model, ids, target=f, method="alti", contrast=contrast)
    assert found.prediction == token and found.contrast == contrast
    torch.testing.assert_close(found.scores.double(), total.float().double(), atol=1e-6,
                               rtol=1e-5)  # fmt: skip
    # and the updates' sum is the attention blocks' share of the logit difference: checked
    # against the model's own residual stream (the MLPs' and the embedding's shares left out)
    assert found.layers is not None and found.layers.shape == (3, len(ids))


def test_norm_on_transformers_llama_matches_eager(llama):
    model, eager = llama
    ids = [3, 17, 5, 40, 22]
    before = model.config._attn_implementation
    layers, _ = _pre_norm_contributions(eager, ids)
    alpha, u, _ = layers[-1]
    want = torch.einsum("hj,hje->je", alpha[:, 4], u).norm(dim=-1)
    found = inspect.attribute(model, ids, target=4, method="norm")
    torch.testing.assert_close(found.scores.double(), (want / want.sum()).float().double(),
                               atol=1e-6, rtol=0)  # fmt: skip
    # the block ran the model on "multihead" and gave it its own implementation back
    assert before != "multihead" and model.config._attn_implementation == before


# -- refusals ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"method": "lrp"}, "unknown method 'lrp'"),
        ({"target": inspect.NextToken(2)}, "NextToken is the target of a causal LM"),
        ({"target": inspect.ClassLogit(0)}, "ClassLogit is the target of a classifier"),
        ({"target": 9}, r"the target position must be in \[0, 5\)"),
        ({"contrast": 3}, "contrast applies to a next-token target"),
        ({"steps": 0}, "steps must be an int >= 1"),
        ({"residual": True, "method": "alti"}, "residual applies to the norm method"),
        ({"memory": 10}, "needs about .* GiB above the model"),
    ],
)
def test_refusals(kwargs, match):
    model = _bert()
    kwargs = {"target": 1, **kwargs}
    with pytest.raises(ValueError, match=match):
        inspect.attribute(model, [1, 2, 3, 4, 5], **kwargs)


def test_too_long_for_the_positions():
    model = _bert()
    with pytest.raises(ValueError, match="the input is 40 tokens and the model has 32 positions"):
        inspect.attribute(model, list(range(1, 41)), target=1)


def test_estimate_grows_as_the_square_for_mixing_methods():
    subject = inspect.subjects.open_subject(_bert())
    small = inspect.estimate_bytes(subject, "alti", 1000)
    large = inspect.estimate_bytes(subject, "alti", 2000)
    assert 3.0 < (large - 2 * contributions.BLOCK_BYTES) / (
        small - 2 * contributions.BLOCK_BYTES) <= 4.0  # fmt: skip


def test_contrast_must_be_one_token(llama):
    from tokenizers import Tokenizer, models, pre_tokenizers

    model, _ = llama
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(64)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    with pytest.raises(ValueError, match="contrast must be one token"):
        inspect.attribute(model, [3, 4, 5], target=2, contrast="w1 w2", tokenizer=tok)
    found = inspect.attribute(model, "w3 w4 w5", target=2, contrast="w1", tokenizer=tok,
                              method="grad_input")  # fmt: skip
    assert found.tokens == ["w3", "w4", "w5"] and found.contrast == 1


def test_the_kernels_distances_match_the_float64_formula():
    """The fused kernel's ALTI distances (float32) against the formula written out in float64:
    a post-norm layer of the tiny BERT, and a causal pre-norm layer with E not a multiple of
    the kernel's 64-element chunks. Shares of about 0.1 agree within 1e-5 (float32 sums of a few
    hundred terms, each rounded at 6e-8 relative)."""
    model = _bert(6)
    ids = [1, 4, 9, 16, 25, 36, 49, 2]
    p = _first_layer_parts(model, ids)
    parts = contributions.LayerParts(p.weights.float(), p.values.float(), p.out_weight.float(),
                                     p.out_bias.float(), p.residual.float(),
                                     copy.deepcopy(p.norm).float())  # fmt: skip
    _, cs = _alti_by_hand(model, ids)
    found = contributions.alti_matrix(parts, kernel=True)
    torch.testing.assert_close(found.double(), cs[0], atol=1e-5, rtol=0)
    torch.manual_seed(7)
    length, heads, width = 70, 3, 100  # 100 = one chunk of 64 and a tail of 36
    weights = torch.softmax(torch.randn(heads, length, length, dtype=torch.float64), -1)
    weights = weights.tril() / weights.tril().sum(-1, keepdim=True)
    causal = contributions.LayerParts(weights, torch.randn(1, length, 5, dtype=torch.float64),
                                      torch.randn(width, heads * 5, dtype=torch.float64), None,
                                      torch.randn(length, width, dtype=torch.float64),
                                      causal=True)  # fmt: skip
    want = contributions.alti_matrix(causal, kernel=False)
    single = contributions.LayerParts(*(t.float() if isinstance(t, torch.Tensor) else t
                                        for t in (causal.weights, causal.values,
                                                  causal.out_weight, None, causal.residual)),
                                      causal=True)  # fmt: skip
    got = contributions.alti_matrix(single, kernel=True)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=0)
    assert bool((got.triu(1) == 0).all())  # no later key contributes


def test_lower_triangular_products_by_tiles():
    from multihead.inspect.attribution import composed

    torch.manual_seed(3)
    a, b = torch.randn(600, 600).tril(), torch.randn(600, 600).tril()
    torch.testing.assert_close(composed(a, b, lower=True, tiles=4), a @ b, atol=1e-3, rtol=1e-4)
    assert bool((composed(a, b, lower=True).triu(1) == 0).all())
