"""The library on a CUDA device: every mask kind on every backend that runs there, against the
float64 reference computed on the CPU, with the same error rules as on the CPU (fp32 outputs
within 1e-5 and gradients within 1e-4; bf16 within twice the naive bf16 formula's error plus
one ulp), fully masked rows exactly 0, the module against ``torch.nn.MultiheadAttention`` on
the device, a compiled module, greedy decoding against transformers, and a training step with
``--precision auto``.

These run only where ``torch.cuda.is_available()`` (the CI machines have no GPU); the command
that ran them on a lent H100 is in docs/performance.md.
"""

from __future__ import annotations

import pytest
import torch
from helpers import MASK_KINDS, make_case, naive_attention, qkv

import multihead as mh
from multihead import masks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA_BACKENDS = ["auto", "reference", "sdpa", "tiled"]
SHAPE = (2, 4, 2, 67, 93, 32, 24)  # B, H, H_kv, L, S, D, D_v: odd lengths on purpose


@pytest.fixture(autouse=True)
def _exact_fp32(full_fp32):
    """Every test here in full fp32 (conftest.py's ``full_fp32``)."""


def _on(device, *tensors):
    return [t.detach().to(device).requires_grad_(t.requires_grad) for t in tensors]


@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("backend", CUDA_BACKENDS)
def test_fp32_on_cuda_against_the_float64_reference(backend, kind):
    b, h, h_kv, length_q, length_k, d, d_v = SHAPE
    q, k, v = qkv(b, h, h_kv, length_q, length_k, d, d_v, requires_grad=True)
    case = make_case(kind, b, h, length_q, length_k)
    ref = mh.attention(q, k, v, case.mask, backend="reference")
    grad_out = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad_out)
    gq, gk, gv = (t.detach().float().cuda().requires_grad_() for t in (q, k, v))
    got = mh.attention(gq, gk, gv, case.mask, backend=backend)
    assert got.device.type == "cuda" and got.dtype == torch.float32
    grads = torch.autograd.grad(got, (gq, gk, gv), grad_out.float().cuda())
    assert (got.double().cpu() - ref).abs().max() <= 1e-5
    for g, r in zip(grads, ref_grads):
        assert (g.double().cpu() - r).abs().max() <= 1e-4


@pytest.mark.parametrize("kind", ["none", "causal", "window_both", "lengths", "documents&causal"])
@pytest.mark.parametrize("backend", ["auto", "sdpa", "tiled"])
def test_bf16_on_cuda_within_twice_the_naive_error(backend, kind):
    b, h, h_kv, length_q, length_k, d, _ = SHAPE
    q, k, v = qkv(b, h, h_kv, length_q, length_k, d)
    case = make_case(kind, b, h, length_q, length_k)
    ref, _ = naive_attention(q, k, v, case.keep)
    lo = [t.to(torch.bfloat16) for t in (q, k, v)]
    naive_err = (naive_attention(*lo, case.keep)[0].double() - ref).abs().max()
    got = mh.attention(*(t.cuda() for t in lo), case.mask, backend=backend)
    assert got.dtype == torch.bfloat16
    ulp = torch.finfo(torch.bfloat16).eps * ref.abs().max()
    assert (got.double().cpu() - ref).abs().max() <= 2 * naive_err + ulp


@pytest.mark.parametrize("backend", CUDA_BACKENDS)
def test_fully_masked_rows_are_exact_zeros_on_cuda(backend):
    q, k, v = _on("cuda", *qkv(2, 2, 2, 6, 4, 8, dtype=torch.float32, requires_grad=True))
    mask = masks.causal() & masks.lengths(torch.tensor([4, 0], device="cuda"))
    out = mh.attention(q, k, v, mask, backend=backend)
    out.sum().backward()
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.equal(out[0, :, :2], torch.zeros_like(out[0, :, :2]))
    assert torch.equal(q.grad[1], torch.zeros_like(q.grad[1]))
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_module_on_cuda_equals_torch_multihead_attention():
    torch.manual_seed(0)
    theirs = torch.nn.MultiheadAttention(64, 4, batch_first=True).cuda().eval()
    ours = mh.MultiHeadAttention.from_torch(theirs).cuda().eval()
    x = torch.randn(3, 37, 64, device="cuda")
    pad = torch.arange(37, device="cuda")[None] >= torch.tensor([[37], [20], [5]], device="cuda")
    want, _ = theirs(x, x, x, key_padding_mask=pad, need_weights=False)
    got = ours(x, mask=masks.key_padding(~pad))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_compiled_module_on_cuda_equals_eager():
    torch.manual_seed(0)
    module = mh.MultiHeadAttention(64, 4, num_kv_heads=2).cuda().eval()
    compiled = torch.compile(module, fullgraph=True, dynamic=True)
    for b, length in ((2, 33), (3, 70)):
        x = torch.randn(b, length, 64, device="cuda")
        lengths = torch.randint(1, length + 1, (b,), device="cuda")
        mask = masks.causal() & masks.lengths(lengths)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x, mask=mask), module(x, mask=mask),
                                       rtol=0, atol=1e-5)  # fmt: skip


def test_greedy_decoding_on_cuda_gives_the_tokens_of_transformers(tmp_path):
    import transformers

    from multihead.models import gpt2

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=500, n_positions=128, n_embd=64, n_layer=2,
                                     n_head=4, bos_token_id=499, eos_token_id=499)  # fmt: skip
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).cuda().eval()
    ours = gpt2.load(tmp_path).cuda()
    prompt = torch.tensor([[5, 17, 230, 9, 2, 44]], device="cuda")
    with torch.no_grad():
        want = theirs.generate(prompt, max_new_tokens=30, do_sample=False, eos_token_id=None,
                               pad_token_id=0)  # fmt: skip
    assert torch.equal(ours.generate(prompt, 30), want)


def test_a_training_step_with_precision_auto_on_cuda():
    """auto on a GPU: bf16 matmuls are many times faster, so the step is timed in both
    precisions; whichever it picks, the run trains (the loss falls) and says what it ran."""
    from multihead.apps.loop import Dist, TrainConfig, fit

    torch.manual_seed(0)
    x, y = torch.randn(512, 64), torch.randn(512)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 1))
    cfg = TrainConfig(epochs=3, batch_size=64, lr=1e-2, precision="auto", progress=False)
    device = torch.device("cuda")

    def loss_fn(m, batch):
        return (m(batch[0])[:, 0].float() - batch[1]).pow(2)

    collate = lambda i: (x[i].to(device), y[i].to(device))  # noqa: E731
    result = fit(model, 512, collate, loss_fn, cfg, Dist(device=device))
    assert result.precision in ("fp32", "bf16")
    assert result.precision_choice.step_seconds is not None  # bf16 matmuls are faster on a GPU
    assert result.epoch_losses[-1] < result.epoch_losses[0]


def test_a_mask_holding_cuda_tensors_draws_itself():
    """print(mask) of a combined mask whose parts live on different devices (causal needs
    none, the lengths are on the GPU): the picture is computed on one device."""
    mask = masks.causal() & masks.lengths(torch.tensor([3, 0], device="cuda"))
    picture = [line.strip() for line in repr(mask).splitlines()]
    # one picture per batch row: row 0 sees its 3 keys, row 1 (length 0) sees none
    first, second = picture.index("batch 0:"), picture.index("batch 1:")
    assert all(line == "###..." for line in picture[first + 1 : second])
    assert all(set(line) == {"."} for line in picture[second + 1 :])
