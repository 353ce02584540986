"""``MultiHeadAttention``: project, split into heads, attend, merge, project back.

The module holds parameters and reshapes; all attention math lives in ``multihead.attention``.
It is the library's reader of ``multihead.acting``'s plans: a call from a layer an active
block covers (capture, ablate, knockout, patch) runs through ``acting.run_plan``, as a
transformers model's calls do on the bridge, and the blocks find a model's layers as its
``MultiHeadAttention`` modules in order (the reader registered at the end of this file).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, cast

import torch
from torch import Tensor, nn

from .. import _validation as V
from .. import acting
from .. import decoding_routes as routes
from .._saveable import saveable
from ..backends.call import prepare
from ..functional import AttentionOutput, attention, attention_with_weights, check_heads
from ..masks import Mask
from ..stats import Reducer, attention_stats
from .cache import LayerCache
from .rotary import RotaryEmbedding

__all__ = ["AttentionOutput", "MultiHeadAttention", "merge_heads", "split_heads"]


def split_heads(x: Tensor, num_heads: int) -> Tensor:
    """(B, L, H * D) -> (B, H, L, D): view the last dim as H heads, then put heads first.

    Example with B=1, L=3, H=2, D=2: position 0 holds ``[1, 2, 3, 4]``; head 0 gets ``[1, 2]``
    and head 1 gets ``[3, 4]``.
    """
    V.check_rank("x", x, 3, "(B, L, H * D)")
    V.check_positive_int("num_heads", num_heads)
    b, length, width = x.shape
    if width % num_heads:
        raise ValueError(
            "the last dimension of x must be divisible by num_heads. "
            f"Received: x.shape={tuple(x.shape)}, num_heads={num_heads}"
        )
    return x.view(b, length, num_heads, width // num_heads).transpose(1, 2)


def merge_heads(x: Tensor) -> Tensor:
    """(B, H, L, D) -> (B, L, H * D): the inverse of ``split_heads`` (concatenate the heads)."""
    V.check_rank("x", x, 4, "(B, H, L, D)")
    b, h, length, d = x.shape
    return x.transpose(1, 2).reshape(b, length, h * d)


@saveable("multihead.MultiHeadAttention")
class MultiHeadAttention(nn.Module):
    """Multi-head attention on batch-first (B, L, E) tensors.

    ``q = split_heads(q_proj(query))``, the same for key and value with H_kv heads, then
    ``out_proj(merge_heads(attention(q, k, v, mask)))``. ``forward`` returns that tensor;
    ``run`` returns ``AttentionOutput(output, weights)`` with the per-head weights.

    Args:
        embed_dim: E, the query (and output) width; divisible by ``num_heads`` unless
            ``head_dim`` is given.
        num_heads: H query heads, each of dim D = E / H.
        kdim: width of the key input (default E).
        vdim: width of the value input (default E).
        num_kv_heads: H_kv key/value heads for grouped-query attention (default H); divides H.
        bias: whether the four projections have biases.
        dropout: dropout on the attention weights while training, in [0, 1).
        head_dim: D per head for queries and keys (default E // H); when given, E need not be
            divisible by H (Keras' ``key_dim``).
        value_head_dim: D_v per head for values (default D; Keras' ``value_dim``).
        out_dim: width of the output (default E; Keras' ``output_shape``).
        rotary: a ``RotaryEmbedding`` over D applied to the projected queries and keys of
            self-attention (Llama, GPT-NeoX), at the ``positions`` given to ``forward``.

    Shapes: ``q_proj`` E -> H * D, ``k_proj`` kdim -> H_kv * D, ``v_proj`` vdim -> H_kv * D_v,
    ``out_proj`` H * D_v -> out_dim.
    """

    @V.torch_keywords("MultiHeadAttention()")
    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        kdim: int | None = None,
        vdim: int | None = None,
        num_kv_heads: int | None = None,
        bias: bool = True,
        dropout: float = 0.0,
        head_dim: int | None = None,
        value_head_dim: int | None = None,
        out_dim: int | None = None,
        rotary: RotaryEmbedding | None = None,
    ) -> None:
        super().__init__()
        if head_dim is None:
            self.num_kv_heads = V.check_heads(embed_dim, num_heads, num_kv_heads)
            head_dim = embed_dim // num_heads
        else:  # an explicit D frees E from divisibility; the H_kv checks still apply
            V.check_positive_int("embed_dim", embed_dim)
            V.check_positive_int("num_heads", num_heads)
            V.check_positive_int("head_dim", head_dim)
            self.num_kv_heads = V.check_heads(num_heads * head_dim, num_heads, num_kv_heads)
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, head_dim
        self.kdim = embed_dim if kdim is None else V.check_positive_int("kdim", kdim)
        self.vdim = embed_dim if vdim is None else V.check_positive_int("vdim", vdim)
        self.value_head_dim = (
            head_dim
            if value_head_dim is None
            else V.check_positive_int("value_head_dim", value_head_dim)
        )
        self.out_dim = embed_dim if out_dim is None else V.check_positive_int("out_dim", out_dim)
        self.dropout = V.check_dropout(dropout, "dropout")
        self.q_proj = nn.Linear(embed_dim, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(self.kdim, self.num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(self.vdim, self.num_kv_heads * self.value_head_dim, bias=bias)
        self.out_proj = nn.Linear(num_heads * self.value_head_dim, self.out_dim, bias=bias)
        if rotary is not None and (
            not isinstance(rotary, RotaryEmbedding) or rotary.head_dim != self.head_dim
        ):
            raise ValueError(
                f"rotary must be a RotaryEmbedding over the head dim D={self.head_dim}. "
                f"Received: rotary={rotary!r}"
            )
        self.rotary = rotary

    def extra_repr(self) -> str:
        kv = f", num_kv_heads={self.num_kv_heads}" if self.num_kv_heads != self.num_heads else ""
        dims = "".join(
            f", {name}={value}"
            for name, value, default in (
                ("head_dim", self.head_dim, self.embed_dim // self.num_heads),
                ("value_head_dim", self.value_head_dim, self.head_dim),
                ("out_dim", self.out_dim, self.embed_dim),
            )
            if value != default
        )
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}{kv}{dims}, "
            f"dropout={self.dropout}"
        )

    @V.torch_keywords("MultiHeadAttention.forward()")
    def forward(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        *,
        mask: Mask | Tensor | None = None,
        bias: Tensor | None = None,
        positions: Tensor | None = None,
        cache: LayerCache | None = None,
    ) -> Tensor:
        """Attend from ``query`` to ``key``/``value`` (self-attention when both are omitted).

        Args:
            query: (B, L, E).
            key: (B, S, kdim); defaults to ``value`` when only ``value`` is given (as in Keras,
                ``mha(query=q, value=context)`` attends to ``context``), else to ``query``.
            value: (B, S, vdim); defaults to ``key``.
            mask: a ``multihead.masks.Mask``, a bool tensor (True = may attend) or the result
                of ``masks.from_torch(...)`` (its additive part joins ``bias``).
            bias: additive scores broadcastable to (B, H, L, S).
            positions: (B, L) or (L,) integer positions for the rotary embedding; default
                the cache step's positions, else 0..L-1.
            cache: this layer's ``KVCache`` view (``cache[i]``), for self-attention while
                decoding: the new keys and values are stored, the queries attend to every
                token the row holds, and the cache supplies the mask (so ``mask`` must be
                None).

        Returns:
            (B, L, out_dim), always a tensor; ``run`` also returns the weights.

        Raises:
            TypeError: torch-style keywords (``attn_mask``, ``key_padding_mask``,
                ``need_weights``), non-float inputs or inputs of another dtype than the
                parameters (outside autocast).
        """
        plan = acting.plan_for(self)
        compressing = _compressing(cache)
        if compressing:
            _check_alone(plan)
        _check_knockouts(plan, cache)
        q, k, v, mask = self._project(query, key, value, mask, positions, cache)
        dropout_p = self._dropout_p()
        step = (
            cache is not None
            and bias is None
            and dropout_p == 0.0
            and (mask is None or isinstance(mask, Mask))
            and routes.applies(q, k, v)
        )
        way = acting.route(plan, compressing=compressing, step=step)
        if way == "compress":
            assert cache is not None
            return self.out_proj(merge_heads(_scored(cache, q, k, v, mask, bias)))
        if way == "plan":  # a block acts on this layer
            assert plan is not None
            call = prepare(q, k, v, mask, bias, None, dropout_p, False)
            out, _ = acting.run_plan(plan, call)
            return self.out_proj(merge_heads(out))
        if way == "step":
            # a decoding step: every layer's call has the step's mask (multihead/routes.py)
            out = routes.attend(q, k, v, mask, None, None)  # type: ignore[arg-type]
            return self.out_proj(out.reshape(out.shape[0], 1, -1))  # (B, 1, H, D_v) -> merged
        out = attention(q, k, v, mask, bias=bias, dropout_p=dropout_p)
        return self.out_proj(merge_heads(out))

    @V.torch_keywords("MultiHeadAttention.run()")
    def run(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        *,
        mask: Mask | Tensor | None = None,
        bias: Tensor | None = None,
        positions: Tensor | None = None,
        cache: LayerCache | None = None,
        heads: list[int] | None = None,
    ) -> AttentionOutput:
        """``forward`` that also returns the per-head weights: ``AttentionOutput(output,
        weights)`` whatever the arguments.

        Args:
            query, key, value, mask, bias, positions, cache: as in ``forward``.
            heads: query-head indices whose weights to compute and return, in that order
                (``multihead.attention_with_weights``); None: every head.

        Returns:
            output (B, L, out_dim), the same as ``forward`` gives; weights (B, H, L, S) before
            dropout, or (B, len(heads), L, S). With a cache, one weight column per cache slot.
        """
        if heads is not None:  # before the cache stores anything
            check_heads(heads, self.num_heads)
        compressing = _compressing(cache)
        if compressing and heads is not None:
            raise ValueError(
                "with a compressing cache run() returns every head's weights (the policy's "
                f"scores need them all). Received: heads={heads}"
            )
        plan = acting.plan_for(self)
        if compressing:
            _check_alone(plan)
        _check_knockouts(plan, cache)
        q, k, v, mask = self._project(query, key, value, mask, positions, cache)
        common: dict[str, Any] = {"bias": bias, "dropout_p": self._dropout_p()}
        if plan is None:
            out, weights = attention_with_weights(q, k, v, mask, heads=heads, **common)
        else:  # a block acts on this layer
            call = prepare(q, k, v, mask, common["bias"], None, common["dropout_p"], True)
            wanted = None if heads is None else tuple(heads)
            out, seen = acting.run_plan(plan, replace(call, heads=wanted))
            assert seen is not None  # asked for
            weights = seen
        if compressing:
            assert cache is not None
            cache.observe(_from_weights(cache, weights))
        return AttentionOutput(self.out_proj(merge_heads(out)), weights)

    def _dropout_p(self) -> float:
        return self.dropout if self.training else 0.0

    def _project(
        self,
        query: Tensor,
        key: Tensor | None,
        value: Tensor | None,
        mask: Mask | Tensor | None,
        positions: Tensor | None,
        cache: LayerCache | None,
    ) -> tuple[Tensor, Tensor, Tensor, Mask | Tensor | None]:
        """Check the call; project into heads q (B, H, L, D), k (B, H_kv, S, D), v (B, H_kv,
        S, D_v), with rotary positions applied and the cache updated (its mask returned)."""
        self._check_options(key is None and value is None, mask, positions, cache)
        if key is None:
            key = query if value is None else value
        value = key if value is None else value
        self._check_inputs(query, key, value)
        q = split_heads(self.q_proj(query), self.num_heads)  # [B, H, L, D]
        k = split_heads(self.k_proj(key), self.num_kv_heads)  # [B, H_kv, S, D]
        v = split_heads(self.v_proj(value), self.num_kv_heads)  # [B, H_kv, S, D_v]
        if self.rotary is not None:
            if positions is None and cache is not None:
                positions = cache.positions
            q, k = self.rotary(q, positions), self.rotary(k, positions)
        if cache is not None:
            if _compressing(cache):  # its mask differs per KV head: it needs H
                k, v, mask = cache.update(k, v, heads=self.num_heads)  # [B, H_kv, S_cache, D]
            else:
                k, v, mask = cache.update(k, v)
        return q, k, v, mask

    def _check_options(
        self,
        self_attention: bool,
        mask: Mask | Tensor | None,
        positions: Tensor | None,
        cache: LayerCache | None,
    ) -> None:
        if not self_attention and (cache is not None or self.rotary is not None):
            raise ValueError(
                "a KV cache and rotary embeddings apply to self-attention only; call with the "
                "query alone. Received: key or value together with "
                + ("cache=" if cache is not None else "a rotary embedding")
            )
        if cache is not None and mask is not None:
            raise ValueError(
                "with cache= the cache supplies the mask (each row sees its own prefix); for a "
                "sliding window build KVCache(window=W). Received: mask and cache together"
            )
        if positions is not None and self.rotary is None:
            raise ValueError(
                "positions= places rotary embeddings, and this module has none; add position "
                "information to the input instead. Received: positions with rotary=None"
            )

    def _check_inputs(self, query: Tensor, key: Tensor, value: Tensor) -> None:
        for name, t, width, letters in (
            ("query", query, self.embed_dim, "(B, L, E)"),
            ("key", key, self.kdim, "(B, S, kdim)"),
            ("value", value, self.vdim, "(B, S, vdim)"),
        ):
            V.check_rank(name, t, 3, letters)
            self._check_dtype(name, t)
            if t.shape[-1] != width:
                raise ValueError(
                    f"{name} must have last dimension {width} {letters}. "
                    f"Received: {name}.shape={tuple(t.shape)}"
                )
        if key.shape[:2] != value.shape[:2] or key.shape[0] != query.shape[0]:
            raise ValueError(
                "query, key and value must share the batch size B, and key and value the length "
                f"S. Received: query.shape={tuple(query.shape)}, key.shape={tuple(key.shape)}, "
                f"value.shape={tuple(value.shape)}"
            )

    def _compute_dtype(self) -> torch.dtype:
        """The dtype the inputs must have: the parameters' (packed bf16/int8 projections,
        modules/quant.py, say their activations' dtype). Read from the module's dicts and its
        class: a decoding step asks it of every layer, and an attribute a module lacks costs
        an exception inside ``nn.Module.__getattr__``."""
        q_proj: Any = self._modules["q_proj"]
        if hasattr(type(q_proj), "compute_dtype") or "compute_dtype" in vars(q_proj):
            declared = q_proj.compute_dtype
            if declared:
                return declared
        weight = q_proj._parameters.get("weight")
        return (q_proj.weight if weight is None else weight).dtype

    def _check_dtype(self, name: str, t: Tensor) -> None:
        want = self._compute_dtype()
        if not t.is_floating_point():
            raise TypeError(
                f"{name} must be a floating-point (B, L, E) tensor of embeddings; token ids go "
                f"through an nn.Embedding first, other values need .to({want}). "
                f"Received: {name}.dtype={t.dtype}"
            )
        if t.dtype != want and not torch.is_autocast_enabled(t.device.type):
            raise TypeError(
                f"{name} must have the dtype of the module's parameters, {want}: cast the input "
                f"with .to({want}) or the module with .to({t.dtype}) (or run under "
                f"torch.autocast). Received: {name}.dtype={t.dtype}"
            )

    @classmethod
    def from_torch(cls, module: nn.MultiheadAttention) -> MultiHeadAttention:
        """Copy a ``torch.nn.MultiheadAttention`` (packed or separate projection weights).

        The result takes batch-first inputs whatever the source's ``batch_first`` was.
        """
        if not isinstance(module, nn.MultiheadAttention):
            raise TypeError(
                "from_torch expects a torch.nn.MultiheadAttention. "
                f"Received: {type(module).__name__}"
            )
        if module.bias_k is not None or module.add_zero_attn:
            raise ValueError(
                "add_bias_kv and add_zero_attn have no counterpart here; append the extra key "
                "to the key/value inputs instead. Received: "
                f"add_bias_kv={module.bias_k is not None}, add_zero_attn={module.add_zero_attn}"
            )
        has_bias = module.in_proj_bias is not None
        new = cls(
            module.embed_dim,
            module.num_heads,
            kdim=module.kdim,
            vdim=module.vdim,
            bias=has_bias,
            dropout=module.dropout,
        )
        ref = module.out_proj.weight
        new.to(device=ref.device, dtype=ref.dtype)
        if module._qkv_same_embed_dim:
            weights = module.in_proj_weight.chunk(3)
        else:
            weights = (module.q_proj_weight, module.k_proj_weight, module.v_proj_weight)
        projections = (new.q_proj, new.k_proj, new.v_proj)
        with torch.no_grad():
            for proj, w in zip(projections, weights):
                proj.weight.copy_(w)
            new.out_proj.weight.copy_(module.out_proj.weight)
            if has_bias:
                for proj, b in zip(projections, module.in_proj_bias.chunk(3)):
                    proj.bias.copy_(b)
                new.out_proj.bias.copy_(module.out_proj.bias)
        return new.train(module.training)

    def to_torch(self) -> nn.MultiheadAttention:
        """Copy into a ``torch.nn.MultiheadAttention`` with ``batch_first=True``."""
        if self.num_kv_heads != self.num_heads:
            raise ValueError(
                "torch.nn.MultiheadAttention has no grouped-query attention; only modules with "
                f"num_kv_heads == num_heads convert. Received: num_heads={self.num_heads}, "
                f"num_kv_heads={self.num_kv_heads}"
            )
        if (self.num_heads * self.head_dim, self.value_head_dim, self.out_dim) != (
            self.embed_dim,
            self.head_dim,
            self.embed_dim,
        ):
            raise ValueError(
                "torch.nn.MultiheadAttention needs head_dim == embed_dim / num_heads, "
                "value_head_dim == head_dim and out_dim == embed_dim; convert with "
                "multihead.keras.to_keras(module) or "
                f"keep this module. Received: embed_dim={self.embed_dim}, "
                f"num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"value_head_dim={self.value_head_dim}, out_dim={self.out_dim}"
            )
        ref = self.out_proj.weight
        has_bias = self.out_proj.bias is not None
        module = nn.MultiheadAttention(
            self.embed_dim,
            self.num_heads,
            dropout=self.dropout,
            bias=has_bias,
            kdim=self.kdim,
            vdim=self.vdim,
            batch_first=True,
            device=ref.device,
            dtype=ref.dtype,
        )
        projections = (self.q_proj, self.k_proj, self.v_proj)
        with torch.no_grad():
            if module._qkv_same_embed_dim:
                module.in_proj_weight.copy_(torch.cat([p.weight for p in projections]))
            else:
                for target, p in zip(
                    (module.q_proj_weight, module.k_proj_weight, module.v_proj_weight), projections
                ):
                    target.copy_(p.weight)
            module.out_proj.weight.copy_(self.out_proj.weight)
            if has_bias:
                module.in_proj_bias.copy_(torch.cat([p.bias for p in projections]))
                module.out_proj.bias.copy_(self.out_proj.bias)
        return module.train(self.training)


def _check_alone(plan: acting.Plan | None) -> None:
    """A compressing cache scores every head of the plain call; a block may not change it."""
    if plan is not None:
        raise ValueError(
            "a KVCache with a policy does not combine with capture, ablate, knockout or patch "
            "on the same layer: decode without the block or without the policy. Received: a "
            f"block acting on layer {plan.layer} while the cache compresses"
        )


def _check_knockouts(plan: acting.Plan | None, cache: object) -> None:
    """A knockout names key positions of the input; a rolling cache's keys are its ring slots
    followed by the step's new tokens, so the knockout would hide other keys than it names."""
    if plan is not None and plan.knockouts and getattr(cache, "rolling", False):
        raise ValueError(
            "knockout names key positions of the input, but a rolling KVCache (window=) hands "
            "the attention its ring slots followed by the new tokens, so the named keys would "
            "not be the ones hidden: decode with a growing or fixed cache, or without the "
            f"knockout. Received: a knockout on layer {plan.layer} with a rolling cache"
        )


def _compressing(cache: object) -> bool:
    """Whether ``cache`` (a ``LayerCache``, or another object with its interface, such as the
    ONNX export's graph cache) compresses with a policy."""
    return bool(getattr(cache, "compressing", False))


def _scored(
    cache: LayerCache, q: Tensor, k: Tensor, v: Tensor, mask: Mask | Tensor | None, bias: Any
) -> Tensor:
    """The attention of a layer whose cache compresses: the statistic its policy ranks by
    comes from the same kernel pass and goes back to the cache."""
    request = cache.request()
    if request is None:
        out = attention(q, k, v, mask, bias=bias)
        cache.observe(None)
        return out
    name, window = request
    out, found = attention_stats(q, k, v, mask, stats=[name], window=window, bias=bias)
    cache.observe(found[name])
    return out


def _from_weights(cache: LayerCache, weights: Tensor) -> Tensor | None:
    """The statistic the cache's policy asks for, reduced from the weights (B, H, L, S)."""
    request = cache.request()
    if request is None:
        return None
    name, window = request
    b, h, length_q, length_k = weights.shape
    reducer = Reducer([name], window, (b, h, length_q, length_k), weights.dtype, weights.device)
    reducer.add(weights, 0)
    return reducer.result()[name]


def _layers(model: object, what: str) -> list[nn.Module] | None:
    """A model's ``MultiHeadAttention`` modules in order: the library's models hold one per
    layer, its self-attention (None: the model holds none). A loaded checkpoint that is not
    a module itself (``models.bert.Pretrained``) is read through its ``model``."""
    module = model if isinstance(model, nn.Module) else getattr(model, "model", None)
    if not isinstance(module, nn.Module):
        return None
    found: list[nn.Module] = [m for m in module.modules() if isinstance(m, MultiHeadAttention)]
    return found or None


def _num_heads(model: object) -> int | None:
    """H of the model's layers (None when they differ)."""
    counts = {cast("MultiHeadAttention", m).num_heads for m in _layers(model, "") or ()}
    return counts.pop() if len(counts) == 1 else None


READER = acting.register(acting.Reader("the library's own models", _layers, _num_heads))
