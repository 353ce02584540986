"""The blocks active in this context (``capture``, ``ablate``, ``knockout``, ``patch``,
``compress``) and the ``Plan`` they make for one attention call.

Each block knows the layers of the model it was opened on (``owner``: module -> layer index).
For a call from a module, ``plan_for`` gathers every active block that covers the module's
layer into one ``Plan``, so the attention asks the kernel once for what all of them need
together. ``capture.py`` and ``edits.py`` open and close blocks; the two readers of plans
(``MultiHeadAttention`` and the transformers bridge's attention function) hand each plan to
``run_plan`` (``apply.py``), which hands results back through ``Capture``'s methods.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ..kv import LayerState, Policy
from ..masks import Mask
from ..stats import KEY_STATS

__all__ = [
    "Block",
    "Capture",
    "Compression",
    "Edit",
    "Plan",
    "activate",
    "active",
    "plan_for",
    "route",
]


@dataclass(eq=False)
class Block:
    """What every block shares: the layers it covers and the model's layer of each module.

    Attributes:
        layers: the chosen layer indices (None: all), counted from 0 as in the model's config.
        num_layers: how many self-attention layers the model has.
    """

    layers: list[int] | None
    num_layers: int
    _owner: dict[nn.Module, int] = field(default_factory=dict, repr=False)
    _model: nn.Module | None = field(default=None, repr=False)

    def layer_of(self, module: nn.Module) -> int | None:
        layer = self._owner.get(module)
        if layer is None or (self.layers is not None and layer not in self.layers):
            return None
        return layer


@dataclass(eq=False)
class Capture(Block):
    """What ``capture`` records.

    Attributes:
        layers: the chosen layer indices (None: all), counted from 0 as in the model's config.
        heads: the chosen query heads in the order given (None: all).
        num_layers: how many self-attention layers the model has.
        weights: ``{layer: Tensor (B, len(heads), L, S)}``, the softmax weights of the last
            forward that ran the layer (before dropout, detached from autograd); empty when
            statistics were asked for instead.
        stats: ``{layer: {name: Tensor}}``, the statistics asked for (``capture``'s
            ``stats``): key_mass and window_mass (B, h, S), entropy (B, h, L), head_mean
            (B, L, S), detached.
        window: the query rows window_mass sums.
        accumulate: key statistics are summed over the calls of a layer (zero-extended as the
            key axis grows), the others keep the last call.
        keep_values: also keep each recorded call's values (B, H_kv, S, D_v) in ``values``
            (``multihead.inspect.attribute`` weighs each key by what its value carries).
    """

    heads: list[int] | None = None
    weights: dict[int, Tensor] = field(default_factory=dict)
    stats: dict[int, dict[str, Tensor]] = field(default_factory=dict)
    stat_names: tuple[str, ...] = ()
    window: int | None = None
    accumulate: bool = False
    keep_values: bool = False
    values: dict[int, Tensor] = field(default_factory=dict)

    def record(self, layer: int, weights: Tensor, values: Tensor | None = None) -> None:
        self.weights[layer] = weights.detach()
        if self.keep_values and values is not None:
            self.values[layer] = values.detach()

    def record_stats(self, layer: int, found: dict[str, Tensor]) -> None:
        kept = self.stats.setdefault(layer, {})
        for name, value in found.items():
            value = value.detach()
            old = kept.get(name)
            if self.accumulate and name in KEY_STATS and old is not None:
                value = _summed(old, value, layer, name)
            kept[name] = value


def _summed(old: Tensor, new: Tensor, layer: int, name: str) -> Tensor:
    """``old + new`` per key position, the shorter one zero-extended along the key axis."""
    if old.shape[:-1] != new.shape[:-1]:
        raise ValueError(
            f"accumulate sums {name} of layer {layer} over calls of the same batch and heads; "
            f"this call has another. Received: {tuple(old.shape)} then {tuple(new.shape)}"
        )
    size = max(old.shape[-1], new.shape[-1])
    total = torch.zeros(*new.shape[:-1], size, dtype=new.dtype, device=new.device)
    total[..., : old.shape[-1]] += old
    total[..., : new.shape[-1]] += new
    return total


@dataclass(eq=False)
class Edit(Block):
    """What ``ablate``, ``knockout`` or ``patch`` changes.

    Attributes:
        kind: "ablate", "knockout" or "patch".
        scales: ablate: ``{layer: Tensor (H,)}``, one factor per head (1 where unchanged; it
            may carry a gradient).
        mask: knockout: the ``masks.knockout`` mask, joined to the model's in each call.
        heads: patch: the captured heads.
        source: patch: the ``Capture`` whose weights replace the computed ones.
        targets: ablate, patch: the (layer, head) pairs the block decides (nested blocks of
            the same kind may not share one).
        calls: knockout: the covered calls it was joined to so far.
        reached: knockout: whether one of them held a named query row and a named key.
    """

    kind: str = "ablate"
    scales: dict[int, Tensor] = field(default_factory=dict)
    mask: Mask | None = None
    heads: list[int] | None = None
    source: Capture | None = None
    targets: frozenset[tuple[int, int]] = frozenset()
    calls: int = 0
    reached: bool = False


@dataclass(eq=False)
class Compression(Block):
    """What ``compress`` yields, filled as the model runs.

    Attributes:
        policy: the ``multihead.kv`` policy.
        states: ``{layer: LayerState}``, each layer's compressed cache (of the last call that
            started a cache: the prompt of a ``generate``).
    """

    policy: Policy | None = None
    states: dict[int, LayerState] = field(default_factory=dict)
    _caches: dict[nn.Module, Any] = field(default_factory=dict, repr=False)
    # runs each call of a covered layer while the block is open: (module, query, key, value,
    # mask, bias, scale, dropout) -> output in the caller's layout. The block's opener sets it
    # (the transformers bridge: ``hf.compressing.attend``, which keeps that model's cache)
    layer_calls: Callable[..., Tensor] | None = field(default=None, repr=False)

    @property
    def kept(self) -> dict[int, Tensor | list[list[Tensor]]]:
        """``{layer: positions}``: the positions each KV head keeps, ascending: a (B, H_kv, n)
        LongTensor, or with adaptive budgets a list over batch rows of lists over KV heads of
        1-D tensors."""
        return {layer: state.kept() for layer, state in sorted(self.states.items())}

    @property
    def nbytes(self) -> int:
        """Bytes of every layer's kept keys and values."""
        return sum(state.nbytes for state in self.states.values())

    def cache_of(self, module: nn.Module) -> Any:
        """The cache the module's running call writes to (None: no cache)."""
        return self._caches.get(module)


@dataclass
class Plan:
    """What the active blocks ask of one call from one layer, by the point of the call where
    each acts (``run_plan``): the pattern (knockouts, the capture, patches), a head's output
    (scales); ``compress`` is the transformers bridge's own (its cache)."""

    layer: int
    capture: Capture | None = None
    scales: list[Tensor] = field(default_factory=list)
    knockouts: list[Edit] = field(default_factory=list)
    patches: list[Edit] = field(default_factory=list)
    compress: Compression | None = None


_ACTIVE: ContextVar[tuple[Block, ...]] = ContextVar("multihead_blocks", default=())
# blocks open in any context of the process: a plain int that torch.compile reads as a guarded
# constant, so a model with no block open traces without reading the context variable (which
# dynamo cannot trace: a graph break in every attention call)
_OPEN = 0


def active() -> tuple[Block, ...]:
    """The blocks open in this context, outermost first."""
    return _ACTIVE.get() if _OPEN else ()


def plan_for(module: nn.Module) -> Plan | None:
    """The plan for a call from ``module``, or None when no active block covers its layer."""
    if not _OPEN:
        return None
    blocks = _ACTIVE.get()
    if not blocks:
        return None
    plan: Plan | None = None
    for block in reversed(blocks):  # innermost first: its capture is the one that records
        layer = block.layer_of(module)
        if layer is None:
            continue
        if plan is None:
            plan = Plan(layer)
        if isinstance(block, Capture):
            if plan.capture is None:
                plan.capture = block
        elif isinstance(block, Compression):
            plan.compress = block
        elif isinstance(block, Edit):
            if block.kind == "ablate":
                scale = block.scales.get(layer)
                if scale is not None:
                    plan.scales.append(scale)
            elif block.kind == "knockout":
                plan.knockouts.append(block)
            elif block.source is not None and layer in block.source.weights:
                plan.patches.append(block)
    return plan


@contextlib.contextmanager
def activate(block: Block) -> Iterator[None]:
    """``block`` is active while the context runs (inside any block already active)."""
    global _OPEN
    token = _ACTIVE.set((*_ACTIVE.get(), block))
    _OPEN += 1
    try:
        yield
    finally:
        _OPEN -= 1
        _ACTIVE.reset(token)


def route(plan: Plan | None, *, compressing: bool, step: bool) -> str:
    """The one choice every attention call of both model worlds makes (the library's
    ``MultiHeadAttention`` and the transformers bridge read it): ``"compress"`` (a compressed
    cache keeps the layer: a ``KVCache`` with a policy, or a ``compress`` block),
    ``"plan"`` (another block acts on the layer: ``run_plan``), ``"step"`` (a decoding
    step's one-row call, ``step`` saying the caller's call qualifies: ``decoding_routes``) or
    ``"plain"`` (one registry call)."""
    if compressing or (plan is not None and plan.compress is not None):
        return "compress"
    if plan is not None:
        return "plan"
    return "step" if step else "plain"
