"""Decoding layers (modules/few_rows.py, modules/quant.py): the few-row kernel, weight-only
bf16 / int8, and the loaders' ``weights=`` option, against float64 references and transformers."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from decoders import EOS, build, transformers_model

import multihead
from multihead.models import gpt2, llama
from multihead.modules import few_rows, quant

LOADERS = {"gpt2": gpt2, "llama": llama}


def _bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Rounding bound of a float32 dot product of length K, per output: K * u * sum |x w|
    (u = 2^-24; the classical bound for any summation order), plus the rounding of the
    result itself."""
    k = x.shape[-1]
    u = 2.0**-24
    mags = x.double().abs() @ w.double().abs().T
    return (k + 2) * u * mags


@pytest.mark.parametrize("rows", [1, 3, 5, 8, 9, 16])
@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8"])
def test_kernel_equals_float64_dequantized_product(fmt, rows):
    """K = 100 leaves a tail after the 16-lane blocks; N = 37 splits unevenly over tasks."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(37, 100, generator=g)
    x, bias = torch.randn(rows, 100, generator=g), torch.randn(37, generator=g)
    scale = None
    if fmt == "int8":
        w, scale = quant.quantize_int8(w)
        dense = quant.dequantize_int8(w, scale).double()
    elif fmt == "bf16":
        w = w.bfloat16()
        dense = w.double()
    else:
        dense = w.double()
    got = few_rows.rows_linear(x, w, scale, bias).double()
    want = x.double() @ dense.T + bias.double()
    # the scale multiplies the float32 sum once more: one more rounding of the product
    bound = _bound(x, dense) + 2.0**-23 * want.abs() + 1e-12
    assert (got - want).abs().le(bound).all()


@pytest.mark.parametrize("rows", [1, 3, 5, 8, 9, 16])
@pytest.mark.parametrize("k", [100, 4200])
def test_w8a16_kernel_equals_the_integer_formula_in_float64(rows, k):
    """ "w8a16": each row of x rounded to int16 steps of max|x| / 32767, times the int8 codes,
    summed exactly, then scaled. The float64 formula on the same rounded values gives it to
    float32 rounding of the result; against "int8" (x unrounded) the difference is bounded by
    the rounding of x: sum |w| * step / 2. K = 100 leaves a tail after the 32-input blocks;
    K = 4200 sums past one 2,048-input chunk of int32 lanes (and an input of 50 times the
    others makes the other inputs' steps coarse)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(37, k, generator=g)
    x, bias = torch.randn(rows, k, generator=g), torch.randn(37, generator=g)
    x[0, 7] = 50.0
    q, scale = quant.quantize_int8(w)
    packed = (q.to(torch.int16) + 128).to(torch.uint8)
    got = few_rows.rows_linear(x, packed, scale, bias).double()
    # the rounding of x as the kernel makes it, in float32: x times 32767 / max|x|, to the
    # nearest integer (ties to even, as lrintf and torch.round)
    top = x.abs().amax(1, keepdim=True)
    inv = (32767.0 / top.double()).float()  # the correctly rounded float32 quotient
    xq = torch.round((x * inv).clamp(-32767, 32767)).double()
    step = (top / 32767.0).double()
    dense = q.double() * scale.double()[:, None]  # exact (dequantize_int8 rounds to float32)
    want = (xq * step) @ dense.T + bias.double()
    # the integer sum is exact; the float32 scalings (row step times channel scale, then the
    # sum times that, then the bias) round three times
    assert (got - want).abs().le(4 * 2.0**-24 * (want.abs() + bias.double().abs()) + 1e-9).all()
    int8 = few_rows.rows_linear(x, q, scale, bias).double()
    rounding = step / 2 * dense.abs().sum(1)[None]
    assert (got - int8).abs().le(rounding + _bound(x, dense) + 1e-6).all()


def test_w8a16_is_a_weight_kind_with_int8s_codes():
    linear = torch.nn.Linear(40, 24)
    packed = quant.PackedLinear(linear, "w8a16")
    int8 = quant.PackedLinear(linear, "int8")
    assert packed.packed.dtype == torch.uint8 and packed.weights == "w8a16"
    assert torch.equal(packed.packed.to(torch.int16) - 128, int8.packed.to(torch.int16))
    torch.testing.assert_close(packed.weight, int8.weight, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"'bf16', 'int8' or 'w8a16'. Received: weights='int4'"):
        quant.PackedLinear(linear, "int4")


@pytest.mark.parametrize("rows", [1, 8, 11])
def test_kernel_is_bitwise_the_same_for_any_thread_count_and_row_count(rows):
    """Each output is summed in one fixed order whatever task, channel block (4, 2 or 1
    channels at a time) and row block it falls in: one thread or two, and one row alone or
    among others, give the same bits. K = 100 leaves a tail; N = 301 splits unevenly."""
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(301, 100, generator=g), torch.randn(rows, 100, generator=g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = few_rows.rows_linear(x, w, None, None)
        torch.set_num_threads(2)
        two = few_rows.rows_linear(x, w, None, None)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    alone = torch.cat([few_rows.rows_linear(x[r : r + 1], w, None, None) for r in range(rows)])
    assert torch.equal(alone, two)


def _documented_sums(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (M, K) @ w (N, K).T summed in the order rows_linear.cpp's comment gives, for K a
    multiple of 16: lane l of 16 adds x[k] * w[n, k] for k = l, l + 16, ... by fused
    multiply-adds, then the lanes are summed in a tree (pairs 8 apart, then 4, 2, 1). A fused
    multiply-add is emulated as the exact product plus the sum in float64, rounded to
    float32: one rounding, but for a tie that the float64 step can create (about 2^-28 of the
    steps; the inputs are fixed)."""
    k = x.shape[1]
    xs = x.double().reshape(x.shape[0], 1, k // 16, 16)
    ws = w.double().reshape(1, w.shape[0], k // 16, 16)
    acc = torch.zeros(x.shape[0], w.shape[0], 16)
    for b in range(k // 16):
        acc = (acc.double() + xs[:, :, b] * ws[:, :, b]).float()
    half = 8
    while half:
        acc = acc[..., :half] + acc[..., half : 2 * half]  # float32 additions
        half //= 2
    return acc[..., 0]


@pytest.mark.parametrize("rows", [1, 3, 9])
@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8"])
def test_kernel_sums_in_its_documented_order(fmt, rows):
    """The bits of every output are those of the order rows_linear.cpp documents (lane sums,
    then the fixed tree over the lanes), for one thread or two and every channel blocking
    (1 and 3 rows take 4 channels at a time, 9 rows 2; N = 301 leaves single channels). A
    vector reduction that added the lanes in another order would change the bits."""
    g = torch.Generator().manual_seed(4)
    (w,), _ = _matrices(fmt, [301], 160, g)
    x = torch.randn(rows, 160, generator=g)
    want = _documented_sums(x, w)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            assert torch.equal(few_rows.rows_linear(x, w, None, None), want)
    finally:
        torch.set_num_threads(threads)


def _matrices(fmt: str, sizes: list[int], k: int, g: torch.Generator) -> tuple[list, list]:
    """Weights of the given output sizes in fmt, with their scales (int8) or Nones."""
    weights, scales = [], []
    for n in sizes:
        w = torch.randn(n, k, generator=g)
        scale = None
        if fmt == "int8":
            w, scale = quant.quantize_int8(w)
        elif fmt == "bf16":
            w = w.bfloat16()
        weights.append(w)
        scales.append(scale)
    return weights, scales


@pytest.mark.parametrize("rows", [1, 3, 9])
@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8"])
def test_stacked_products_are_each_product_to_the_bit(fmt, rows):
    """rows_linear_stacked gives each matrix's outputs side by side with exactly the bits of
    its own rows_linear call, on one thread or two: sizes 37, 16 and 301 put the task
    boundaries inside matrices and across them, K = 100 leaves a tail, one matrix has no
    bias. And it is the float64 product of the dequantized weights within rounding."""
    g = torch.Generator().manual_seed(3)
    weights, scales = _matrices(fmt, [37, 16, 301], 100, g)
    biases = [torch.randn(37, generator=g), None, torch.randn(301, generator=g)]
    x = torch.randn(rows, 100, generator=g)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            got = few_rows.rows_linear_stacked(x, weights, scales, biases)
            each = [few_rows.rows_linear(x, *args) for args in zip(weights, scales, biases)]
            assert got.shape == (rows, 37 + 16 + 301)
            assert torch.equal(got, torch.cat(each, dim=1))
    finally:
        torch.set_num_threads(threads)
    dense = [
        quant.dequantize_int8(w, s).double() if s is not None else w.double()
        for w, s in zip(weights, scales)
    ]
    want = torch.cat(
        [x.double() @ d.T + (0 if b is None else b.double()) for d, b in zip(dense, biases)],
        dim=1,
    )
    bound = _bound(x, torch.cat(dense)) + 2.0**-23 * want.abs() + 1e-12
    assert (got.double() - want).abs().le(bound).all()


@pytest.mark.parametrize("lead", [(), (1,), (1, 1), (3, 1), (2, 2, 1)])
def test_the_kernel_takes_rows_in_any_leading_dimensions(lead):
    """rows_linear and rows_linear_stacked over x (..., K) give (..., N): the (M, K) call's
    bits in x's leading shape (a decoding step's (B, 1, E) needs no reshape on either side);
    a matrix's part of the stacked output is its own contiguous tensor; K = 0 gives the bias."""
    g = torch.Generator().manual_seed(6)
    weights, scales = _matrices("int8", [20, 12], 40, g)
    biases = [torch.randn(20, generator=g), None]
    x = torch.randn(*lead, 40, generator=g)
    flat = x.reshape(-1, 40)
    kernel = few_rows._LOADER.load()
    for w, s, b in zip(weights, scales, biases):
        got = few_rows.rows_linear(x, w, s, b)
        assert got.shape == (*lead, w.shape[0])
        assert torch.equal(got.reshape(-1, w.shape[0]), few_rows.rows_linear(flat, w, s, b))
    both = few_rows.rows_linear_stacked(x, weights, scales, biases)
    assert both.shape == (*lead, 32)
    none = torch.empty(0)
    parts = kernel.rows_linear_parts(x, weights, scales, [biases[0], none])
    for part, w, s, b in zip(parts, weights, scales, biases):
        assert part.is_contiguous() and torch.equal(part, few_rows.rows_linear(x, w, s, b))
    strided = torch.randn(2, 80, generator=g)[:, ::2]  # rows that are not contiguous
    assert torch.equal(
        few_rows.rows_linear(strided, weights[0], scales[0], biases[0]),
        few_rows.rows_linear(strided.contiguous(), weights[0], scales[0], biases[0]),
    )
    empty = few_rows.rows_linear(torch.randn(2, 0), torch.randn(5, 0), None, torch.arange(5.0))
    assert torch.equal(empty, torch.arange(5.0).expand(2, 5))


def test_stacked_products_refuse_matrices_that_do_not_stack():
    x = torch.randn(2, 8)
    w = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="share one dtype"):
        few_rows.rows_linear_stacked(x, [w, w.bfloat16()], [None, None], [None, None])
    with pytest.raises(RuntimeError, match="with x's K"):
        few_rows.rows_linear_stacked(x, [w, torch.randn(4, 9)], [None, None], [None, None])
    with pytest.raises(RuntimeError, match="one scale and one bias"):
        few_rows.rows_linear_stacked(x, [w, w], [None], [None, None])


def _layers(weights: str | None, hooked: bool = False) -> list[torch.nn.Module]:
    torch.manual_seed(4)
    layers = torch.nn.Sequential(*(torch.nn.Linear(24, n) for n in (24, 8, 8)))
    layers = quant.prepare_linears(layers, weights)
    if hooked:
        layers[1].register_forward_hook(lambda *a: None)
    return list(layers)


@pytest.mark.parametrize("weights", [None, "bf16", "int8"], ids=["fp32", "bf16", "int8"])
def test_stacked_step_products_equal_the_module_calls(weights, monkeypatch):
    """stacked_products: the modules' own outputs to the bit, each contiguous as its own call
    makes it (B = 3 rows, where a view of the stacked output would not be), from one kernel
    call; None where one product would not run on the kernel or has hooks."""
    monkeypatch.setattr(few_rows, "_kernel_faster", lambda x, w, b: True)
    calls = []
    compiled = few_rows._LOADER.load()
    real = compiled.rows_linear_parts
    monkeypatch.setattr(compiled, "rows_linear_parts", lambda *a: calls.append(1) or real(*a))
    layers = _layers(weights)
    x = torch.randn(3, 1, 24)
    with torch.inference_mode():
        got = few_rows.stacked_products(layers, x, few_rows.kernel_fits(x))
        want = [layer(x) for layer in layers]
        assert got is not None and len(calls) == 1
        for g, w in zip(got, want):
            assert g.is_contiguous() and torch.equal(g, w)
        assert few_rows.stacked_products(_layers(weights, hooked=True), x, True) is None
        assert few_rows.stacked_products(layers, x, False) is None
    if weights is None:  # a product the BLAS would run keeps its own call
        monkeypatch.setattr(few_rows, "_kernel_faster", lambda x, w, b: w.shape[0] != 8)
        with torch.inference_mode():
            assert few_rows.stacked_products(layers, x, True) is None
    mixed = _layers("int8")[:1] + _layers("bf16")[1:]
    with torch.inference_mode():
        assert few_rows.stacked_products(mixed, x, True) is None


@pytest.mark.parametrize("kernel_faster", [True, False])
def test_rows_linear_runs_where_the_kernel_measured_faster(monkeypatch, kernel_faster):
    """RowsLinear times the kernel against F.linear once per (rows, out, in) (the clock the
    attention backends' measured choice uses) and keeps the faster: with the timings made up,
    each side is chosen when it is the faster, the choice is listed, and a second call does
    not time again."""
    monkeypatch.setattr(few_rows, "_faster", {})
    timed = []
    ran = []
    compiled = few_rows._LOADER.load()
    real_kernel = compiled.rows_linear

    def kernel(*args):
        ran.append("kernel")
        return real_kernel(*args)

    def clock(fn):
        before = len(ran)
        fn()
        on_kernel = len(ran) > before
        timed.append("kernel" if on_kernel else "blas")
        return 1e-3 if on_kernel == kernel_faster else 2e-3

    monkeypatch.setattr(compiled, "rows_linear", kernel)
    monkeypatch.setattr(few_rows, "_clock", clock)
    layer = few_rows.few_row_linears(torch.nn.Sequential(torch.nn.Linear(40, 24)))[0]
    x = torch.randn(3, 40)
    with torch.inference_mode():
        got = layer(x)
        ran.clear()
        layer(x)
    assert timed == ["kernel", "blas"]  # once, on the first call
    assert few_rows.kernel_choices() == {(3, 24, 40): "kernel" if kernel_faster else "blas"}
    assert ran == (["kernel"] if kernel_faster else [])
    torch.testing.assert_close(got, torch.nn.functional.linear(x, layer.weight, layer.bias))


def test_quantize_int8_rounds_to_the_nearest_step():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(20, 50, generator=g) * torch.logspace(-3, 2, 20)[:, None]
    w[3] = 0.0  # an all-zero channel keeps a usable scale
    q, scale = quant.quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (20,)
    assert int(q.abs().max()) == 127 and float(scale[3]) == 1.0
    err = (quant.dequantize_int8(q, scale).double() - w.double()).abs()
    # half a step, plus float32 rounding of w / scale and of q * scale
    assert err.le(scale.double()[:, None] * (0.5 + 1e-6)).all()


def _dequantized_copy(model, reference):
    """``reference`` (an fp32 model) with each linear weight replaced by what ``model`` (same
    architecture, packed weights) holds: the fp32 model the packed one must equal."""
    want = copy.deepcopy(reference)
    packed = dict(model.named_modules())
    with torch.no_grad():
        for name, module in want.named_modules():
            if isinstance(module, torch.nn.Linear):
                module.weight = torch.nn.Parameter(packed[name].weight.clone())
    return want


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def folder(request, tmp_path_factory):
    return request.param, build(request.param, tmp_path_factory.mktemp(request.param))


@pytest.mark.parametrize("weights", ["bf16", "int8", "w8a16"])
def test_packed_model_equals_fp32_model_with_the_dequantized_weights(folder, weights):
    """Packing changes the weights (rounding to bf16, or to int8 steps) and nothing else: the
    logits equal those of the fp32 model holding the dequantized weights, up to float32
    rounding (logits of a few units; 1e-4 is ~100 ulps of the summation orders that differ)."""
    kind, path = folder
    fp32 = LOADERS[kind].load(path)
    packed = LOADERS[kind].load(path, weights=weights)
    kinds = {type(m) for m in packed.modules()}
    assert quant.PackedLinear in kinds and torch.nn.Linear not in kinds
    ids = torch.tensor([[5, 17, 230, 9, 2, 44, 61, 120]])
    with torch.inference_mode():
        got = packed(ids)
        want = _dequantized_copy(packed, fp32)(ids)
        plain = fp32(ids)
    # w8a16 also rounds each product's inputs to 1/65534 of the row's largest (the kernel's
    # integer sums): measured 3.4e-4 on these logits (gpt2), bounded at 1e-3
    torch.testing.assert_close(got, want, rtol=0, atol=1e-3 if weights == "w8a16" else 1e-4)
    # and the packing moved the logits far less than a broken layer would (by their whole
    # spread). Measured max shift / std of the logits: int8 0.068 (gpt2), 0.084 (llama), whose
    # 32-input channels make the steps coarse (max |w| / 127 over 32 draws); bf16 0.024 and
    # 0.035 (8 bits: 2^-9 relative per weight, over 2 layers and the output layer). The
    # bounds are twice those: a regression in the rounding shows, a broken layer is 10x over
    shift = float((got - plain).abs().max() / plain.std())
    assert shift < (0.07 if weights == "bf16" else 0.17)


@pytest.mark.parametrize("weights", [None, "bf16", "int8", "w8a16"])
def test_one_row_decoding_on_the_kernel_equals_the_full_forward(folder, weights):
    """Greedy decoding (one-row products on the kernel) gives the tokens a full forward pass
    over the whole sequence (F.linear) picks at every position."""
    kind, path = folder
    model = LOADERS[kind].load(path, weights=weights)
    prompt = torch.tensor([[5, 17, 230, 9]])
    out = model.generate(prompt, 12)
    with torch.inference_mode():
        logits = model(out)
    assert torch.equal(logits[0, 3:-1].argmax(-1), out[0, 4:])


def test_fp32_batch_one_greedy_tokens_equal_transformers(folder):
    kind, path = folder
    ours, hf = LOADERS[kind].load(path), transformers_model(path)
    prompt = torch.tensor([[5, 17, 230, 9, 2, 44]])
    mine = ours.generate(prompt, 40)
    with torch.no_grad():
        theirs = hf.generate(
            prompt, max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=EOS
        )
    assert torch.equal(mine, theirs)


def test_weights_is_validated(folder, tmp_path):
    kind, path = folder
    with pytest.raises(
        ValueError, match=r"weights must be None .*'bf16', 'int8' or 'w8a16'.*'int4'"
    ):
        LOADERS[kind].load(path, weights="int4")
    with pytest.raises(ValueError, match=r"pass dtype=torch.float32.*bfloat16"):
        LOADERS[kind].load(path, weights="int8", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"weights must be None, 'bf16', 'int8' or 'w8a16'"):
        multihead.models.load(path, weights=8)
    model = multihead.models.load(path, weights="int8")
    assert isinstance(model.lm_head, quant.PackedLinear) and model.lm_head.weights == "int8"


def test_weights_refused_for_bert(tiny_bert):
    with pytest.raises(ValueError, match=r"model_type 'bert' takes none.*weights='int8'"):
        multihead.models.load(tiny_bert, weights="int8")


def test_packed_layer_refuses_other_activation_dtypes():
    layer = quant.PackedLinear(torch.nn.Linear(8, 4), "int8")
    with pytest.raises(TypeError, match=r"takes float32 activations.*bfloat16"):
        layer(torch.zeros(1, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"weights must be 'bf16', 'int8' or 'w8a16'.*'fp8'"):
        quant.PackedLinear(torch.nn.Linear(8, 4), "fp8")


def test_quality_reports_perplexity_and_agreement(folder, tmp_path):
    """fp32 perplexity against transformers' own loss on the same windows of the same tokens;
    the packed formats' rows are their own perplexities and argmax agreement."""
    from multihead.bench.decode import quality

    kind, path = folder
    text = tmp_path / "held-out.txt"
    text.write_text("the movie was great, but the ending felt rushed and flat. " * 12)
    report = quality(path, text, say=lambda line: None)
    model = LOADERS[kind].load(path)
    ids = torch.tensor(model.tokenizer.encode(text.read_text()).ids)
    hf = transformers_model(path)
    nll, n = 0.0, 0
    window = min(256, model.max_positions)  # what quality uses: 128 (gpt2), 256 (llama)
    with torch.no_grad():
        for i in range(0, ids.numel() - 1, window):
            c = ids[i : i + window][None]
            if c.shape[1] < 2:
                continue
            loss = hf(c, labels=c).loss.double()
            nll, n = nll + float(loss) * (c.shape[1] - 1), n + c.shape[1] - 1
    assert report["tokens"] == n
    assert abs(report["fp32"]["perplexity"] - math.exp(nll / n)) < 1e-4 * math.exp(nll / n)
    for w in ("bf16", "int8"):
        row = report[w]
        assert 0.0 <= row["top1_agreement"] <= 1.0
        assert row["perplexity_vs_fp32"] == row["perplexity"] / report["fp32"]["perplexity"]


def test_pack_linears_packs_or_says_it_was_asked_for_nothing():
    """``pack_linears`` packs into a format; ``None`` (which packed nothing and only moved the
    layers onto the few-row kernel) warns with the name that does that job and still does
    it, the same parameters kept."""
    from multihead._deprecation import MultiheadDeprecationWarning

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4))
    weight = model[0].weight
    with pytest.warns(MultiheadDeprecationWarning, match=r"few_rows\.few_row_linears\(model\)"):
        quant.pack_linears(model, None)
    assert type(model[0]) is few_rows.RowsLinear and model[0].weight is weight
    packed = quant.pack_linears(torch.nn.Sequential(torch.nn.Linear(8, 4)), "int8")
    assert isinstance(packed[0], quant.PackedLinear)
    accepted = r"weights must be 'bf16', 'int8' or 'w8a16'\. Received: weights='fp8'"
    with pytest.raises(ValueError, match=accepted):
        quant.pack_linears(model, "fp8")


def test_prepare_linears_is_packing_or_the_few_row_layers():
    """``prepare_linears(model, None)`` is ``few_row_linears`` (tying kept, no warning);
    with a format it is ``pack_linears``."""
    import warnings

    torch.manual_seed(0)
    embed = torch.nn.Embedding(5, 8)
    head = torch.nn.Linear(8, 5, bias=False)
    head.weight = embed.weight  # tied, as a decoder's output layer
    model = torch.nn.ModuleList([embed, head])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quant.prepare_linears(model, None)
    assert type(model[1]) is few_rows.RowsLinear and model[1].weight is model[0].weight
    packed = quant.prepare_linears(torch.nn.Sequential(torch.nn.Linear(8, 4)), "bf16")
    assert isinstance(packed[0], quant.PackedLinear) and packed[0].weights == "bf16"
