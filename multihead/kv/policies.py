"""KV-cache compression policies: small records that hold only their parameters.

A policy says which keys of a cache to keep; ``multihead.kv.select`` turns a policy, the
scores it ranks by and the cache's length into the kept positions, for transformers' caches
(``multihead.hf.compress``) and the library's own ``KVCache`` alike.

``keep`` is either a fraction of the prompt (a float, 0 < keep <= 1) or a token budget (an
int >= 1). It counts every key kept: the sinks and the recent window are part of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

__all__ = ["H2O", "POLICIES", "TOVA", "Policy", "SnapKV", "StreamingLLM", "policy"]

_BUDGETS = ("uniform", "adaptive")


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
    """

    keep: float | int
    sinks: int = 4
    budget: str = "uniform"

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
        if isinstance(self.keep, int) and self.keep < self.fixed:
            raise ValueError(
                f"a token budget keep must hold at least the {self.fixed} keys the policy always "
                f"keeps (sinks={self.sinks} + {self._window_name}={self.window_size}). "
                f"Received: keep={self.keep}"
            )

    @property
    def window_size(self) -> int:
        """The most recent keys always kept (the observation window, the recent window)."""
        return 0

    _window_name: ClassVar[str] = "window"

    @property
    def fixed(self) -> int:
        """Keys kept whatever the scores say: the sinks and the recent window."""
        return self.sinks + self.window_size

    def budget_for(self, length: int) -> int:
        """Keys kept of a prompt of ``length`` tokens: the fraction of it (rounded, at least the
        sinks and window) or the token budget, never more than ``length``."""
        if isinstance(self.keep, float):
            wanted = max(round(self.keep * length), self.fixed, 1)
        else:
            wanted = self.keep
        return min(wanted, length)


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


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (SnapKV, H2O, TOVA, StreamingLLM)}


def policy(name: str, keep: float | int, **options: object) -> Policy:
    """The policy called ``name`` (``"snapkv"``, ``"h2o"``, ``"tova"``, ``"streaming"``).

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
