"""The shared training loop: two processes under torchrun equal one process with the same
global batch, bf16 autocast, the compiled train step and its graph-break report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import multihead as mh
from multihead.apps.loop import Dist, TrainConfig, _batches, autocast, fit
from multihead.cli import main

ROOT = Path(__file__).resolve().parents[2]


def _train(out: Path, processes: int) -> None:
    # fp32 asked for: "auto" times the matmuls, and a loaded machine (or one thread per
    # process) can make the two runs choose differently
    args = ["train", "crossmodal", "--quick", "--max-steps", "3", "--no-baselines",
            "--no-progress", "--precision", "fp32", "--out", str(out)]  # fmt: skip
    if processes == 1:  # in this process: the same code path without a second interpreter
        assert main(args) == 0
        return
    args = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}",
            "-m", "multihead.cli", *args]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    done = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]


def test_two_processes_equal_one_with_the_same_global_batch(tmp_path):
    """DDP with gloo: each process takes half of every global batch of 32 (the cross-modal
    model: self-attention over the question, cross-attention to the patches); after 3 AdamW
    steps every parameter equals the single-process run within 1e-5 (only the order of the
    gradient sums differs).

    Except the key projections' biases: their true gradient is exactly 0 (a shift of every
    score of a query by q . b does not change the softmax), so what they get is rounding noise,
    which Adam divides by its own size into steps of about lr = 2e-3 in a direction set by the
    noise. They are held to their own bound instead: at most 3 steps of lr from the one-process
    run.
    """
    _train(tmp_path / "one", 1)
    _train(tmp_path / "two", 2)
    one = load_file(str(tmp_path / "one" / "model" / "model.safetensors"))
    two = load_file(str(tmp_path / "two" / "model" / "model.safetensors"))
    assert one.keys() == two.keys()
    noise = {k for k in one if k.endswith("k_proj.bias")}
    assert noise  # the exemption names real tensors
    worst = max((one[k] - two[k]).abs().max().item() for k in one.keys() - noise)
    assert worst <= 1e-5, worst
    assert all((one[k] - two[k]).abs().max() <= 3 * 2e-3 for k in noise)
    metrics = (tmp_path / "two" / "metrics.json").read_text()
    assert '"processes": 2' in metrics and '"steps": 3' in metrics
    spec = json.loads((tmp_path / "one" / "model" / "config.json").read_text())["model"]
    torch.manual_seed(0)  # the run's seed: its initial weights, which 3 steps must have moved
    initial = mh.io.build(spec)
    moved = max((one[k] - v).abs().max().item() for k, v in initial.state_dict().items())
    assert moved > 1e-4


def _toy(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), mh.FeedForward(16, 24), nn.Linear(16, 1))


def _fit(model: nn.Module, **config) -> list[float]:
    torch.manual_seed(1)
    x, y = torch.randn(40, 6), torch.randn(40)

    def loss_fn(m, batch):
        xb, yb = batch
        return (m(xb)[:, 0].float() - yb).pow(2)

    cfg = TrainConfig(epochs=2, batch_size=8, lr=1e-2, progress=False, **config)
    return fit(model, 40, lambda i: (x[i], y[i]), loss_fn, cfg, Dist())


def test_bf16_autocast_trains_close_to_fp32():
    fp32 = _fit(_toy())
    bf16 = _fit(_toy(), precision="bf16")
    assert bf16.steps == fp32.steps == 10
    # bf16 rounds matmul inputs to 8 bits of mantissa (relative 2^-8 = 0.4%): losses follow
    # fp32 within a few percent, and they are not identical (autocast was on)
    assert bf16.losses != fp32.losses
    for a, b in zip(fp32.losses, bf16.losses):
        assert abs(a - b) <= 0.05 * a + 1e-3


def test_compiled_step_equals_eager_and_reports_graph_breaks():
    """aot_eager runs the same captured graphs as inductor without building C++; the compiled
    step's losses equal eager ones to fp32 rounding, and explain counts the graphs."""
    eager = _fit(_toy())
    compiled = _fit(_toy(), compile=True, compile_backend="aot_eager")
    for a, b in zip(eager.losses, compiled.losses):
        assert abs(a - b) <= 1e-5 * max(1.0, a)
    assert compiled.compile == {
        "graphs": 1,
        "graph_breaks": 0,
        "break_reasons": [],
        "compiled_graphs": 1,  # every batch has the same shape here: no recompilation
    }


class _ReadsHost(nn.Module):
    def forward(self, x):
        return x * int(x.abs().max())  # a host read: dynamo cannot trace .item()


def test_graph_breaks_are_reported_with_their_reason():
    from multihead.apps.loop import _explain

    model = nn.Sequential(nn.Linear(8, 8), _ReadsHost(), nn.Linear(8, 1))
    report = _explain(lambda m, x: m(x).sum(), model, torch.randn(2, 5, 8))
    assert report["graph_breaks"] >= 1 and report["graphs"] >= 2
    assert any(
        "item()" in r["reason"] and r["where"].startswith("test_loop.py")
        for r in report["break_reasons"]
    )


def test_compiled_forecaster_step_has_no_break_in_the_positions():
    """The sinusoidal encoding's range checks read positions on the host (int(tensor.max()));
    they are skipped while compiling, as while exporting, so the compiled train step of the
    forecaster breaks nowhere in positional.py (it did 7 times before), while the eager
    module still checks."""
    from multihead.apps import forecast
    from multihead.apps.loop import _explain

    torch.manual_seed(0)
    model = forecast.CausalForecaster(4, embed_dim=8, num_heads=2, num_layers=1, ff_dim=16,
                                      linear_lags=6)  # fmt: skip
    report = _explain(lambda m, x: m(x).pow(2).sum(), model, torch.randn(2, 12, 2))
    assert report["graphs"] >= 1
    assert not [r for r in report["break_reasons"] if r["where"].startswith("positional.py")]
    with pytest.raises(ValueError, match=r"positions must be >= 0"):
        mh.SinusoidalPositionalEncoding(8)(torch.zeros(1, 3, 8), torch.tensor([0, -1, 2]))


def test_batches_are_shared_and_bucketed():
    plain = _batches(103, 10, seed=4, lengths=None)
    assert [len(b) for b in plain] == [10] * 10 + [3]
    assert sorted(torch.cat(plain).tolist()) == list(range(103))
    assert all(torch.equal(a, b) for a, b in zip(plain, _batches(103, 10, 4, None)))
    lengths = torch.randint(1, 100, (500,)).tolist()
    bucketed = _batches(500, 20, seed=4, lengths=lengths)
    assert sorted(torch.cat(bucketed).tolist()) == list(range(500))
    spread = sum(max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in bucketed)
    assert spread < 0.25 * sum(99 - 1 for _ in bucketed)  # similar lengths share a batch


def test_precision_errors():
    with pytest.raises(ValueError, match=r"fp16 autocast is for CUDA; on CPU use --precision bf16"):
        autocast("fp16", torch.device("cpu"))
    with pytest.raises(
        ValueError, match=r"precision must be one of fp32, bf16, fp16. Received: precision='int8'"
    ):
        autocast("int8", torch.device("cpu"))


def test_optional_dependencies_stay_lazy():
    code = (
        "import sys, multihead, multihead.apps, multihead.io\n"
        "heavy = ('sklearn', 'statsmodels', 'vaderSentiment', 'matplotlib', 'safetensors')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_option_errors(tmp_path):
    from multihead.apps import Options, run

    with pytest.raises(ValueError, match=r"epochs must be a positive int. Received: epochs=0"):
        Options(out=tmp_path, epochs=0)
    with pytest.raises(ValueError, match=r"precision must be one of auto, fp32, bf16, fp16"):
        Options(out=tmp_path, precision="fp8")
    with pytest.raises(ValueError, match=r"task must be one of sentiment, forecast, crossmodal"):
        run("translation", Options(out=tmp_path))


def test_compiled_forecaster_step_has_no_graph_break_at_all():
    """Attention itself must not cut a compiled graph: the NaN rule's host-side check and the
    flex backend's availability probe are skipped while compiling (both broke the forecaster's
    compiled step before: 3 breaks at flex.py, 1 at _nonfinite.py)."""
    from multihead.apps import forecast
    from multihead.apps.loop import _explain

    torch.manual_seed(0)
    model = forecast.CausalForecaster(4, embed_dim=8, num_heads=2, num_layers=2, ff_dim=16,
                                      linear_lags=6)  # fmt: skip
    report = _explain(lambda m, x: m(x).pow(2).sum(), model, torch.randn(2, 12, 2))
    assert report == {"graphs": 1, "graph_breaks": 0, "break_reasons": []}
