"""``KVCache``: the keys and values of every past token, per layer, with per-row lengths.

Incremental decoding projects only the new tokens; their keys and values are appended to the
cache and the queries attend to everything the row has seen. Rows keep their own lengths, so a
batch of prompts of different lengths decodes together and each row gets exactly what it would
get alone: row b's tokens sit at cache slots 0, 1, ... whatever the other rows hold, and its
queries see only its own prefix (``masks.lengths`` with a length per query, which the tiled
backend turns into one kernel call per row over exactly that prefix).

Three layouts:

* fixed (``max_length=N``): preallocated once; asking for more raises;
* growing (``max_length=None``): capacity doubles when needed (amortized O(1) per token);
* rolling (``window=W``): a sliding-window model keeps only each row's last W tokens in a ring
  of W slots; memory stays O(W) however long the generation runs.

With ``policy=`` (a ``multihead.kv`` policy) the cache is compressed from the attention's own
scores: each layer's prompt step asks the attention for the policy's statistic
(``LayerCache.request``) and hands it back (``LayerCache.observe``), and the layer's keys and
values are then kept in a ``multihead.kv.LayerState`` of the kept slots only; new tokens keep
the positions the uncompressed sequence gives them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .. import _validation as V
from .. import masks
from ..kv import LayerState, Policy, causal_band, grouped, request
from ..masks import Mask

__all__ = ["CacheStep", "KVCache", "LayerCache"]

_GROW_QUANTUM = 64  # growing caches allocate whole multiples of this many slots


class CacheStep(NamedTuple):
    """What ``KVCache.begin`` prepared for one forward pass over L new tokens per row.

    positions: (B, L) absolute position of every new token (row b's first new token is at
        the row's previous length); 0 at padding slots beyond ``counts``.
    counts: (B,) real new tokens per row; the rest of the L are padding and see nothing.
    mask: the mask every layer's attention uses this step, over (L queries) x (S keys); None
        when every query sees every key.
    length: S, the key columns every layer's attention gets this step.
    """

    positions: Tensor
    counts: Tensor
    mask: Mask | None
    length: int


class LayerCache:
    """One layer's view of a ``KVCache`` (``cache[i]``): what an attention module is given."""

    def __init__(self, cache: KVCache, layer: int) -> None:
        self.cache, self.layer = cache, layer

    @property
    def positions(self) -> Tensor:
        """(B, L) positions of the new tokens of the current step (for rotary embeddings)."""
        return self.cache.step.positions

    def update(
        self, key: Tensor, value: Tensor, *, heads: int | None = None
    ) -> tuple[Tensor, Tensor, Mask | None]:
        """Store this step's keys (B, H_kv, L, D) and values (B, H_kv, L, D_v); see
        ``KVCache.update`` (``heads``: the query heads H, which a compressed layer's mask
        needs)."""
        return self.cache.update(self.layer, key, value, heads=heads)

    @property
    def compressing(self) -> bool:
        """Whether the cache compresses with a policy (the attention then scores for it)."""
        return self.cache.policy is not None

    @property
    def rolling(self) -> bool:
        """Whether the cache is a ring of W slots (``window=``): a call's keys are then the
        ring's slots followed by the new tokens, not the input's positions."""
        return self.cache.window is not None

    def request(self) -> tuple[str, int | None] | None:
        """The statistic this step's attention should compute for the cache's policy,
        ``(name, window)`` as ``multihead.attention_stats`` takes them, or None."""
        return self.cache.request(self.layer)

    def observe(self, scores: Tensor | None) -> None:
        """Hand back the statistic ``request`` asked for ((B, H, S) per query head), or None;
        the layer is then compressed (the prompt) or kept at its budget (decoding)."""
        self.cache.observe(self.layer, scores)


def _check_policy(policy: object, window: int | None) -> None:
    """A compression policy is a ``multihead.kv`` record, for a cache that is not rolling."""
    if policy is None:
        return
    if not isinstance(policy, Policy):
        raise TypeError(
            "policy must be a multihead.kv policy record (SnapKV, H2O, TOVA, "
            f"StreamingLLM). Received: policy of type {type(policy).__name__}"
        )
    if window is not None:
        raise ValueError(
            "a rolling cache (window=) already keeps a fixed number of keys; compress a "
            f"growing or fixed cache instead. Received: window={window}, policy={policy!r}"
        )


class KVCache:
    """Keys and values of past tokens for every layer of a decoder, with one length per row.

    Usage, once per forward pass of L new tokens per row (prefill: the prompts; decoding: one
    token, or several for speculative or chunked steps)::

        step = cache.begin(counts)             # counts (B,): real new tokens in each row
        x = embed(ids, step.positions)         # (B, L, E), positions continue every row
        for i, layer in enumerate(layers):
            x = layer(x, cache=cache[i])       # attention calls cache[i].update(k, v)

    ``update`` writes the new keys and values after each row's own last token and returns
    the keys, values and mask to attend with: rows of different lengths never see each
    other's padding, and a step costs O(S) (no past token is recomputed).

    Args:
        num_layers: layers in the model; each gets its own keys and values.
        batch_size: B rows, each with its own length.
        num_kv_heads: H_kv (grouped-query attention caches only the key/value heads).
        head_dim: D of the keys.
        max_length: slots per row, preallocated; None grows on demand.
        window: W for a sliding-window model: each query sees itself and the W - 1 tokens
            before it (Mistral's ``sliding_window``), and only W tokens per row are kept.
            Exclusive with ``max_length``.
        value_dim: D_v of the values (default D).
        dtype, device: of the stored keys and values (the model's).
        policy: a ``multihead.kv`` policy: compress each layer after the prompt (and, for
            H2O, TOVA and StreamingLLM, keep it at its budget while decoding). Exclusive with
            ``window``.
    """

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        max_length: int | None = None,
        window: int | None = None,
        value_dim: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        policy: Policy | None = None,
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("batch_size", batch_size),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            V.check_positive_int(name, value)
        if max_length is not None and window is not None:
            raise ValueError(
                "a rolling cache (window=) keeps the last W tokens and has no maximum length; "
                f"pass one of them. Received: max_length={max_length}, window={window}"
            )
        _check_policy(policy, window)
        if max_length is not None:
            V.check_positive_int("max_length", max_length)
        if window is not None:
            V.check_positive_int("window", window)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating torch.dtype. Received: dtype={dtype!r}")
        self.num_layers, self.batch_size = num_layers, batch_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.value_dim = (
            head_dim if value_dim is None else V.check_positive_int("value_dim", value_dim)
        )
        self.max_length, self.window = max_length, window
        self.dtype, self.device = dtype, torch.device(device or "cpu")
        capacity = window or max_length or 0
        self._keys = self._empty(capacity, self.head_dim)
        self._values = self._empty(capacity, self.value_dim)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=self.device)
        self._host = [0] * batch_size  # lengths on the host: no device sync to plan a step
        self._step: CacheStep | None = None
        self._written: set[int] = set()
        # the current step: each row's length before it, its width L, where the new tokens
        # go ((rows, columns, slots), None for one slice), and for a rolling cache the
        # position held by every key column
        self._offsets: list[int] = []
        self._width = 0
        self._slots: tuple[Tensor, Tensor, Tensor] | None = None
        self._held: Tensor | None = None
        self.policy = policy
        self._states: dict[int, LayerState] = {}  # the compressed layers

    def _empty(self, capacity: int, dim: int) -> Tensor:
        # zeros rather than empty: slots nobody wrote are masked anyway, but stay finite
        shape = (self.num_layers, self.batch_size, self.num_kv_heads, capacity, dim)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def __repr__(self) -> str:
        kind = (
            f"window={self.window}"
            if self.window
            else f"max_length={self.max_length}"
            if self.max_length
            else "growing"
        )
        return (
            f"KVCache(layers={self.num_layers}, B={self.batch_size}, H_kv={self.num_kv_heads}, "
            f"D={self.head_dim}, {kind}, capacity={self.capacity}, lengths={self._host})"
        )

    @property
    def capacity(self) -> int:
        """Slots allocated per row (W for a rolling cache)."""
        return self._keys.shape[3]

    @property
    def bytes_per_token(self) -> int:
        """Memory one token of one row takes: layers x H_kv x (D + D_v) x bytes per element.
        GPT-2 small in fp32: 12 x 12 x 128 x 4 = 73,728 bytes (72 KiB)."""
        size = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * self.num_kv_heads * (self.head_dim + self.value_dim) * size

    @property
    def nbytes(self) -> int:
        """Memory allocated for keys and values, all layers and rows (with a policy: the
        compressed layers' kept keys and values, plus what the uncompressed ones hold)."""
        held = self._keys.nbytes + self._values.nbytes
        return held + sum(state.nbytes for state in self._states.values())

    @property
    def states(self) -> dict[int, LayerState]:
        """``{layer: LayerState}``: the layers compressed so far (with ``policy``)."""
        return dict(self._states)

    @property
    def kept(self) -> dict[int, Tensor | list[list[Tensor]]]:
        """``{layer: positions}``, the positions each KV head of a compressed layer keeps,
        ascending (``LayerState.kept``)."""
        return {layer: state.kept() for layer, state in sorted(self._states.items())}

    def request(self, layer: int) -> tuple[str, int | None] | None:
        """The statistic layer ``layer``'s attention computes this step for the policy:
        ``(name, window)``, or None (no policy, or none needed this step)."""
        if self.policy is None:
            return None
        return request(self.policy, self._states.get(layer), self._width)

    def observe(self, layer: int, scores: Tensor | None) -> None:
        """Take layer ``layer``'s statistic for this step (``request``): compress the layer
        after the prompt, keep it at its budget while decoding."""
        policy = self.policy
        if policy is None:
            return
        kv_scores = None if scores is None else grouped(scores, self.num_kv_heads)
        state = self._states.get(layer)
        if state is not None:
            state.observe(kv_scores, self._width)
            return
        step = self.step
        keys = self._keys[layer].narrow(2, 0, step.length)
        values = self._values[layer].narrow(2, 0, step.length)
        slots = torch.arange(step.length, device=self.device)
        valid = slots[None] < self.lengths[:, None]  # (B, S): each row's own tokens
        state = LayerState.from_prompt(
            policy,
            keys.clone(),
            values.clone(),
            kv_scores,
            valid,
            ends=self.lengths.clone(),
            place=(layer, self.num_layers),
        )
        self._states[layer] = state
        if len(self._states) == self.num_layers:  # every layer holds its own: free the rest
            self._keys = self._empty(0, self.head_dim)
            self._values = self._empty(0, self.value_dim)

    @property
    def step(self) -> CacheStep:
        """The step ``begin`` started last."""
        if self._step is None:
            raise ValueError("the cache has no step yet; call cache.begin(counts) first")
        return self._step

    def __getitem__(self, layer: int) -> LayerCache:
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise TypeError(f"index a cache by layer number. Received: {layer!r}")
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer must be in [0, {self.num_layers}). Received: layer={layer}")
        return LayerCache(self, layer)

    def begin(self, counts: Tensor | int, length: int | None = None) -> CacheStep:
        """Start a forward pass that appends ``counts[b]`` tokens to row b.

        Args:
            counts: (B,) integers (or one int for every row): real new tokens per row. The
                new tokens of a row come first in its L slots (right padding).
            length: L, the width of the new tokens (default ``max(counts)``).

        Returns:
            The ``CacheStep`` (positions, mask) every layer of this pass uses. The lengths
            advance now; each layer must then call ``update`` once.

        Raises:
            ValueError: counts outside [0, L], a step left unfinished by some layer, or a
                fixed cache too small for the new tokens.
        """
        if self._step is not None and len(self._written) != self.num_layers:
            missing = sorted(set(range(self.num_layers)) - self._written)
            raise ValueError(
                "the previous step is unfinished: every layer must call update once per step. "
                f"Received: no update from layers {missing}"
            )
        b = self.batch_size
        host, width = self._counts(counts, length)
        offsets = self._host
        if self.window is None and len(self._states) < self.num_layers:
            self._reserve(max(o + c for o, c in zip(offsets, host)))
        counts_t = torch.tensor(host, dtype=torch.long, device=self.device)
        offsets_t = self.lengths
        ar = torch.arange(width, device=self.device)
        uniform = len(set(offsets)) == 1 and min(host) == width
        if uniform:
            positions = (ar + offsets[0]).expand(b, width)
        else:
            real = ar[None] < counts_t[:, None]  # [B, L]
            positions = torch.where(real, offsets_t[:, None] + ar, 0)
        mask, key_length = self._step_mask(offsets, host, counts_t, ar, uniform)
        self._host = [o + c for o, c in zip(offsets, host)]
        self.lengths = offsets_t + counts_t
        self._offsets, self._width = offsets, width
        self._step = CacheStep(positions, counts_t, mask, key_length)
        self._written = set()
        return self._step

    def _counts(self, counts: Tensor | int, length: int | None) -> tuple[list[int], int]:
        """``begin``'s counts as host ints (one per row) and the step's width L, checked."""
        b = self.batch_size
        if isinstance(counts, Tensor):
            counts = V.check_index_tensor("counts", counts, (1,), "(B,)")
            if counts.shape[0] != b:
                raise ValueError(
                    f"counts must have one entry per row, B={b}. "
                    f"Received: counts.shape={tuple(counts.shape)}"
                )
            host = [int(c) for c in counts.tolist()]
        elif isinstance(counts, int) and not isinstance(counts, bool):
            host = [counts] * b
        else:
            raise TypeError(f"counts must be an int or a (B,) tensor. Received: {counts!r}")
        width = max(host) if length is None else V.check_positive_int("length", length)
        if min(host) < 0 or max(host) > width:
            raise ValueError(f"counts must be in [0, L] with L={width}. Received: counts={host}")
        return host, width

    def _step_mask(
        self, offsets: list[int], host: list[int], counts_t: Tensor, ar: Tensor, uniform: bool
    ) -> tuple[Mask | None, int]:
        """The step's mask and key length S, and the cache slots its new tokens go to."""
        width, offsets_t = ar.shape[0], self.lengths
        if self.window is not None:
            window = self.window
            return self._rolling_plan(offsets_t, counts_t, ar, window), window + width
        if uniform:
            # every row sees its whole prefix: nothing to mask for one new token, and the
            # bottom-right causal mask for several
            self._slots = None
            return (None if width == 1 else masks.causal()), offsets[0] + width
        real = ar[None] < counts_t[:, None]
        valid = torch.where(real, offsets_t[:, None] + ar + 1, 0)  # [B, L] keys per query
        rows, cols = real.nonzero(as_tuple=True)
        self._slots = (rows, cols, offsets_t[rows] + cols)
        return masks.lengths(valid), max(o + c for o, c in zip(offsets, host))

    def _reserve(self, need: int) -> None:
        if need <= self.capacity:
            return
        if self.max_length is not None:
            raise ValueError(
                f"the cache holds max_length={self.max_length} tokens per row, and this step "
                f"needs {need}; make a larger cache or pass max_length=None to grow. "
                f"Received: lengths {self._host} before the step"
            )
        grown = max(need, 2 * self.capacity)
        grown = -(-grown // _GROW_QUANTUM) * _GROW_QUANTUM
        keys, values = self._empty(grown, self.head_dim), self._empty(grown, self.value_dim)
        keys[..., : self.capacity, :] = self._keys
        values[..., : self.capacity, :] = self._values
        self._keys, self._values = keys, values

    def _rolling_plan(self, offsets: Tensor, counts: Tensor, ar: Tensor, w: int) -> Mask:
        """Keys of a rolling step are the W ring slots followed by the L new tokens; the ring
        slot j of a row with offset o holds the latest position a < o with a = j (mod W)."""
        o = offsets[:, None]  # [B, 1]
        j = torch.arange(w, device=self.device)
        held = o - 1 - torch.remainder(o - 1 - j, w)  # [B, W], < 0 when the slot is empty
        query = o + ar  # [B, L] absolute position of each new token
        real_q = ar[None] < counts[:, None]  # [B, L]
        ring = (held[:, None, :] >= 0) & (held[:, None, :] > query[:, :, None] - w)
        gap = ar[:, None] - ar[None, :]  # [L, L] query i - new key i'
        new = (gap >= 0) & (gap < w) & real_q[:, None, :]  # [B, L, L]
        keep = torch.cat((ring, new), dim=-1) & real_q[:, :, None]  # [B, L, W + L]
        self._held = torch.cat(
            (torch.where(held >= 0, held, -1), torch.where(real_q, query, -1)), dim=-1
        )
        # the last W new tokens of each row go to the ring (earlier ones would be overwritten)
        store = real_q & (ar[None] >= counts[:, None] - w)
        rows, cols = store.nonzero(as_tuple=True)
        self._slots = (rows, cols, (offsets[rows] + cols) % w)
        return masks.dense(keep[:, None])

    def key_positions(self) -> Tensor:
        """(B, S) absolute position of the token behind every key column of the current step,
        -1 for columns that hold no token of that row (padding, empty ring slots). Use it to
        read weights returned during decoding: column s of row b is token
        ``key_positions()[b, s]``."""
        step = self.step
        if self._held is not None:  # a rolling cache's columns (set by begin)
            return self._held
        ar = torch.arange(step.length, device=self.device)
        return torch.where(ar[None] < self.lengths[:, None], ar, -1)

    def update(
        self, layer: int, key: Tensor, value: Tensor, *, heads: int | None = None
    ) -> tuple[Tensor, Tensor, Mask | None]:
        """Store layer ``layer``'s keys and values for the new tokens of the current step.

        Args:
            layer: the layer index.
            key: (B, H_kv, L, D) keys of the new tokens (after any rotary embedding).
            value: (B, H_kv, L, D_v).
            heads: the query heads H of the attention (needed once the layer is compressed:
                its mask then differs per KV head, and so per query head).

        Returns:
            ``(keys, values, mask)`` to attend with: keys (B, H_kv, S, D) and values
            (B, H_kv, S, D_v) of every token each row holds (views of the cache, no copy,
            except for a rolling cache), and the step's mask over (L, S).
        """
        _ = self.step  # a cache with no step yet raises here, before the other checks
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise TypeError(f"layer must be an int. Received: layer={layer!r}")
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer must be in [0, {self.num_layers}). Received: layer={layer}")
        if layer in self._written:
            raise ValueError(
                f"layer {layer} already stored its keys this step; call cache.begin(counts) "
                f"before the next forward pass. Received: a second update for layer {layer}"
            )
        want = (self.batch_size, self.num_kv_heads, self._width)
        for name, t, dim in (("key", key, self.head_dim), ("value", value, self.value_dim)):
            V.check_rank(name, t, 4, "(B, H_kv, L, D)")
            if tuple(t.shape) != (*want, dim):
                raise ValueError(
                    f"{name} must have shape (B, H_kv, L, D)={(*want, dim)} for this cache and "
                    f"step. Received: {name}.shape={tuple(t.shape)}"
                )
            if t.dtype != self.dtype:
                raise TypeError(
                    f"{name} must have the cache's dtype {self.dtype}; build the cache with "
                    f"the model's dtype. Received: {name}.dtype={t.dtype}"
                )
        if self.window is None and V.tracing():
            if self.policy is not None:
                raise ValueError(
                    "a compressed cache changes its size with the scores and cannot be traced "
                    f"into a graph. Received: policy={self.policy!r} under tracing"
                )
            self._written.add(layer)
            return self._update_traced(self._keys[layer], self._values[layer], key, value)
        if layer in self._states:
            return self._append_compressed(layer, key, value, heads)
        return self._append(layer, key, value)

    def _append_compressed(
        self, layer: int, key: Tensor, value: Tensor, heads: int | None
    ) -> tuple[Tensor, Tensor, Mask | None]:
        """A compressed layer's update: the new tokens appended to its kept slots, and the
        step's mask (made for the uncompressed rows) read at the kept positions."""
        step, state = self.step, self._states[layer]
        self._written.add(layer)
        ragged = int(step.counts.min()) != key.shape[2]  # padding among the new tokens
        keys, values = state.append(key, value, step.counts if ragged else None)
        width, heads = key.shape[2], heads or self.num_kv_heads
        if step.mask is None:
            seen = state.slot_mask(None, heads)
        else:  # the step's mask (the same for every head) read at the kept positions alone
            seen = state.slot_mask_of(step.mask.mask_mod(width, step.length), heads, width)
        if seen is None:
            return keys, values, None
        return keys, values, (masks.causal() if causal_band(seen) else masks.dense(seen))

    def _append(self, layer: int, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Mask | None]:
        """``update`` outside a traced graph, without its checks: for a caller that built
        ``key`` and ``value`` to the cache's own shapes and dtype for this step
        (``modules/decoding_python.py``)."""
        step = self.step
        keys, values = self._keys[layer], self._values[layer]  # [B, H_kv, capacity, D]
        self._written.add(layer)
        if self.window is not None:
            out_k, out_v = torch.cat((keys, key), dim=2), torch.cat((values, value), dim=2)
            self._store(keys, values, key, value)
            return out_k, out_v, step.mask
        if self._slots is None:  # uniform rows: one slice
            start = self._offsets[0]
            keys.narrow(2, start, self._width).copy_(key)
            values.narrow(2, start, self._width).copy_(value)
        else:
            self._store(keys, values, key, value)
        length = step.length
        return keys.narrow(2, 0, length), values.narrow(2, 0, length), step.mask

    def _update_traced(
        self, keys: Tensor, values: Tensor, key: Tensor, value: Tensor
    ) -> tuple[Tensor, Tensor, Mask]:
        """``update`` inside a compiled or exported graph: no host value is read, so the
        graph holds for every step and row length (a static-cache decode step).

        Row b's L new tokens go to slots ``offset[b] + i`` by one scatter, padding included
        (slots past the row's length, hidden until a later real token overwrites them, so
        the cache must have room for offset + L: a fixed ``max_length`` cache sized for the
        whole generation, as ``generate`` makes). The queries attend over every slot of the
        cache through a per-query lengths mask computed on the device.
        """
        step = self.step
        width = key.shape[2]
        ar = torch.arange(width, device=key.device)
        slots = (self.lengths - step.counts)[:, None] + ar  # [B, L] where the new tokens go
        for store, new in ((keys, key), (values, value)):
            store.scatter_(2, slots[:, None, :, None].expand_as(new), new)
        valid = torch.where(ar < step.counts[:, None], slots + 1, 0)  # [B, L] keys per query
        return keys, values, masks.lengths(valid)

    def _store(self, keys: Tensor, values: Tensor, key: Tensor, value: Tensor) -> None:
        if self._slots is None:  # begin() plans the slots of every step that stores rows
            raise RuntimeError("KVCache._store called without a planned step")
        rows, cols, slots = self._slots
        keys[rows, :, slots] = key.transpose(1, 2)[rows, cols]  # [N, H_kv, D]
        values[rows, :, slots] = value.transpose(1, 2)[rows, cols]
