"""Which backends exist, what each can do, and how ``backend="auto"`` chooses among them.

A new backend is one file plus one ``Backend`` entry in ``BACKENDS``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from . import _half, flex, fused, reference, sdpa, tiled
from ._call import Call, exporting


@dataclass(frozen=True)
class Backend:
    name: str
    run: Callable[[Call], tuple[Tensor, Tensor | None]]
    unsupported: Callable[[Call], str | None]  # why this call cannot run here, or None


@dataclass(frozen=True)
class Choice:
    """The backend ``auto`` picked and, for every other backend, why it was not picked."""

    backend: str
    reasons: dict[str, str]

    def __str__(self) -> str:
        lines = [f"chosen: {self.backend}"]
        lines += [f"not {name}: {why}" for name, why in self.reasons.items()]
        return "\n".join(lines)


def _always(call: Call) -> str | None:
    return None


BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend("tiled", tiled.run, tiled.unsupported),
        Backend("sdpa", sdpa.run, sdpa.unsupported),
        Backend("reference", reference.run, _always),
        Backend("flex", flex.run, flex.unsupported),
        Backend("fused", fused.run, fused.unsupported),
    )
}


def _ranking(call: Call) -> tuple[list[str], str]:
    """Backends from fastest expected to slowest for this call, and why the first leads."""
    order, why = _ranking_without_fused(call)
    # the fused kernel leads only where it ran faster on this machine (fused.measured_faster);
    # never while tracing, where a measurement would be a data-dependent branch
    if _device(call) == "cpu" and not exporting() and not torch.compiler.is_compiling():
        rival = next(name for name in order if BACKENDS[name].unsupported(call) is None)
        if fused.measured_faster(call, BACKENDS[rival].run):
            return (
                ["fused", *order],
                f"it measured faster than {rival} on this machine for calls of this shape class",
            )
    return [*order, "fused"], why


def _ranking_without_fused(call: Call) -> tuple[list[str], str]:
    order, why = _ranking_without_flex(call)
    device = _device(call)
    if device == "cuda" and _structured(call) and flex.unsupported(call) is None:
        # FlexAttention generates one fused kernel that skips the mask's empty blocks, where
        # tiled's per-chunk torch ops would be many small kernel launches
        return ["flex", *order], "its one compiled kernel skips the blocks the mask hides"
    # not while exporting: measured_faster compares L with a threshold, and a symbolic L
    # would turn that comparison into a bound on the exported graph's length axis
    if (
        device == "cpu"
        and not exporting()
        and flex.measured_faster(call)
        and flex.unsupported(call) is None
    ):
        return (
            ["flex", *order],
            "its compiled kernel measured faster than tiled on long sliding windows "
            "(compiled once per shape, the compile time not counted)",
        )
    return [*order, "flex"], why


def _device(call: Call) -> str:
    """The device type the call runs on ("cpu", "cuda", ...); one place, so tests can stand
    in for a GPU."""
    return call.query.device.type


def _structured(call: Call) -> bool:
    """A mask or computed bias with structure to exploit (not a dense tensor, not plain causal)."""
    if call.bias is not None and call.bias.computed:
        return True
    return call.mask is not None and not call.mask.arbitrary and not sdpa.is_plain_causal(call)


def _ranking_without_flex(call: Call) -> tuple[list[str], str]:
    if exporting():
        return (
            ["reference", "sdpa", "tiled"],
            "an exported graph needs plain ops without data-dependent branches",
        )
    if call.return_weights:
        return ["tiled", "reference", "sdpa"], "it computes the output fused and weights by tile"
    if _device(call) != "cpu":
        return ["sdpa", "tiled", "reference"], "torch's fused kernels lead on accelerators"
    if _half.fast(call):
        return (
            ["tiled", "sdpa", "reference"],
            "its half-precision kernel runs the matmuls in bf16/fp16 on this CPU's native "
            "instructions; torch's CPU flash kernel computes half inputs in float32",
        )
    if call.bias is not None and call.bias.computed:
        return (
            ["tiled", "sdpa", "reference"],
            "it computes the score modifier tile by tile; the others need it as a dense "
            "(B, H, L, S) tensor",
        )
    if call.mask is None:
        return ["sdpa", "tiled", "reference"], "with no mask there is nothing to skip"
    if sdpa.is_plain_causal(call):
        return ["sdpa", "tiled", "reference"], "torch's is_causal kernel skips the same tiles"
    if call.mask.arbitrary:
        return ["sdpa", "tiled", "reference"], "an arbitrary dense mask has little to skip"
    return ["tiled", "sdpa", "reference"], "it skips the tiles the mask hides"


def explain(call: Call) -> Choice:
    order, why_first = _ranking(call)
    reasons: dict[str, str] = {}
    chosen = None
    for name in order:
        why = BACKENDS[name].unsupported(call)
        if why is not None:
            reasons[name] = why
        elif chosen is None:
            chosen = name
        else:
            reasons[name] = f"supported, but {chosen} is expected to be faster: {why_first}"
    assert chosen is not None, "the reference backend supports every call"
    return Choice(chosen, reasons)


def select(call: Call, backend: str) -> Backend:
    if not isinstance(backend, str) or (backend != "auto" and backend not in BACKENDS):
        raise ValueError(
            f"backend must be 'auto' or one of {sorted(BACKENDS)}. Received: backend={backend!r}"
        )
    if backend == "auto":
        return BACKENDS[explain(call).backend]
    chosen = BACKENDS[backend]
    why = chosen.unsupported(call)
    if why is not None:
        hint = " Use backend='auto' or backend='reference'." if call.return_weights else ""
        raise ValueError(
            f"backend {backend!r} cannot run this call: {why}.{hint} Received: backend={backend!r}"
        )
    return chosen
