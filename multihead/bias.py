"""Score modifiers: additive terms on the attention scores that compute themselves per tile.

``attention(..., bias=...)`` takes a float tensor or a modifier from this module. Like a mask,
a modifier is small data, not an L x S tensor, and describes itself:

* ``block(L, S, q0, q1, k0, k1)``: its values on any rectangle, differentiable with respect to
  its ``tensors()`` (a T5 table learns through it);
* ``diagonals(L, S, lo, hi)``: for modifiers that depend only on the aligned distance
  d = j - (i + offset), their values on the distances [lo, hi) as one (H, hi - lo) row per
  head; a fast backend turns that into a strided view of a whole tile without building it;
* ``score_mod(L, S)``: the function ``(score, b, h, q_idx, kv_idx) -> score`` in the form of
  FlexAttention's ``score_mod``.

Modifiers add with ``+`` to each other and to tensors::

    bias = multihead.bias.alibi(8) + multihead.bias.relative_buckets(table) + extra_tensor

Two modifiers are not additive and join a sum the same way: ``softcap(cap)`` caps the scaled
scores with ``cap * tanh(score / cap)`` before the additive terms and the mask (Gemma 2), and
``sinks(logits)`` adds one learned logit per head to every row's softmax denominator without a
value (gpt-oss's attention sinks). A sum holds at most one of each; ``split`` hands a backend the
additive part, the cap and the sink logits apart.

Alignment follows ``masks.causal()``: bottom-right by default (query i sits at position
i + S - L), so decoding with a cache sees the same distances as the full sequence.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from typing import NamedTuple

import torch
from torch import Tensor

from . import _geometry as G
from . import _validation as V

__all__ = [
    "ScoreModifier",
    "Terms",
    "alibi",
    "alibi_slopes",
    "as_modifier",
    "relative_buckets",
    "sinks",
    "softcap",
    "split",
]

ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


class ScoreModifier:
    """Base class of additive score terms. Subclasses implement ``block``, ``tensors`` and
    ``score_mod``; relative ones (see ``_Relative``) get everything from one formula."""

    batch_size: int | None = None  # B fixed by the modifier's tensors, None = any
    num_heads: int | None = None  # H fixed by the modifier, None = any
    computed: bool = True  # values computed on demand (False: a tensor given in full)

    def check(self, batch: int, heads: int, length_q: int, length_k: int) -> None:
        """Raise ValueError if this modifier cannot be used with (B, H, L, S)."""
        if self.num_heads is not None and self.num_heads not in (1, heads):
            raise ValueError(
                f"{self!r} has {self.num_heads} heads but the query has H={heads}; build it "
                f"with {heads} heads. Received: {self.num_heads} heads"
            )

    def tensors(self) -> tuple[Tensor, ...]:
        """The tensors the values are computed from; gradients flow to these."""
        raise NotImplementedError

    def block(
        self,
        length_q: int,
        length_k: int,
        q0: int,
        q1: int,
        k0: int,
        k1: int,
        *,
        batch: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> Tensor:
        """Values for queries [q0, q1) x keys [k0, k1), broadcastable to (B, H, rows, cols)
        (size 1 where the values do not vary; batch dimension 1 with ``batch=b``)."""
        raise NotImplementedError

    def diagonals(
        self,
        length_q: int,
        length_k: int,
        lo: int,
        hi: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> Tensor | None:
        """(H or 1, hi - lo): the value at aligned distance d = j - (i + offset) for d in
        [lo, hi), or None when the values are not a function of that distance alone."""
        return None

    def offset(self, length_q: int, length_k: int) -> int:
        """The alignment offset of ``diagonals`` (S - L bottom-right, 0 top-left)."""
        return 0

    def score_mod(
        self, length_q: int, length_k: int, *, device: torch.device | str | None = None
    ) -> ScoreMod:
        """``(score, b, h, q_idx, kv_idx) -> score`` with this term added (FlexAttention form)."""
        raise NotImplementedError

    def heads(self, index: Tensor) -> ScoreModifier:
        """The same modifier restricted to query heads ``index`` (1-D integer tensor)."""
        raise NotImplementedError

    @property
    def structure_key(self) -> Hashable | None:
        """A hashable key when the values depend only on (L, S) and settings known without
        reading tensors, else None (compiled kernels can be cached under it)."""
        return None

    def to_dense(
        self,
        length_q: int,
        length_k: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> Tensor:
        """All values, broadcastable to (B, H, L, S)."""
        return self.block(length_q, length_k, 0, length_q, 0, length_k, device=device, dtype=dtype)

    @property
    def requires_grad(self) -> bool:
        return any(t.requires_grad for t in self.tensors())

    def crop(
        self, length_q: int, length_k: int, q0: int, q1: int, k0: int, k1: int
    ) -> ScoreModifier:
        """The values for queries [q0, q1) and keys [k0, k1) of an (L, S) problem, as a modifier
        of its own for a (q1 - q0, k1 - k0) problem (one shard of a longer sequence)."""
        return _Crop(self, length_q, length_k, q0, q1, k0, k1)

    def __add__(self, other: object) -> ScoreModifier:
        other = as_modifier(other)
        return self if other is None else _Sum((self, other))  # None: no bias to add

    def __radd__(self, other: object) -> ScoreModifier:
        other = as_modifier(other)
        return self if other is None else _Sum((other, self))


def as_modifier(bias: object) -> ScoreModifier | None:
    """None, a float tensor (wrapped) or a modifier; anything else is a TypeError."""
    if bias is None or isinstance(bias, ScoreModifier):
        return bias
    if isinstance(bias, Tensor):
        return _TensorBias(bias)
    raise TypeError(
        "bias must be a float tensor, a multihead.bias modifier (alibi, relative_buckets) or "
        f"None. Received: bias of type {type(bias).__name__}"
    )


class _TensorBias(ScoreModifier):
    """A float tensor (L, S) or (B|1, H|1, L|1, S|1) of additive scores."""

    computed = False

    def __init__(self, bias: Tensor) -> None:
        if not bias.is_floating_point():
            raise TypeError(
                "bias must be a floating-point tensor of additive score terms; boolean "
                "visibility belongs in mask=. "
                f"Received: bias.dtype={bias.dtype}"
            )
        if bias.dim() not in (2, 4):
            raise ValueError(
                "bias must be 2-D (L, S) or 4-D (B or 1, H or 1, L or 1, S or 1). "
                f"Received: bias.shape={tuple(bias.shape)}"
            )
        self._exact = bias.dim() == 2
        self.bias = bias[None, None] if self._exact else bias
        if self.bias.shape[0] != 1:
            self.batch_size = self.bias.shape[0]
        if self.bias.shape[1] != 1:
            self.num_heads = self.bias.shape[1]

    def check(self, batch, heads, length_q, length_k):
        target = (batch, heads, length_q, length_k)
        shape = tuple(self.bias.shape)
        if self._exact:
            fits = shape[2:] == (length_q, length_k)
        else:
            fits = all(got in (want, 1) for got, want in zip(shape, target))
        if not fits:
            letters, want = ("(L, S)", target[2:]) if self._exact else ("(B, H, L, S)", target)
            got = shape[2:] if self._exact else shape
            raise ValueError(
                f"bias does not fit {letters}={want}; a 2-D bias must be exactly (L, S) and a "
                "4-D bias may use size 1 only to broadcast. "
                f"Received: bias.shape={got}"
            )
        if not bool(torch.isfinite(self.bias).all()):
            raise ValueError(
                "bias must be finite: express blocked positions with mask= (True = may attend), "
                "which never produces NaN. Received: a bias with inf or NaN entries"
            )

    def tensors(self):
        return (self.bias,)

    def block(self, length_q, length_k, q0, q1, k0, k1, *, batch=None, device=None, dtype=None):
        t = self.bias
        if batch is not None and t.shape[0] != 1:
            t = t[batch : batch + 1]
        if t.shape[2] != 1:
            t = t[:, :, q0:q1]
        if t.shape[3] != 1:
            t = t[..., k0:k1]
        return t.to(device=device, dtype=dtype or torch.float32)

    def score_mod(self, length_q, length_k, *, device=None):
        t = self.bias.to(device)

        def mod(score, b, h, q_idx, kv_idx):
            idx = [i if n > 1 else i * 0 for i, n in zip((b, h, q_idx, kv_idx), t.shape)]
            return score + t[idx[0], idx[1], idx[2], idx[3]]

        return mod

    def heads(self, index):
        if self.bias.shape[1] == 1:
            return self
        return _TensorBias(self.bias[:, index.to(self.bias.device)])

    def __repr__(self):
        return f"tensor bias of shape {tuple(self.bias.shape)}"


class _Crop(ScoreModifier):
    def __init__(self, parent: ScoreModifier, length_q, length_k, q0, q1, k0, k1) -> None:
        self.parent, self.window = parent, G.Window(length_q, length_k, q0, q1, k0, k1)
        self.size = self.window.size
        self.batch_size, self.num_heads = parent.batch_size, parent.num_heads
        self.computed = parent.computed

    def check(self, batch, heads, length_q, length_k):
        self.window.check_shape("bias", length_q, length_k)
        self.parent.check(batch, heads, *self.size)

    def tensors(self):
        return self.parent.tensors()

    def block(self, length_q, length_k, q0, q1, k0, k1, *, batch=None, device=None, dtype=None):
        rect = self.window.outer(q0, q1, k0, k1)
        return self.parent.block(*self.size, *rect, batch=batch, device=device, dtype=dtype)

    def offset(self, length_q, length_k):
        # the aligned distance j - (i + offset) of the whole, in the crop's own indices
        return self.parent.offset(*self.size) - self.window.shift

    def diagonals(self, length_q, length_k, lo, hi, *, device=None, dtype=torch.float32):
        return self.parent.diagonals(*self.size, lo, hi, device=device, dtype=dtype)

    def score_mod(self, length_q, length_k, *, device=None):
        mod = self.parent.score_mod(*self.size, device=device)
        q0, k0 = self.window.q0, self.window.k0
        return lambda score, b, h, q_idx, kv_idx: mod(score, b, h, q_idx + q0, kv_idx + k0)

    def heads(self, index):
        w = self.window
        return _Crop(self.parent.heads(index), *self.size, w.q0, w.q1, w.k0, w.k1)

    @property
    def structure_key(self):
        key = self.parent.structure_key
        return None if key is None else ("crop", key, *self.window.key())

    def __repr__(self):
        return f"crop of {self.parent!r} to {self.window.describe()}"


class _Sum(ScoreModifier):
    parts: tuple[ScoreModifier, ...]

    def __init__(self, parts: tuple[ScoreModifier, ...]) -> None:
        flat: list[ScoreModifier] = []
        for p in parts:
            flat += list(p.parts) if isinstance(p, _Sum) else [p]
        self.parts = tuple(flat)
        sizes = {p.num_heads for p in flat if p.num_heads not in (None, 1)}
        if len(sizes) > 1:
            raise ValueError(
                f"cannot add score modifiers with different head counts. Received: {sorted(sizes)}"
            )
        self.num_heads = sizes.pop() if sizes else None
        batches = {p.batch_size for p in flat if p.batch_size is not None}
        if len(batches) > 1:
            raise ValueError(
                "cannot add score modifiers with different batch sizes. "
                f"Received: {sorted(batches)}"
            )
        self.batch_size = batches.pop() if batches else None
        self.computed = any(p.computed for p in flat)
        for kind in (_Softcap, _Sinks):
            if sum(isinstance(p, kind) for p in flat) > 1:
                raise ValueError(
                    f"a sum of score modifiers holds at most one {kind.label}; combine them into "
                    f"one. Received: {' + '.join(map(repr, flat))}"
                )

    def check(self, batch, heads, length_q, length_k):
        for p in self.parts:
            p.check(batch, heads, length_q, length_k)

    def crop(self, length_q, length_k, q0, q1, k0, k1):
        # each term cropped: a cap or sink logits stay whole beside the additive terms' crops
        return _Sum(tuple(p.crop(length_q, length_k, q0, q1, k0, k1) for p in self.parts))

    def tensors(self):
        return tuple(t for p in self.parts for t in p.tensors())

    def block(self, length_q, length_k, q0, q1, k0, k1, *, batch=None, device=None, dtype=None):
        total = None
        for p in self.parts:
            x = p.block(length_q, length_k, q0, q1, k0, k1, batch=batch, device=device, dtype=dtype)
            total = x if total is None else total + x
        return total

    def offset(self, length_q, length_k):
        return self.parts[0].offset(length_q, length_k)

    def diagonals(self, length_q, length_k, lo, hi, *, device=None, dtype=torch.float32):
        offsets = {p.offset(length_q, length_k) for p in self.parts}
        if len(offsets) != 1:
            return None
        total = None
        for p in self.parts:
            x = p.diagonals(length_q, length_k, lo, hi, device=device, dtype=dtype)
            if x is None:
                return None
            total = x if total is None else total + x
        return total

    def score_mod(self, length_q, length_k, *, device=None):
        mods = [p.score_mod(length_q, length_k, device=device) for p in self.parts]

        def mod(score, b, h, q_idx, kv_idx):
            for m in mods:
                score = m(score, b, h, q_idx, kv_idx)
            return score

        return mod

    def heads(self, index):
        return _Sum(tuple(p.heads(index) for p in self.parts))

    @property
    def structure_key(self):
        keys = [p.structure_key for p in self.parts]
        return None if any(k is None for k in keys) else ("sum", *keys)

    def __repr__(self):
        return " + ".join(map(repr, self.parts))


class _Relative(ScoreModifier):
    """A term that depends only on the head h and the aligned distance d = j - (i + offset).

    Subclasses implement ``_at(h, d)`` elementwise over broadcast integer tensors; everything
    else (blocks, diagonals, score_mod) follows from it.
    """

    def __init__(self, align: str) -> None:
        self.align = G.check_align(align)

    def _at(self, h: Tensor, d: Tensor) -> Tensor:
        raise NotImplementedError

    def offset(self, length_q, length_k):
        return G.offset(self.align, length_q, length_k)

    def _heads(self, device) -> Tensor:
        assert self.num_heads is not None  # every relative modifier is built with its H
        return torch.arange(self.num_heads, device=device)

    def block(self, length_q, length_k, q0, q1, k0, k1, *, batch=None, device=None, dtype=None):
        off = self.offset(length_q, length_k)
        device = device if device is not None else self.tensors()[0].device
        d = (
            torch.arange(k0, k1, device=device)[None, :]
            - torch.arange(q0, q1, device=device)[:, None]
        )
        values = self._at(self._heads(device)[:, None, None], d - off)  # [H, rows, cols]
        return values[None].to(dtype or torch.float32)

    def diagonals(self, length_q, length_k, lo, hi, *, device=None, dtype=torch.float32):
        device = device if device is not None else self.tensors()[0].device
        d = torch.arange(lo, hi, device=device)[None, :]
        return self._at(self._heads(device)[:, None], d).to(dtype)  # [H, hi - lo]

    def score_mod(self, length_q, length_k, *, device=None):
        off = self.offset(length_q, length_k)
        moved = self._moved(device)
        return lambda score, b, h, q_idx, kv_idx: score + moved._at(h, kv_idx - q_idx - off)

    def _moved(self, device) -> _Relative:
        return self


def alibi_slopes(num_heads: int) -> Tensor:
    """ALiBi's head slopes (Press et al. 2022, section 3): for H a power of two, the geometric
    sequence 2^(-8/H), 2^(-16/H), ..., 2^-8. Otherwise the slopes of the nearest lower power of
    two m, followed by every other slope of 2m, as in the paper's reference code."""
    V.check_positive_int("num_heads", num_heads)

    def geometric(n: int) -> list[float]:
        return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]

    m = 2 ** math.floor(math.log2(num_heads))
    slopes = geometric(m) + geometric(2 * m)[0::2][: num_heads - m]
    return torch.tensor(slopes, dtype=torch.float64)


class _Alibi(_Relative):
    def __init__(self, slopes: Tensor, bidirectional: bool, align: str) -> None:
        super().__init__(align)
        if not isinstance(slopes, Tensor) or slopes.dim() != 1 or not slopes.is_floating_point():
            shape = tuple(slopes.shape) if isinstance(slopes, Tensor) else type(slopes).__name__
            raise ValueError(f"slopes must be a 1-D float tensor (H,). Received: {shape}")
        self.slopes = slopes
        self.bidirectional = V.check_bool("bidirectional", bidirectional)
        self.num_heads = slopes.shape[0]

    def tensors(self):
        return (self.slopes,)

    def _at(self, h, d):
        distance = d.abs() if self.bidirectional else d
        # bidirectional: -m |d| (a symmetric penalty); causal form: m d = -m (i' - j), which is
        # the paper's penalty on keys to the left; keys to the right should be masked
        sign = -1.0 if self.bidirectional else 1.0
        return sign * self.slopes[h] * distance

    def _moved(self, device):
        return (
            self
            if device is None
            else _Alibi(self.slopes.to(device), self.bidirectional, self.align)
        )

    def heads(self, index):
        return _Alibi(self.slopes[index.to(self.slopes.device)], self.bidirectional, self.align)

    def check(self, batch, heads, length_q, length_k):
        super().check(batch, heads, length_q, length_k)
        if not bool(torch.isfinite(self.slopes).all()):
            raise ValueError("ALiBi slopes must be finite. Received: inf or NaN slopes")

    def __repr__(self):
        kind = ", bidirectional" if self.bidirectional else ""
        return f"alibi({self.num_heads} heads{kind}, align={self.align!r})"


def alibi(
    num_heads: int | None = None,
    *,
    slopes: Tensor | None = None,
    bidirectional: bool = False,
    align: str = "bottom_right",
) -> ScoreModifier:
    """ALiBi (Press et al. 2022): a linear penalty on the distance between query and key.

    Adds ``m_h * (j - i')`` with i' = i + S - L (bottom-right, as ``masks.causal()``), which
    under a causal mask is the paper's ``-m_h * (i' - j)``. ``bidirectional=True`` adds
    ``-m_h * |j - i'|`` for encoders. For L = S = 4 and a slope of 1::

        0 . . .        (causal)
       -1 0 . .
       -2 -1 0 .
       -3 -2 -1 0

    Args:
        num_heads: H; the slopes are ``alibi_slopes(H)``.
        slopes: explicit (H,) slopes instead (learnable if they require grad).
        bidirectional: symmetric penalty for attention in both directions.
        align: "bottom_right" (default) or "top_left", as in ``masks.causal``.
    """
    if (num_heads is None) == (slopes is None):
        raise ValueError(
            "alibi takes num_heads or slopes, exactly one. "
            f"Received: num_heads={num_heads!r}, slopes={'given' if slopes is not None else None}"
        )
    if slopes is None:
        assert num_heads is not None  # exactly one of the two was given (checked above)
        slopes = alibi_slopes(num_heads).float()
    return _Alibi(slopes, bidirectional, align)


class _RelativeBuckets(_Relative):
    def __init__(self, table: Tensor, bidirectional: bool, max_distance: int, align: str) -> None:
        super().__init__(align)
        if not isinstance(table, Tensor) or table.dim() != 2 or not table.is_floating_point():
            shape = tuple(table.shape) if isinstance(table, Tensor) else type(table).__name__
            raise ValueError(
                f"table must be a 2-D float tensor (num_buckets, H). Received: {shape}"
            )
        self.table = table
        self.bidirectional = V.check_bool("bidirectional", bidirectional)
        self.max_distance = V.check_positive_int("max_distance", max_distance)
        self.num_buckets, self.num_heads = table.shape
        exact = self.num_buckets // (2 if bidirectional else 1) // 2
        if exact < 1 or self.max_distance <= exact:
            raise ValueError(
                "relative_buckets needs at least 2 buckets per direction and max_distance above "
                "the exactly bucketed distances (num_buckets / 2 per direction). Received: "
                f"num_buckets={self.num_buckets}, bidirectional={bidirectional}, "
                f"max_distance={max_distance}"
            )

    def tensors(self):
        return (self.table,)

    def bucket(self, d: Tensor) -> Tensor:
        """T5's bucket of each distance d = j - i' (Raffel et al. 2020): exact buckets for short
        distances, then logarithmically wider ones up to ``max_distance``; with
        ``bidirectional`` the upper half of the buckets holds keys to the right."""
        n = self.num_buckets
        offset = torch.zeros_like(d)
        if self.bidirectional:
            n //= 2
            offset = (d > 0).long() * n
            dist = d.abs()
        else:
            dist = (-d).clamp_min(0)  # keys to the right share bucket 0
        exact = n // 2
        # in float32, as T5 computes it: the bucket edges are those of that arithmetic
        scaled = torch.log(dist.clamp_min(1).float() / exact) / math.log(self.max_distance / exact)
        far = (exact + (scaled * (n - exact)).long()).clamp_max(n - 1)
        return offset + torch.where(dist < exact, dist, far)

    def _at(self, h, d):
        return self.table[self.bucket(d), h]

    def _moved(self, device):
        if device is None:
            return self
        return _RelativeBuckets(
            self.table.to(device), self.bidirectional, self.max_distance, self.align
        )

    def heads(self, index):
        return _RelativeBuckets(
            self.table[:, index.to(self.table.device)],
            self.bidirectional,
            self.max_distance,
            self.align,
        )

    def check(self, batch, heads, length_q, length_k):
        super().check(batch, heads, length_q, length_k)
        if not bool(torch.isfinite(self.table).all()):
            raise ValueError(
                "the relative_buckets table must be finite. Received: inf or NaN entries"
            )

    def __repr__(self):
        return (
            f"relative_buckets({self.num_buckets} buckets x {self.num_heads} heads, "
            f"bidirectional={self.bidirectional}, max_distance={self.max_distance})"
        )


def relative_buckets(
    table: Tensor,
    *,
    bidirectional: bool = True,
    max_distance: int = 128,
    align: str = "bottom_right",
) -> ScoreModifier:
    """T5's bucketed relative position bias (Raffel et al. 2020, section 2.1).

    Each (query, key) pair gets ``table[bucket(j - i'), h]``: one learned scalar per bucket and
    head; half of a direction's buckets are exact distances, the rest grow logarithmically up
    to ``max_distance`` (farther pairs share the last bucket). Gradients reach ``table``.

    Args:
        table: (num_buckets, H) float tensor, e.g. an ``nn.Parameter`` (T5: 32 buckets).
        bidirectional: separate buckets for keys to the right (encoders; False for decoders).
        max_distance: distance where the last bucket starts (T5: 128).
        align: "bottom_right" (default) or "top_left"; they agree when L = S.
    """
    return _RelativeBuckets(table, bidirectional, max_distance, align)


class _NotAdditive(ScoreModifier):
    """A modifier that is not a term added to the scores (a cap, sink logits): it joins a sum
    with ``+`` so that ``bias=`` takes everything at once, and ``split`` hands it to backends
    apart from the additive terms."""

    label = "modifier"

    def _not_additive(self) -> TypeError:
        return TypeError(
            f"{self!r} is not an additive term: it has no values of its own to lower. Pass it "
            "to attention(..., bias=...), which applies it, or use "
            "multihead.bias.split(bias).additive for the additive part of a sum. "
            f"Received: {self!r}"
        )

    def block(self, length_q, length_k, q0, q1, k0, k1, *, batch=None, device=None, dtype=None):
        raise self._not_additive()

    def score_mod(self, length_q, length_k, *, device=None):
        raise self._not_additive()

    def heads(self, index):
        return self

    def crop(self, length_q, length_k, q0, q1, k0, k1):
        # the same for every query and key: a shard's modifier is this one
        return self


class _Softcap(_NotAdditive):
    label = "softcap"

    def __init__(self, cap: float) -> None:
        ok = isinstance(cap, (int, float)) and not isinstance(cap, bool)
        if not ok or not math.isfinite(cap) or cap <= 0:
            raise ValueError(
                "softcap takes a finite positive number: scores become cap * tanh(score / cap). "
                f"Received: cap={cap!r}"
            )
        self.cap = float(cap)

    def tensors(self):
        return ()

    @property
    def structure_key(self):
        return ("softcap", self.cap)

    def __repr__(self):
        return f"softcap({self.cap:g})"


def softcap(cap: float) -> ScoreModifier:
    """Logit soft-capping (Gemma 2, section 2; Grok-1): each scaled score ``s = q . k * scale``
    becomes ``cap * tanh(s / cap)``, bounded by ``cap`` in magnitude, before any additive term
    and before the mask.

    Combines with additive terms by ``+``; the result is::

        scores = cap * tanh(q @ k.T * scale / cap) + additive terms, then the mask

    Gradients flow through the cap (``1 - tanh(s / cap) ** 2``).

    Args:
        cap: a finite positive number (Gemma 2 uses 50.0 on attention logits).

    Raises:
        ValueError: ``cap`` is not a finite positive number.
    """
    return _Softcap(cap)


class _Sinks(_NotAdditive):
    label = "sinks"

    def __init__(self, logits: Tensor) -> None:
        if not isinstance(logits, Tensor) or logits.dim() != 1 or not logits.is_floating_point():
            got = tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
            raise ValueError(
                f"sinks takes a 1-D float tensor of one logit per query head, (H,). Received: {got}"
            )
        self.logits = logits
        self.num_heads = logits.shape[0]

    def tensors(self):
        return (self.logits,)

    def heads(self, index):
        return _Sinks(self.logits[index.to(self.logits.device)])

    def check(self, batch, heads, length_q, length_k):
        if self.num_heads != heads:
            raise ValueError(
                f"sinks need one logit per query head: H={heads}, so {heads} logits. "
                f"Received: {self.num_heads} logits"
            )
        if not bool(torch.isfinite(self.logits).all()):
            raise ValueError("sink logits must be finite. Received: inf or NaN logits")

    def __repr__(self):
        return f"sinks({self.num_heads} heads)"


def sinks(logits: Tensor) -> ScoreModifier:
    """Attention sinks (gpt-oss; Xiao et al. 2024): one learned logit per head that takes part
    in every row's softmax denominator but has no value, so a row may give part of its weight
    to nothing. For row i of head h::

        weights[i, j] = exp(s[i, j]) / (exp(sinks[h]) + sum over visible j' of exp(s[i, j']))
        out[i] = sum over j of weights[i, j] * v[j]            # the weights sum to less than 1

    A row that sees no key still outputs exactly 0. Gradients reach ``logits``.

    Args:
        logits: (H,) float tensor, one logit per query head (an ``nn.Parameter`` to learn it).

    Raises:
        ValueError: ``logits`` is not a 1-D float tensor, or (when used) has a length other
            than H or holds inf/NaN.
    """
    return _Sinks(logits)


class Terms(NamedTuple):
    """A ``bias=`` argument taken apart for backends: the additive terms (a modifier or None),
    the soft cap (or None) and the sink logits (H,) (or None)."""

    additive: ScoreModifier | None
    softcap: float | None
    sinks: Tensor | None


def split(bias: ScoreModifier | None) -> Terms:
    """``bias`` as its additive part, its soft cap and its sink logits (each None if absent)."""
    parts = bias.parts if isinstance(bias, _Sum) else ((bias,) if bias is not None else ())
    additive = [p for p in parts if not isinstance(p, _NotAdditive)]
    cap = next((p.cap for p in parts if isinstance(p, _Softcap)), None)
    logits = next((p.logits for p in parts if isinstance(p, _Sinks)), None)
    if not additive:
        return Terms(None, cap, logits)
    return Terms(additive[0] if len(additive) == 1 else _Sum(tuple(additive)), cap, logits)
