"""KV-cache compression policies: small records that hold only their parameters.

A policy says which keys of a cache to keep; ``multihead.kv.select`` turns a policy, the
scores it ranks by and the cache's length into the kept positions, for transformers' caches
(``multihead.hf.compress``) and the library's own ``KVCache`` alike.

``keep`` is either a fraction of the prompt (a float, 0 < keep <= 1) or a token budget (an
int >= 1). It counts every key kept: the sinks and the recent window are part of it.

Two options shape any scored policy's choice without changing its scores:

* ``span``: keys are kept in contiguous spans of ``span`` positions, each span ranked by the
  mean of its keys' scores summed over the layer's KV heads, every head keeping the same spans
  (ChunkKV, Liu et al. 2025): a fact written over several tokens (a number SmolLM2 writes one
  digit a token) is kept whole or not at all, in every head. With ``spans="centred"`` the
  spans are not ChunkKV's fixed grid: the scores, summed over the KV heads, are max-pooled
  over the ``span`` positions centred on each key, so each high score keeps the span around
  it (``SpanKV``) and a fact is not cut at a grid edge.
* ``layers``: how the model's total budget is shared among its layers: ``"uniform"``, a
  ``"pyramid"`` that gives the first layers the most and the last the least (PyramidKV, Cai et
  al. 2024: the scored part falls linearly from ``2s - s/beta`` to ``s/beta`` for a mean of
  ``s``), or a tuple of one weight per layer; ``whole_layers`` keeps the first layers whole and
  takes their keys from the others' share. The mean over the layers stays the policy's
  budget, so the cache's bytes stay keep x full. The layers are the model's, by index: in a
  model whose sliding-window layers keep their window (Gemma 3), the global layers hold the
  budgets of their own indices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

__all__ = [
    "H2O",
    "POLICIES",
    "TOVA",
    "ChunkKV",
    "Policy",
    "PyramidKV",
    "Reconstruction",
    "SnapKV",
    "SpanKV",
    "StreamingLLM",
    "policy",
]

_BUDGETS = ("uniform", "adaptive")
_LAYERS = ("uniform", "pyramid")
_SPANS = ("aligned", "centred")


def _check_keep(keep: object) -> float | int:
    if isinstance(keep, bool) or not isinstance(keep, (int, float)):
        raise TypeError(
            "keep must be a fraction of the prompt (a float, 0 < keep <= 1) or a token budget "
            f"(an int >= 1). Received: keep={keep!r}"
        )
    if isinstance(keep, float):
        if not math.isfinite(keep) or not 0 < keep <= 1:
            raise ValueError(
                "a fraction keep must lie in (0, 1]: the share of the prompt's keys kept, "
                f"sinks and window included (an int is a token budget). Received: keep={keep!r}"
            )
    elif keep < 1:
        raise ValueError(f"a token budget keep must be an int >= 1. Received: keep={keep!r}")
    return keep


def _check_count(name: str, value: object, least: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an int >= {least}. Received: {name}={value!r}")
    return value


@dataclass(frozen=True)
class Policy:
    """What every policy shares.

    Attributes:
        keep: a fraction of the prompt (float in (0, 1]) or a token budget (int >= 1),
            counting every key kept.
        sinks: the first tokens, always kept (attention sinks, Xiao et al. 2023).
        budget: ``"uniform"`` (every KV head of a layer keeps the same number of keys) or
            ``"adaptive"`` (a layer's budget shared among its KV heads by how concentrated
            their scores are, as AdaKV does: Feng et al. 2024).
        span: keys kept in contiguous spans of this many positions, shared by the layer's KV
            heads (1: key by key; see the module docstring).
        spans: where the spans lie: ``"aligned"`` (positions ``c * span`` to
            ``c * span + span - 1``, ChunkKV's chunks, ranked by their mean) or
            ``"centred"`` (the scores summed over the KV heads at each position, then
            max-pooled over the ``span`` positions centred on each key: a high score keeps
            the span around it, so a fact is not cut at a chunk's edge).
        layers: the budget per layer: ``"uniform"``, ``"pyramid"`` or one weight per layer.
        whole_layers: the first layers kept whole, their keys taken from the others' budget.
        beta: the pyramid's steepness (PyramidKV's beta: the last layer scores ``1/beta`` of
            the mean).
    """

    keep: float | int
    sinks: int = 4
    budget: str = "uniform"
    span: int = 1
    spans: str = "aligned"
    layers: str | tuple[float, ...] = "uniform"
    whole_layers: int = 0
    beta: float = 20.0

    name: ClassVar[str] = "policy"
    # the statistic the kernel folds into the prompt's pass for this policy (None: none)
    prompt_stat: ClassVar[str | None] = None
    # whether every decoding step's scores are read and the cache kept at its budget
    evicts_while_decoding: ClassVar[bool] = False

    def __post_init__(self) -> None:
        _check_keep(self.keep)
        _check_count("sinks", self.sinks)
        if self.budget not in _BUDGETS:
            raise ValueError(
                f"budget must be one of {', '.join(_BUDGETS)}. Received: budget={self.budget!r}"
            )
        _check_count("span", self.span, 1)
        if self.spans not in _SPANS:
            raise ValueError(
                f"spans must be one of {', '.join(_SPANS)}. Received: spans={self.spans!r}"
            )
        _check_count("whole_layers", self.whole_layers, 0)
        self._check_layers()
        if self.span > 1 and self.budget == "adaptive":
            raise ValueError(
                "span selection keeps the same spans in every KV head of a layer, so the "
                "layer's budget cannot be shared out among its heads: use budget='uniform' "
                f"with span > 1. Received: span={self.span}, budget='adaptive'"
            )
        if isinstance(self.keep, int) and self.keep < self.fixed:
            raise ValueError(
                f"a token budget keep must hold at least the {self.fixed} keys the policy always "
                f"keeps (sinks={self.sinks} + {self._window_name}={self.window_size}). "
                f"Received: keep={self.keep}"
            )

    def _check_layers(self) -> None:
        layers = self.layers
        if isinstance(layers, str):
            if layers not in _LAYERS:
                raise ValueError(
                    f"layers must be one of {', '.join(_LAYERS)} or a tuple of one weight per "
                    f"layer. Received: layers={layers!r}"
                )
        elif (
            not isinstance(layers, tuple)
            or not layers
            or not all(
                isinstance(w, (int, float))
                and not isinstance(w, bool)
                and math.isfinite(w)
                and w > 0
                for w in layers
            )
        ):
            raise ValueError(
                "layers given as weights must be a non-empty tuple of positive finite numbers, "
                f"one per layer. Received: layers={layers!r}"
            )
        beta = self.beta
        if not (isinstance(beta, (int, float)) and math.isfinite(beta) and beta >= 1):
            raise ValueError(
                "beta must be a number >= 1 (the pyramid's last layer scores 1/beta of the "
                f"mean). Received: beta={beta!r}"
            )

    @property
    def per_layer(self) -> bool:
        """Whether layers keep different budgets (a pyramid, weights or whole first layers):
        each layer's cache must then know its index and the model's number of layers."""
        return self.layers != "uniform" or self.whole_layers > 0

    @property
    def window_size(self) -> int:
        """The most recent keys always kept (the observation window, the recent window)."""
        return 0

    _window_name: ClassVar[str] = "window"

    @property
    def fixed(self) -> int:
        """Keys kept whatever the scores say: the sinks and the recent window."""
        return self.sinks + self.window_size

    def budget_for(self, length: int, layer: int | None = None, layers: int | None = None) -> int:
        """Keys kept of a prompt of ``length`` tokens: the fraction of it (rounded, at least the
        sinks and window) or the token budget, never more than ``length``; with per-layer
        budgets (``per_layer``), layer ``layer``'s of a model of ``layers`` layers.

        Raises:
            ValueError: per-layer budgets without the layer's place, or weights for another
                number of layers.
        """
        if isinstance(self.keep, float):
            wanted = max(round(self.keep * length), self.fixed, 1)
        else:
            wanted = self.keep
        if not self.per_layer:
            return min(wanted, length)
        if layer is None or layers is None or not 0 <= layer < layers:
            raise ValueError(
                "per-layer budgets need the layer's index and the model's number of layers. "
                f"Received: layer={layer!r}, layers={layers!r}"
            )
        return min(self._layer_budget(wanted, length, layer, layers), length)

    def _layer_budget(self, mean: int, length: int, layer: int, layers: int) -> int:
        """Layer ``layer``'s keys when the layers keep ``mean`` on average: the whole layers
        everything, the others the rest in the shape ``layers`` names (each at least the fixed
        keys, at most ``length``)."""
        whole = min(self.whole_layers, layers)
        if layer < whole:
            return length
        fixed = min(self.fixed, length)
        rest = layers - whole
        room = length - fixed  # the most a layer can score
        scored = max((layers * mean - whole * length) / rest - fixed, 0.0)  # the mean share
        i = layer - whole
        if isinstance(self.layers, tuple):
            if len(self.layers) != layers:
                raise ValueError(
                    f"layers holds {len(self.layers)} weights for a model of {layers} layers. "
                    f"Received: layers={self.layers!r}"
                )
            weights = self.layers[whole:]
            share = scored * rest * weights[i] / sum(weights)
        elif self.layers == "pyramid" and rest > 1:
            low = scored / self.beta
            high = 2 * scored - low
            if high > room:  # the first layer cannot score more than the whole input
                high = room
                low = 2 * scored - high
            share = high - i * (high - low) / (rest - 1)
        else:
            share = scored
        return fixed + round(min(max(share, 0.0), room))


@dataclass(frozen=True)
class StreamingLLM(Policy):
    """The first ``sinks`` tokens and the most recent ones (Xiao et al. 2023): no scores."""

    name: ClassVar[str] = "streaming"
    evicts_while_decoding: ClassVar[bool] = True


@dataclass(frozen=True)
class SnapKV(Policy):
    """Once the prompt has run, each KV head keeps the keys with the most attention from the
    prompt's last ``window`` rows (``window_mass`` summed over the query heads of its group,
    max-pooled over ``pool`` neighbouring keys), plus the window itself and the sinks (Li et
    al. 2024). Decoding then appends to the compressed cache."""

    window: int = 32
    pool: int = 7
    name: ClassVar[str] = "snapkv"
    prompt_stat: ClassVar[str | None] = "window_mass"

    def __post_init__(self) -> None:
        _check_count("window", self.window, 1)
        _check_count("pool", self.pool, 1)
        if self.pool % 2 == 0:
            raise ValueError(
                "pool must be odd, so that the max-pooling is centred on each key. "
                f"Received: pool={self.pool}"
            )
        super().__post_init__()

    @property
    def window_size(self) -> int:
        return self.window


@dataclass(frozen=True)
class H2O(Policy):
    """Heavy hitters (Zhang et al. 2023): each key's attention accumulated over every row so
    far, prompt and decoding (``key_mass``); whenever the cache is over budget each KV head
    drops its lowest keys, the sinks and the ``recent`` newest always kept."""

    recent: int = 32
    name: ClassVar[str] = "h2o"
    prompt_stat: ClassVar[str | None] = "key_mass"
    evicts_while_decoding: ClassVar[bool] = True
    _window_name: ClassVar[str] = "recent"

    def __post_init__(self) -> None:
        _check_count("recent", self.recent, 0)
        super().__post_init__()

    @property
    def window_size(self) -> int:
        return self.recent


@dataclass(frozen=True)
class TOVA(Policy):
    """Token omission via attention (Oren et al. 2024): at every step each KV head drops the
    key the newest row attends to least (summed over the query heads of its group); after the
    prompt, the keys its last row attends to least."""

    name: ClassVar[str] = "tova"
    prompt_stat: ClassVar[str | None] = "window_mass"  # with a window of one row
    evicts_while_decoding: ClassVar[bool] = True


@dataclass(frozen=True)
class ChunkKV(SnapKV):
    """SnapKV's scores, kept in contiguous spans of ``span`` positions shared by every KV head
    of a layer (ChunkKV, Liu et al. 2025; ``span`` 20, kvpress's default chunk length): a
    multi-token fact survives whole in every head or not at all."""

    span: int = 20
    name: ClassVar[str] = "chunkkv"


@dataclass(frozen=True)
class SpanKV(SnapKV):
    """SnapKV's scores summed over a layer's KV heads and max-pooled over the ``span``
    positions (15) centred on each key (``spans="centred"``): every high score keeps the
    span around it whole, in every head. ChunkKV keeps whole facts too, but its chunks lie
    on a fixed grid, and a value written over several tokens that straddles a chunk's edge
    keeps only the chunk with the cue in it, losing its last tokens; a span centred on the cue
    holds the value after it. Chosen by measurement against ChunkKV and against spans placed
    where their mean is highest (the performance page, issue 59)."""

    span: int = 15
    spans: str = "centred"
    name: ClassVar[str] = "spankv"


@dataclass(frozen=True)
class PyramidKV(SnapKV):
    """SnapKV's scores with a pyramid of layer budgets (PyramidKV, Cai et al. 2024; ``beta``
    20 as in its reference code): the first layers, whose attention is spread wide, keep the
    most, the last the least, the layers' mean the policy's budget."""

    layers: str | tuple[float, ...] = "pyramid"
    name: ClassVar[str] = "pyramidkv"


@dataclass(frozen=True)
class Reconstruction(Policy):
    """Query-agnostic: each KV head keeps the keys the model attends to most while it reads
    the context a second time, after a request to repeat it, plus the sinks and the ``window``
    newest keys: a KVzip-class score (Kim et al. 2025, who take the maximum over the second
    reading's rows and a group's heads; here the sum, ``window_mass`` over those rows, the
    statistic the kernel folds into its pass). The scores do not depend on any question, so a
    context compressed once answers many. They need the second reading, about one more
    prompt's work: ``multihead.hf.compress_context`` runs it; later chunks and decoding steps
    run under ``compress`` as SnapKV's do."""

    window: int = 32
    name: ClassVar[str] = "reconstruction"
    prompt_stat: ClassVar[str | None] = "window_mass"

    def __post_init__(self) -> None:
        _check_count("window", self.window, 1)
        super().__post_init__()

    @property
    def window_size(self) -> int:
        return self.window


POLICIES: dict[str, type[Policy]] = {
    p.name: p for p in (SnapKV, H2O, TOVA, StreamingLLM, ChunkKV, SpanKV, PyramidKV, Reconstruction)
}


def policy(name: str, keep: float | int, **options: object) -> Policy:
    """The policy called ``name`` (``"snapkv"``, ``"h2o"``, ``"tova"``, ``"streaming"``,
    ``"chunkkv"``, ``"spankv"``, ``"pyramidkv"``, ``"reconstruction"``).

    Raises:
        ValueError: an unknown name, and what the policy's own checks raise.
    """
    kind = POLICIES.get(name.lower()) if isinstance(name, str) else None
    if kind is None:
        raise ValueError(
            f"unknown KV-cache policy; the policies are {', '.join(POLICIES)}. "
            f"Received: policy={name!r}"
        )
    return kind(keep, **options)  # type: ignore[arg-type]
