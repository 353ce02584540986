"""The training loop shared by the applications: seeded batches, AdamW with warm-up, mixed
precision, ``torch.compile`` and DistributedDataParallel under ``torchrun``.

Every process draws the same seeded order of examples and cuts each *global* batch into one
contiguous slice per process. Each process's loss is its slice's summed per-example loss times
``world_size / global_batch``; DDP averages gradients over processes, so the update is the one a
single process computes on the whole global batch (what the two-process test checks).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor, nn

from .precision import PrecisionChoice, choose

__all__ = ["PRECISIONS", "Dist", "FitResult", "TrainConfig", "autocast", "fit", "setup"]

PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class Dist:
    """Where this process runs: its rank among ``world`` processes and its device."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()


def setup() -> Dist:
    """Join the process group when started by ``torchrun`` (WORLD_SIZE > 1), else run alone.

    gloo on CPU, nccl on CUDA; on CUDA each process takes the GPU of its LOCAL_RANK.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local_rank}" if cuda else "cpu")
    if world <= 1:
        return Dist(device=device)
    import torch.distributed as dist

    if cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if cuda else "gloo")
    return Dist(dist.get_rank(), dist.get_world_size(), local_rank, device)


def teardown(info: Dist) -> None:
    if info.world > 1 and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def autocast(precision: str, device: torch.device) -> AbstractContextManager:
    """bf16 autocast on CPU; bf16 or fp16 on CUDA; nothing for fp32.

    Attention keeps its softmax statistics (running max and log-sum-exp) in fp32 for bf16 and
    fp16 inputs on every backend, so only the matmul inputs are rounded.
    """
    if precision not in PRECISIONS:
        raise ValueError(
            f"precision must be one of {', '.join(PRECISIONS)}. Received: precision={precision!r}"
        )
    if precision == "fp32":
        return nullcontext()
    if precision == "fp16" and device.type == "cpu":
        raise ValueError(
            "fp16 autocast is for CUDA; on CPU use --precision bf16. Received: precision='fp16' "
            "on cpu"
        )
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device.type, dtype=dtype)


@dataclass
class TrainConfig:
    """How to train. ``batch_size`` is the global batch, split over all processes."""

    epochs: int = 1
    batch_size: int = 32
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup: float = 0.1  # fraction of all steps with a linearly rising learning rate
    grad_clip: float | None = 1.0
    precision: str = "fp32"  # fp32, bf16, fp16, or auto (bf16 where it measures faster)
    compile: bool = False
    compile_backend: str = "inductor"  # tests use "aot_eager": same graphs, no C++ build
    seed: int = 0
    max_steps: int | None = None  # stop early (smoke tests, throughput runs)
    progress: bool = True


@dataclass
class FitResult:
    """What ``fit`` measured: the loss after every step (averaged over processes), the epoch
    means, the wall time, the throughput and, with ``compile``, the graph breaks (from
    ``torch._dynamo.explain`` on the first batch) and the graphs compiled over the run (1
    when one graph served every batch shape; more are recompilations)."""

    losses: list[float]
    epoch_losses: list[float]
    steps: int
    samples: int
    seconds: float
    samples_per_s: float
    first_step_s: float
    compile: dict[str, Any] | None = None
    precision: str = "fp32"  # what autocast ran under (``auto`` resolved)
    # how ``auto`` was resolved (the timed steps), when it was asked for
    precision_choice: PrecisionChoice | None = None

    def summary(self) -> dict[str, Any]:
        out = {
            "steps": self.steps,
            "samples": self.samples,
            "train_seconds": round(self.seconds, 3),
            "samples_per_s": round(self.samples_per_s, 2),
            "first_step_s": round(self.first_step_s, 3),
            "epoch_losses": [round(x, 6) for x in self.epoch_losses],
            "final_loss": round(self.losses[-1], 6) if self.losses else None,
            "precision": self.precision,
        }
        if self.compile is not None:
            out["compile"] = self.compile
        return out


def _explain(step: Callable[..., Tensor], model: nn.Module, batch: Any) -> dict[str, Any]:
    """Graph count and every graph break with its reason, from ``torch._dynamo.explain``."""
    import torch._dynamo

    explained = torch._dynamo.explain(step)(model, batch)
    reasons = []
    for r in explained.break_reasons:
        frame = r.user_stack[-1] if r.user_stack else None
        where = f"{os.path.basename(frame.filename)}:{frame.lineno}" if frame else "?"
        reasons.append({"reason": str(r.reason).splitlines()[0][:300], "where": where})
    torch._dynamo.reset()
    return {
        "graphs": explained.graph_count,
        "graph_breaks": explained.graph_break_count,
        "break_reasons": reasons,
    }


def _batches(count: int, size: int, seed: int, lengths: Sequence[int] | None) -> list[Tensor]:
    """Seeded global batches of example indices; the same on every process."""
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(count, generator=generator)
    if lengths is None:
        return list(order.split(size))
    key = torch.as_tensor(lengths)
    batches = []
    for pool in order.split(size * 50):
        pool = pool[torch.argsort(key[pool], stable=True)]
        batches.extend(pool.split(size))
    shuffle = torch.randperm(len(batches), generator=generator).tolist()
    return [batches[i] for i in shuffle]


@dataclass
class _Run:
    """What one ``fit`` call carries from step to step."""

    model: nn.Module  # the caller's model
    train_model: nn.Module  # the same, or its DDP wrapper
    optimizer: torch.optim.Optimizer
    schedule: torch.optim.lr_scheduler.LRScheduler
    step_loss: Callable[[nn.Module, Any], Tensor]  # the eager step (what _explain traces)
    step_fn: Callable[[nn.Module, Any], Tensor]  # the same, or it compiled
    scaler: torch.amp.GradScaler | None
    total: int  # optimizer steps to run
    losses: list[float] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    compile_report: dict[str, Any] | None = None
    graphs_before: int = 0  # dynamo's graph count when the compiled step started
    ready: tuple[Tensor, Any] | None = None  # a global batch already collated (auto's probe)

    @property
    def step(self) -> int:
        return len(self.losses)


def _check_sizes(count: int, config: TrainConfig, info: Dist) -> None:
    if count < info.world:
        raise ValueError(
            f"need at least one training example per process. Received: {count} examples for "
            f"{info.world} processes"
        )
    if config.batch_size < info.world:
        raise ValueError(
            f"the global batch must give every process at least one example. Received: "
            f"batch_size={config.batch_size}, processes={info.world}"
        )


def _optimizer(
    model: nn.Module, config: TrainConfig, param_groups: Sequence[dict[str, Any]] | None
) -> torch.optim.Optimizer:
    groups = param_groups or [{"params": [p for p in model.parameters() if p.requires_grad]}]
    groups = [
        {**{k: v for k, v in g.items() if k != "lr_scale"}, "lr": config.lr * g.get("lr_scale", 1)}
        for g in groups
    ]
    return torch.optim.AdamW(groups, lr=config.lr, weight_decay=config.weight_decay)


def _total_steps(count: int, config: TrainConfig, info: Dist) -> int:
    per_epoch = count // config.batch_size + (count % config.batch_size >= info.world)
    total = per_epoch * config.epochs
    return total if config.max_steps is None else min(total, config.max_steps)


def _schedule(optimizer: torch.optim.Optimizer, config: TrainConfig, total: int):
    """Linear warm-up over ``config.warmup`` of the steps, then linear decay to 0."""
    warm = max(1, int(config.warmup * total))
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / warm, max(0.0, (total - s) / max(1, total - warm)))
    )


def _start(
    model: nn.Module,
    count: int,
    loss_fn: Callable[[nn.Module, Any], Tensor],
    config: TrainConfig,
    info: Dist,
    param_groups: Sequence[dict[str, Any]] | None,
) -> _Run:
    torch.manual_seed(config.seed)
    model.to(info.device).train()
    train_model: nn.Module = model
    if info.world > 1:
        from torch.nn.parallel import DistributedDataParallel

        ids = [info.device.index] if info.device.type == "cuda" else None
        train_model = DistributedDataParallel(model, device_ids=ids)
    optimizer = _optimizer(model, config, param_groups)
    total = _total_steps(count, config, info)

    def step_loss(m: nn.Module, batch: Any) -> Tensor:
        with autocast(config.precision, info.device):
            return loss_fn(m, batch).float().sum()

    step_fn: Callable[[nn.Module, Any], Tensor] = step_loss
    if config.compile:
        # dynamic: padded batches change length from batch to batch, one graph serves them all
        step_fn = torch.compile(step_loss, backend=config.compile_backend, dynamic=True)
    scaler = torch.amp.GradScaler("cuda") if config.precision == "fp16" else None
    schedule = _schedule(optimizer, config, total)
    return _Run(model, train_model, optimizer, schedule, step_loss, step_fn, scaler, total)


def _update(run: _Run, loss: Tensor, config: TrainConfig) -> None:
    """Backward, clip, optimizer and schedule step (scaled for fp16)."""
    run.optimizer.zero_grad(set_to_none=True)
    if run.scaler is not None:
        run.scaler.scale(loss).backward()
        run.scaler.unscale_(run.optimizer)
    else:
        loss.backward()
    if config.grad_clip is not None:
        nn.utils.clip_grad_norm_(run.model.parameters(), config.grad_clip)
    if run.scaler is not None:
        run.scaler.step(run.optimizer)
        run.scaler.update()
    else:
        run.optimizer.step()
    run.schedule.step()


def _train_step(
    run: _Run, global_batch: Tensor, collate: Callable[[Tensor], Any], config: TrainConfig,
    info: Dist,
) -> float:  # fmt: skip
    t0 = time.perf_counter()
    if run.ready is not None and torch.equal(run.ready[0], global_batch):
        batch = run.ready[1]
    else:
        batch = collate(global_batch.tensor_split(info.world)[info.rank])
    run.ready = None
    if config.compile and run.compile_report is None and info.main:
        run.compile_report = _explain(run.step_loss, run.model, batch)
        run.graphs_before = _graphs_compiled()
    # scaled so that DDP's average over processes is the global batch's mean
    loss = run.step_fn(run.train_model, batch) * (info.world / len(global_batch))
    _update(run, loss, config)
    value = loss.detach() / info.world
    if info.world > 1:
        torch.distributed.all_reduce(value)
    run.losses.append(float(value))
    run.times.append(time.perf_counter() - t0)
    run.sizes.append(len(global_batch))
    return run.losses[-1]


def _epoch_batches(
    run: _Run, count: int, config: TrainConfig, info: Dist, epoch: int,
    lengths: Sequence[int] | None,
) -> list[Tensor]:  # fmt: skip
    """This epoch's global batches, each with at least one example per process, cut at the
    step budget."""
    batches = _batches(count, config.batch_size, config.seed + epoch, lengths)
    batches = [b for b in batches if len(b) >= info.world]
    return batches[: max(0, run.total - run.step)]


def _graphs_compiled() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _step_timer(
    model: nn.Module, batch: Any, loss_fn: Callable[[nn.Module, Any], Tensor], device: torch.device
) -> Callable[[str], float]:
    """A function timing one forward and backward pass of ``model`` on ``batch`` under a
    precision's autocast, for ``precision.choose``. It leaves no trace: the gradients are
    dropped, the random state (dropout) and the buffers (running statistics) are put back, and
    no optimizer step is taken."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def once(precision: str) -> float:
        cpu_rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        buffers = [(b, b.detach().clone()) for b in model.buffers()]
        model.train()
        sync()
        start = time.perf_counter()
        with autocast(precision, device):
            loss = loss_fn(model, batch).float().sum()
        loss.backward()
        sync()
        seconds = time.perf_counter() - start
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, device)
        return seconds

    return once


def _resolve_auto(
    model: nn.Module, batch: Any, loss_fn: Callable[[nn.Module, Any], Tensor], info: Dist
) -> PrecisionChoice:
    """``precision="auto"`` resolved by timing the model's step (``precision.choose``). Under
    ``torchrun`` rank 0 decides and every process takes its choice: processes timing at once
    on one machine could disagree."""
    choice = None
    if info.main:
        model.to(info.device)
        choice = choose("auto", info.device, time_step=_step_timer(model, batch, loss_fn,
                                                                   info.device))  # fmt: skip
    if info.world > 1:
        shared = [choice]
        torch.distributed.broadcast_object_list(shared, src=0)
        choice = shared[0]
    assert choice is not None  # rank 0 always decides
    return choice


def _result(run: _Run, epoch_losses: list[float], seconds: float, precision: str) -> FitResult:
    if run.compile_report is not None:  # 1 when one graph served every batch shape
        run.compile_report["compiled_graphs"] = _graphs_compiled() - run.graphs_before
    # throughput without the first steps, which pay for compilation and warm-up
    times, sizes = run.times, run.sizes
    skip = min(2, max(0, len(times) - 1))
    steady = sum(times[skip:]) or float("nan")
    return FitResult(
        run.losses,
        epoch_losses,
        run.step,
        sum(sizes),
        seconds,
        sum(sizes[skip:]) / steady if times else 0.0,
        times[0] if times else 0.0,
        run.compile_report,
        precision,
    )


def fit(
    model: nn.Module,
    count: int,
    collate: Callable[[Tensor], Any],
    loss_fn: Callable[[nn.Module, Any], Tensor],
    config: TrainConfig,
    info: Dist,
    *,
    param_groups: Sequence[dict[str, Any]] | None = None,
    lengths: Sequence[int] | None = None,
    desc: str = "train",
    after_epoch: Callable[[int], None] | None = None,
) -> FitResult:
    """Train ``model`` in place on ``count`` examples.

    Args:
        count: N, the number of training examples; batches are index tensors into them.
        collate: indices (n,) -> a batch on ``info.device`` (whatever ``loss_fn`` takes).
        loss_fn: (model, batch) -> per-example losses (n,), computed in the forward pass.
        config: how to train; ``precision="auto"`` is resolved here by measurement
            (``precision.choose``) and the result's ``precision`` says what ran.
        param_groups: AdamW parameter groups (e.g. a larger learning rate for a new head),
            each with an optional ``lr_scale``; default: all parameters at ``config.lr``.
        lengths: each example's length; when given, batches hold examples of similar length
            (sorted within pools of 50 batches, batch order shuffled), so less padding is
            computed.
        after_epoch: called with the 1-based epoch after each epoch's last step, on every
            process (model selection on a validation set).
    """
    from tqdm.auto import tqdm

    _check_sizes(count, config, info)
    choice = ready = None
    if config.precision == "auto":
        # timed on the first batch, which the first step then takes as collated
        first = next(b for b in _batches(count, config.batch_size, config.seed, lengths)
                     if len(b) >= info.world)  # fmt: skip
        ready = (first, collate(first.tensor_split(info.world)[info.rank]))
        choice = _resolve_auto(model, ready[1], loss_fn, info)
        config = replace(config, precision=choice.precision)
    run = _start(model, count, loss_fn, config, info, param_groups)
    run.ready = ready
    epoch_losses: list[float] = []
    start = time.perf_counter()
    for epoch in range(config.epochs):
        batches = _epoch_batches(run, count, config, info, epoch, lengths)
        if not batches:
            break
        first = run.step
        bar = tqdm(batches, desc=f"{desc} epoch {epoch + 1}/{config.epochs}", unit="step",
                   disable=not (config.progress and info.main), leave=False)  # fmt: skip
        for global_batch in bar:
            loss = _train_step(run, global_batch, collate, config, info)
            if info.main:
                bar.set_postfix(loss=f"{loss:.4f}")
        bar.close()
        epoch_losses.append(sum(run.losses[first:]) / (run.step - first))
        if after_epoch is not None:
            after_epoch(epoch + 1)
        if run.step >= run.total:
            break
    result = _result(run, epoch_losses, time.perf_counter() - start, config.precision)
    result.precision_choice = choice
    return result
