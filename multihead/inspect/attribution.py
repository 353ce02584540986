"""``attribute``: what a model's output depends on, one score per input token.

Targets: ``Representation(position)`` (an encoder's last hidden state of one token),
``NextToken(position, token=None)`` (a causal LM's logit for the token after ``position``,
its own prediction by default; with ``contrast``, the logit difference against another
token) and ``ClassLogit(index)`` (a classifier's score). Methods:

* ``attention``: the last layer's weights from the target's rows, mean over heads;
* ``rollout``: Abnar & Zuidema (2020), the head means composed over layers with the residual
  as 0.5 I (``multihead.inspect.rollout``'s formula, one layer at a time);
* ``norm``: Kobayashi et al. (2020), ``‖Σ_h α_hij W_o^h v_hj‖₂`` in the last layer; with
  ``residual=True`` the residual and the post-norm as well (Kobayashi et al. 2021);
* ``alti``: Ferrando et al. (2022), each layer's ALTI contributions composed over layers; for a
  next-token target its logit form (ALTI-Logit, Ferrando et al. 2023): every layer's attention
  update at the target position, ``Σ_h α_hfj W_o^h v_hj``, read through the final norm
  (its scale fixed) and the unembedding row of the token (minus the contrast's), then carried
  back to the input tokens by the ALTI contributions of the layers below;
* ``grad_input``: the gradient of the target times the token embedding, summed over the
  embedding (Shrikumar et al. 2016; Denil et al. 2014);
* ``integrated_gradients``: Sundararajan et al. (2017), from a zero embedding, ``steps``
  points of Gauss-Legendre quadrature (as Captum's default);
* ``occlusion``: the target's drop when the token is replaced by [MASK] (or the model's pad
  token) (Zeiler & Fergus 2014; Li et al. 2016).

The mixing methods (the first four) read each layer's attention call through
``multihead.acting`` while the model runs once, and reduce it before the next layer runs: the
memory they need above the model grows as L² (one layer's weights), never as L² x E.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .. import acting
from .contributions import (
    BLOCK_BYTES,
    LayerParts,
    alti_matrix,
    head_values,
    norm_rows,
    norm_scale,
)
from .subjects import CAUSAL, CLASSIFIER, ENCODER, Subject, open_subject

__all__ = [
    "METHODS",
    "Attribution",
    "ClassLogit",
    "NextToken",
    "Representation",
    "attribute",
    "estimate_bytes",
]

METHODS = (
    "attention",
    "rollout",
    "norm",
    "alti",
    "grad_input",
    "integrated_gradients",
    "occlusion",
)
MIXING = ("attention", "rollout", "norm", "alti")
# per kind of target, the most faithful in `multihead bench explain` (docs/performance.md,
# "Token attributions"): ALTI-Logit on the agreement prompts (a causal LM's next token), occlusion
# on the VADER texts (a classifier's score); an encoder's hidden state has no faithfulness test
# there and takes ALTI, which needs no target (3.8% on [CLS]/[SEP])
AUTO = {ENCODER: "alti", CAUSAL: "alti", CLASSIFIER: "occlusion"}
AUTO_UNREAD = "occlusion"  # where a model's layers are not read: reads no layer


@dataclass(frozen=True)
class Representation:
    """An encoder's last-layer hidden state of the token at ``position``; a scalar for the
    gradient methods and occlusion: its projection on its own direction, ``h · ĥ``."""

    position: int


@dataclass(frozen=True)
class NextToken:
    """A causal LM's logit at ``position`` (the prediction of the token after it) for
    ``token`` (an id or a one-token string; default the model's own prediction)."""

    position: int
    token: int | str | None = None


@dataclass(frozen=True)
class ClassLogit:
    """A classifier's output ``index`` (a sentiment model's score: index 0)."""

    index: int = 0


Target = Representation | NextToken | ClassLogit


@dataclass(frozen=True)
class Attribution:
    """The answer of ``attribute``.

    Attributes:
        method: the method that ran ("alti", ... ; never "auto").
        target: the target in words ("next token ' are' after position 7, against ' is'").
        ids: the input's token ids, in order.
        tokens: the tokens as the tokenizer spells them (None without a tokenizer).
        scores: (L,) one score per input token, in input order. The mixing methods give
            shares that sum to 1 (ALTI's logit form: logit units); the gradient methods and
            occlusion signed values in the target's units. A causal LM's tokens after the
            target position score 0.
        sink_share: the share of the absolute scores on the sinks: the first token and the
            special tokens ([CLS], [SEP]).
        layers: (layers, L) the same per layer where the method has them (attention, norm:
            each layer's own; rollout, alti: composed up to that layer; ALTI-Logit: each
            layer's update), else None.
        prediction: a next-token target's token id.
        contrast: the contrast's token id, or None.
        position: the target position (None for a class score).
    """

    method: str
    target: str
    ids: list[int]
    tokens: list[str] | None
    scores: Tensor
    sink_share: float
    layers: Tensor | None = None
    prediction: int | None = None
    contrast: int | None = None
    position: int | None = None
    sinks: tuple[int, ...] = field(default=())

    def top(self, k: int = 5, *, skip_sinks: bool = False) -> list[tuple[int, float]]:
        """The ``k`` highest-scoring positions as (position, share of the absolute total),
        highest first (``skip_sinks``: leaving the sinks out of the ranking only)."""
        total = float(self.scores.abs().sum()) or 1.0
        order = self.scores.argsort(descending=True).tolist()
        if skip_sinks:
            order = [i for i in order if i not in self.sinks]
        return [(i, float(self.scores[i]) / total) for i in order[:k]]

    def as_dict(self) -> dict[str, Any]:
        """``{"method", "target", "contrast", "tokens", "scores", "sink_share"}`` and the ids,
        for JSON (``multihead explain`` writes it as attribution.json)."""
        return {
            "method": self.method,
            "target": self.target,
            "contrast": self.contrast,
            "tokens": self.tokens,
            "ids": self.ids,
            "scores": [float(s) for s in self.scores],
            "sink_share": self.sink_share,
            "prediction": self.prediction,
            "position": self.position,
        }


def _check_ids(inputs: Any, subject: Subject) -> list[int]:
    if isinstance(inputs, str):
        if subject.tokenizer is None:
            raise ValueError(
                "a text needs the model's tokenizer, which this model has none of; pass token "
                "ids. Received: a text"
            )
        return list(subject.tokenizer.encode(inputs).ids)
    if isinstance(inputs, Tensor):
        if inputs.dim() == 2 and inputs.shape[0] == 1:
            inputs = inputs[0]
        if inputs.dim() != 1 or inputs.is_floating_point():
            raise ValueError(
                "inputs must be one sequence of token ids, (L,) or (1, L) integers, or a "
                f"text. Received: a tensor of shape {tuple(inputs.shape)}, {inputs.dtype}"
            )
        return [int(i) for i in inputs.tolist()]
    if isinstance(inputs, Sequence) and all(
        isinstance(i, int) and not isinstance(i, bool) for i in inputs
    ):
        return list(inputs)
    raise ValueError(
        "inputs must be a text, a list of token ids or an integer tensor. Received: "
        f"{type(inputs).__name__}"
    )


def _token_id(subject: Subject, token: int | str, name: str) -> int:
    vocab = None if subject.unembedding is None else subject.unembedding.shape[0]
    if isinstance(token, str):
        if subject.tokenizer is None:
            raise ValueError(f"{name} as a string needs the model's tokenizer. Received: {token!r}")
        ids = subject.tokenizer.encode(token, add_special_tokens=False).ids
        if len(ids) != 1:
            pieces = subject.tokenizer.encode(token, add_special_tokens=False).tokens
            raise ValueError(
                f"{name} must be one token of the model's vocabulary; {token!r} is "
                f"{len(ids)} tokens {pieces}. Received: {name} {token!r}"
            )
        return int(ids[0])
    if (
        isinstance(token, bool)
        or not isinstance(token, int)
        or token < 0
        or (vocab is not None and token >= vocab)
    ):
        raise ValueError(f"{name} must be a token id in [0, {vocab}). Received: {token!r}")
    return token


@dataclass(frozen=True)
class _Goal:
    """The target resolved against one input: what each method reads."""

    kind: str
    position: int | None  # Representation / NextToken
    index: int | None  # ClassLogit
    token: int | None  # NextToken: the explained token
    contrast: int | None
    length: int  # the tokens the model runs (a causal target: up to its position)
    rows: Tensor  # the readout rows' weights (length,): one-hot, or uniform (mean pooling)
    direction: Tensor | None  # Representation: the hidden state's unit direction


def _resolve(subject: Subject, ids: list[int], target: Any, contrast: Any) -> Target:
    if isinstance(target, bool):
        raise ValueError(f"target must be a position or a target. Received: {target!r}")
    if isinstance(target, int):
        if subject.kind == CLASSIFIER:
            raise ValueError(
                "a classifier's target is ClassLogit(index), not a position. "
                f"Received: target={target}"
            )
        target = Representation(target) if subject.kind == ENCODER else NextToken(target)
    if not isinstance(target, (Representation, NextToken, ClassLogit)):
        raise ValueError(
            "target must be a position, Representation(position), NextToken(position, "
            f"token=None) or ClassLogit(index). Received: {target!r}"
        )
    wants = {Representation: ENCODER, NextToken: CAUSAL, ClassLogit: CLASSIFIER}[type(target)]
    if wants != subject.kind:
        raise ValueError(
            f"{type(target).__name__} is the target of a {wants}; this model is "
            f"{'an' if subject.kind == ENCODER else 'a'} {subject.kind}. Received: "
            f"target={target!r}"
        )
    if not isinstance(target, ClassLogit):
        position = target.position
        if (
            isinstance(position, bool)
            or not isinstance(position, int)
            or not (-len(ids) <= position < len(ids))
        ):
            raise ValueError(
                f"the target position must be in [0, {len(ids)}): the input has {len(ids)} "
                f"tokens. Received: position {position!r}"
            )
    if contrast is not None and not isinstance(target, NextToken):
        raise ValueError(
            "contrast applies to a next-token target (a causal LM's logit difference). "
            f"Received: contrast={contrast!r} with {target!r}"
        )
    return target


def _method(subject: Subject, model: Any, method: str, steps: int, residual: bool) -> str:
    """The method that runs ("auto" resolved), its options checked."""
    name = method
    if method == "auto":  # where a model's layers are not read, the most faithful of the rest
        name = AUTO[subject.kind] if subject.layers is not None else AUTO_UNREAD
    if name not in METHODS:
        raise ValueError(
            f"unknown method {method!r}; the methods are auto, {', '.join(METHODS)}. "
            f"Received: method={method!r}"
        )
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1. Received: steps={steps!r}")
    if residual and name != "norm":
        raise ValueError(f"residual applies to the norm method. Received: method={name!r}")
    if name in ("norm", "alti") and subject.layers is None:
        raise ValueError(
            f"{name} reads each layer's attention, residual and norms, which "
            f"{subject.name or type(model).__name__} does not expose ({subject.why}); the "
            "methods for any model are grad_input, integrated_gradients and occlusion. "
            f"Received: method={name!r}"
        )
    return name


def attribute(
    model: Any,
    inputs: Any,
    *,
    target: Any,
    method: str = "auto",
    contrast: int | str | None = None,
    steps: int = 50,
    residual: bool = False,
    memory: int | None = None,
    tokenizer: Any = None,
) -> Attribution:
    """Score every input token by how much ``target`` depends on it.

    ::

        from multihead import inspect, models

        bert = models.bert.load()
        ids = bert.tokenizer.encode("The animal didn't cross the street").ids
        found = inspect.attribute(bert, ids, target=inspect.Representation(2))
        found.method, found.top(3), found.sink_share

    Args:
        model: one of the library's own models (``models.bert.load()``, a ``multihead.load``
            folder of an encoder, a sentiment model or a causal LM) or a transformers model
            (``import multihead.hf`` first; ``norm`` and ``alti`` read the layers of
            Llama-style decoders: Llama, SmolLM2, Qwen2, Mistral).
        inputs: a text (the model's tokenizer splits it, special tokens included), a list of
            token ids or an (L,) / (1, L) integer tensor: one sequence.
        target: a position (an encoder's token, a causal LM's next-token prediction there),
            ``Representation``, ``NextToken``, or ``ClassLogit`` for a classifier.
        method: one of ``METHODS`` or "auto" (``AUTO``: per kind of target the most faithful
            in ``multihead bench explain``: alti for a causal LM's next token and an encoder's
            hidden state, occlusion for a classifier's score; occlusion for a model whose
            layers ``alti`` does not read).
        contrast: a causal LM's other token (an id or a one-token string): the target is
            then the logit difference.
        steps: integrated gradients' quadrature points.
        residual: ``norm`` with the residual and the norm after it (Kobayashi et al. 2021).
        memory: the bytes the run may take above the model (default: half of what the
            machine has available); a longer input is refused before anything runs.
        tokenizer: the model's tokenizer where the model holds none (a transformers model:
            its ``AutoTokenizer`` or a ``tokenizers.Tokenizer``), for a text input, string
            tokens and the tokens of the answer.

    Returns:
        An ``Attribution``.

    Raises:
        ValueError: an unknown method, a target the model cannot have, a contrast that is not
            one token, an input longer than the model's positions or than ``memory`` allows
            (one line naming the limit).
        TypeError: a model of no kind ``attribute`` reads.
    """
    subject = open_subject(model, tokenizer)
    name = _method(subject, model, method, steps, residual)
    ids = _check_ids(inputs, subject)
    if not ids:
        raise ValueError("inputs hold no token. Received: an empty sequence")
    if subject.max_positions is not None and len(ids) > subject.max_positions:
        raise ValueError(
            f"the input is {len(ids)} tokens and the model has {subject.max_positions} "
            f"positions; shorten it. Received: {len(ids)} tokens"
        )
    resolved = _resolve(subject, ids, target, contrast)
    _check_memory(subject, name, len(ids), memory, steps)
    goal = _goal(subject, ids, resolved, contrast)
    with torch.no_grad():
        if name in MIXING:
            scores, layers = _mixing(subject, ids, goal, name, residual)
        else:
            scores, layers = _perturbing(subject, ids, goal, name, steps), None
    return _answer(subject, ids, goal, name, scores, layers)


def _answer(subject: Subject, ids: list[int], goal: _Goal, name: str, scores: Tensor,
            layers: Tensor | None) -> Attribution:  # fmt: skip
    full = torch.zeros(len(ids), dtype=torch.float32)
    full[: goal.length] = scores.float()
    if layers is not None:
        padded = torch.zeros(layers.shape[0], len(ids), dtype=torch.float32)
        padded[:, : goal.length] = layers.float()
        layers = padded
    sinks = tuple(sorted({0} | {i for i, t in enumerate(ids) if t in subject.special_ids}))
    total = float(full.abs().sum())
    share = float(full[list(sinks)].abs().sum()) / total if total > 0 else 0.0
    tokens = None
    if subject.tokenizer is not None:
        tokens = [subject.tokenizer.id_to_token(i) for i in ids]
    return Attribution(name, _describe(subject, goal), ids, tokens, full, share, layers,
                       goal.token, goal.contrast, goal.position, sinks)  # fmt: skip


def _describe(subject: Subject, goal: _Goal) -> str:
    def spell(token: int) -> str:
        if subject.tokenizer is None:
            return f"token {token}"
        return repr(subject.tokenizer.decode([token]))

    if goal.kind == ENCODER:
        return f"the last hidden state at position {goal.position}"
    if goal.kind == CLASSIFIER:
        return f"class score {goal.index}"
    assert goal.token is not None
    against = "" if goal.contrast is None else f", against {spell(goal.contrast)}"
    return f"next token {spell(goal.token)} after position {goal.position}{against}"


def estimate_bytes(subject: Subject, method: str, length: int, steps: int = 50) -> int:
    """The memory ``attribute`` needs above the model for an input of ``length`` tokens (an
    upper estimate: float32 throughout)."""
    attn = subject.layers[0].attention if subject.layers else None
    heads = getattr(attn, "num_heads", None) or _config(subject, "num_attention_heads", 16)
    embedding: Any = subject.embedding
    width = int(embedding.weight.shape[1])
    depth = len(subject.layers) if subject.layers else _config(subject, "num_hidden_layers", 32)
    square = 4 * length * length
    if method in MIXING:
        # one layer's weights (the kernel's and a float copy), the composed rows R and one
        # layer's C, the values through W_o, ALTI's block of differences
        return 3 * heads * square + 3 * square + 8 * heads * length * width + 2 * BLOCK_BYTES
    batch = 1 if method == "grad_input" else (8 if method == "integrated_gradients" else 16)
    # a forward and its backward: the layers' activations and one layer's weights at a time
    per_row = depth * (24 * 4 * length * width) + 2 * heads * square
    return batch * per_row


def _config(subject: Subject, name: str, default: int) -> int:
    config: Any = getattr(subject.model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    value = getattr(text, name, None)
    return value if isinstance(value, int) else default


def _check_memory(subject: Subject, method: str, length: int, memory: int | None,
                  steps: int) -> None:  # fmt: skip
    if memory is None:
        from .._machine import available_memory

        free = available_memory()
        if free is None:
            return
        memory = free // 2
    elif isinstance(memory, bool) or not isinstance(memory, int) or memory <= 0:
        raise ValueError(f"memory must be a number of bytes > 0. Received: memory={memory!r}")
    need = estimate_bytes(subject, method, length, steps)
    if need > memory:
        raise ValueError(
            f"{method} on {length} tokens needs about {need / 2**30:.1f} GiB above the model "
            f"and {memory / 2**30:.1f} GiB may be used (half of the memory available); "
            "shorten the input or pick a method that needs less. Received: "
            f"{length} tokens"
        )


def _goal(subject: Subject, ids: list[int], target: Target, contrast: Any) -> _Goal:
    length = len(ids)
    if isinstance(target, ClassLogit):
        rows = torch.zeros(length)
        if subject.pooling == "mean":
            rows[:] = 1.0 / length
        else:
            rows[0 if subject.pooling == "first" else -1] = 1.0
        out = _run(subject, ids)
        count = out.reshape(-1).shape[0]
        if (
            isinstance(target.index, bool)
            or not isinstance(target.index, int)
            or not (0 <= target.index < count)
        ):
            raise ValueError(
                f"the classifier has {count} outputs: the class index must be in [0, "
                f"{count}). Received: ClassLogit({target.index!r})"
            )
        return _Goal(CLASSIFIER, None, target.index, None, None, length, rows, None)
    position = target.position % length
    if isinstance(target, Representation):
        rows = torch.zeros(length)
        rows[position] = 1.0
        hidden = _run(subject, ids)[0, position].float()
        direction = hidden / hidden.norm().clamp_min(torch.finfo(hidden.dtype).tiny)
        return _Goal(ENCODER, position, None, None, None, length, rows, direction)
    length = position + 1  # a causal LM: later tokens do not reach the position
    rows = torch.zeros(length)
    rows[position] = 1.0
    if target.token is None:
        token = int(_run(subject, ids[:length])[0, position].argmax())
    else:
        token = _token_id(subject, target.token, "the target token")
    other = None if contrast is None else _token_id(subject, contrast, "contrast")
    if other is not None and other == token:
        raise ValueError(
            f"contrast is the explained token itself (id {token}); give another token. "
            f"Received: contrast={contrast!r}"
        )
    return _Goal(CAUSAL, position, None, token, other, length, rows, None)


def _run(subject: Subject, ids: list[int]) -> Tensor:
    with torch.no_grad():
        return subject.run(torch.tensor([ids]))


def _value(subject: Subject, goal: _Goal, out: Tensor) -> Tensor:
    """The target's scalar for every row of a batch of outputs: (n,)."""
    if goal.kind == CLASSIFIER:
        return out.reshape(out.shape[0], -1)[:, goal.index].float()
    if goal.kind == ENCODER:
        assert goal.direction is not None
        return out[:, goal.position].float() @ goal.direction
    logits = out[:, goal.position].float()
    value = logits[:, goal.token]
    return value if goal.contrast is None else value - logits[:, goal.contrast]


# -- the mixing methods: one run, each layer reduced as it ends --------------------------------


@dataclass
class _Flow:
    """What the mixing methods carry from layer to layer."""

    method: str
    rows: Tensor  # (L,) the readout rows' weights
    residual: bool
    logit: Tensor | None  # ALTI-Logit: the direction in the final norm's input, before 1/σ
    causal: bool = False  # lower-triangular mixing matrices
    composed: Tensor | None = None  # (L, L) rollout's or ALTI's composition so far
    per_layer: list[Tensor] = field(default_factory=list)


def _mixing(subject: Subject, ids: list[int], goal: _Goal, method: str,
            residual: bool) -> tuple[Tensor, Tensor]:  # fmt: skip
    length = goal.length
    logit = None
    handles: list[Any] = []
    final: dict[str, Tensor] = {}  # the final norm's input of this run: its scale, σ_f
    if method == "alti" and goal.kind == CAUSAL:
        logit = _logit_direction(subject, goal)
        assert subject.final_norm is not None

        def grab(module: Any, args: tuple) -> None:
            final["x"] = args[0][0, goal.position].detach()

        handles.append(subject.final_norm.register_forward_pre_hook(grab))
    flow = _Flow(method, goal.rows.double(), residual, logit, subject.causal)
    if method in ("rollout", "alti"):
        flow.composed = torch.eye(length, dtype=torch.float64)
    reader, found = acting.find(subject.model, "attribute")
    layers = subject.layers
    if layers is None:  # attention and rollout need the weights alone: any layer list
        layers = []
    index = {id(m): i for i, m in enumerate(found)}
    cap = acting.Capture(None, len(found))
    cap.keep_values = True
    streams: dict[int, Tensor] = {}
    outputs: dict[int, Tensor] = {}

    def reduce(layer: int, parts_of: Any) -> None:
        weights = cap.weights.pop(layer)[0]
        values = cap.values.pop(layer)[0].to(weights.dtype)
        _step(flow, weights, values, parts_of)

    if layers:
        for layer in layers:
            at = index.get(id(layer.attention))
            if at is None:
                raise ValueError(
                    f"the attention of a {type(layer.block).__name__} is not among the layers "
                    "multihead.acting finds in this model. Received: an unread layer"
                )

            def before(module: Any, args: tuple, kwargs: dict, layer: Any = layer,
                       at: int = at) -> None:  # fmt: skip
                streams[at] = layer.stream(args, kwargs)[0].detach()

            def after(module: Any, args: tuple, kwargs: dict, out: Any, layer: Any = layer,
                      at: int = at) -> None:  # fmt: skip
                def parts(weights: Tensor, values: Tensor) -> LayerParts:
                    bias, dtype = layer.out_proj.bias, weights.dtype  # the model's own
                    return LayerParts(weights, values, layer.out_proj.weight.to(dtype),
                                      None if bias is None else bias.to(dtype),
                                      streams.pop(at).to(dtype), layer.post_norm,
                                      subject.causal, outputs.pop(at).to(dtype))  # fmt: skip

                reduce(at, parts)

            def projected(module: Any, args: tuple, out: Tensor, at: int = at) -> None:
                outputs[at] = out[0].detach()  # the block's output before the residual

            handles.append(layer.out_proj.register_forward_hook(projected))
            handles.append(layer.block.register_forward_pre_hook(before, with_kwargs=True))
            handles.append(layer.block.register_forward_hook(after, with_kwargs=True))
    else:
        cap.keep_values = False
    try:
        with acting.open_block(subject.model, cap, reader, found):
            subject.run(torch.tensor([ids[:length]]))
        if not layers:  # weights alone, reduced after the run (attention, rollout)
            for at in range(len(found)):
                _step(flow, cap.weights.pop(at)[0], None, None)
    finally:
        for handle in handles:
            handle.remove()
    stacked = torch.stack(flow.per_layer)
    if method == "alti" and logit is not None:
        stacked = stacked * _inverse_scale(subject, final["x"])
        return stacked.sum(0), stacked
    return stacked[-1], stacked


def _logit_direction(subject: Subject, goal: _Goal) -> Tensor:
    """w': a logit update p at the target position moves the target by ``w' · p / σ_f`` with
    the final norm's scale σ_f fixed at the final hidden state's (ALTI-Logit; σ_f is read
    from the same run, ``_inverse_scale``)."""
    if subject.unembedding is None or subject.final_norm is None:
        raise ValueError(
            "alti on a next-token target reads the final norm and the output layer, which "
            "this model does not expose. Received: a causal LM without them"
        )
    gamma, _, _, centred = norm_scale(subject.final_norm)
    u = subject.unembedding
    direction = u[goal.token].double()
    if goal.contrast is not None:
        direction = direction - u[goal.contrast].double()
    w = gamma.double() * direction
    return w - w.mean() if centred else w  # g · (γ ⊙ P p) = (P (γ ⊙ g)) · p


def _inverse_scale(subject: Subject, final: Tensor) -> float:
    """1/σ_f of the final norm at its input ``final`` (E,) of the target position."""
    assert subject.final_norm is not None
    _, _, eps, centred = norm_scale(subject.final_norm)
    final = final.double()
    spread = final.var(unbiased=False) if centred else final.pow(2).mean()
    return float((spread + eps).rsqrt())


def composed(later: Tensor, earlier: Tensor, *, lower: bool = False, tiles: int = 4) -> Tensor:
    """``later @ earlier``; with ``lower`` (both lower triangular: a causal model's mixing
    matrices) only the products of tiles at or below the diagonal are formed, about a third
    of the work at four tiles a side."""
    n = later.shape[0]
    if not lower or n < 2 * tiles * 64:
        return later @ earlier
    edges = [round(i * n / tiles) for i in range(tiles + 1)]
    out = torch.zeros_like(earlier)
    for i in range(tiles):
        rows = slice(edges[i], edges[i + 1])
        for j in range(i + 1):
            cols = slice(edges[j], edges[j + 1])
            inner = slice(edges[j], edges[i + 1])  # tiles k with j <= k <= i
            out[rows, cols] = later[rows, inner] @ earlier[inner, cols]
    return out


def _normalized(rows: Tensor) -> Tensor:
    total = rows.sum(-1, keepdim=True)
    return rows / total.clamp_min(torch.finfo(rows.dtype).tiny)


def _step(flow: _Flow, weights: Tensor, values: Tensor | None, parts_of: Any) -> None:
    """One layer into the flow: weights (H, L, L) as the kernel gave them, reduced in their
    dtype (the model's: float32 for a real model, float64 in the tests)."""
    if flow.rows.dtype != weights.dtype:
        flow.rows = flow.rows.to(weights.dtype)
        if flow.composed is not None:
            flow.composed = flow.composed.to(weights.dtype)
        if flow.logit is not None:
            flow.logit = flow.logit.to(weights.dtype)
    rows = flow.rows
    picked = rows.nonzero().flatten()
    method = flow.method
    if method == "attention":
        mean = weights.mean(0)
        flow.per_layer.append(rows[picked] @ _normalized(mean[picked]))
        return
    if method == "rollout":
        assert flow.composed is not None
        n = weights.shape[-1]
        eye = torch.eye(n, dtype=weights.dtype)
        a = _normalized(0.5 * eye + 0.5 * weights.mean(0))
        flow.composed = composed(a, flow.composed, lower=flow.causal)
        flow.per_layer.append(rows @ flow.composed)
        return
    assert values is not None
    parts = parts_of(weights, values)
    if method == "norm":
        found = norm_rows(parts, picked, residual=flow.residual)
        flow.per_layer.append(rows[picked] @ _normalized(found))
        return
    assert flow.composed is not None
    if flow.logit is not None:  # ALTI-Logit: this layer's update at the target position
        u = head_values(parts)  # (H, L, E)
        f = int(picked[0])
        update = (weights[:, f, :, None] * u).sum(0) @ flow.logit  # (L,)
        flow.per_layer.append(update @ flow.composed)
    contributions = alti_matrix(parts)
    flow.composed = composed(contributions, flow.composed, lower=flow.causal)
    if flow.logit is None:
        flow.per_layer.append(rows @ flow.composed)


# -- the gradient methods and occlusion -----------------------------------------------------


def _embedded(subject: Subject, ids: Tensor, embeds: Tensor) -> Tensor:
    """The model's output with the token embedding's output replaced by ``embeds``."""

    def swap(module: Any, args: tuple, out: Tensor) -> Tensor:
        return embeds.to(out.dtype)

    handle = subject.embedding.register_forward_hook(swap)
    try:
        return subject.run(ids)
    finally:
        handle.remove()


def _gradients(subject: Subject, goal: _Goal, ids: Tensor, points: Tensor) -> Tensor:
    """d target / d embeddings at each of ``points`` (n, L, E), in batches."""
    grads = []
    for start in range(0, points.shape[0], 8):
        chunk = points[start : start + 8].detach().requires_grad_(True)
        with torch.enable_grad():
            out = _embedded(subject, ids.expand(chunk.shape[0], -1), chunk)
            (grad,) = torch.autograd.grad(_value(subject, goal, out).sum(), chunk)
        grads.append(grad.detach())
    return torch.cat(grads)


def gauss_legendre(steps: int) -> tuple[Tensor, Tensor]:
    """(points in (0, 1), weights summing to 1) of ``steps``-point Gauss-Legendre quadrature,
    as Captum's "gausslegendre" method places them."""
    x, w = np.polynomial.legendre.leggauss(steps)
    return torch.tensor(0.5 * (x + 1)), torch.tensor(0.5 * w)


def _perturbing(subject: Subject, ids: list[int], goal: _Goal, method: str, steps: int) -> Tensor:
    run_ids = torch.tensor([ids[: goal.length]])
    if method == "occlusion":
        return _occlusion(subject, goal, ids[: goal.length])
    with torch.no_grad():
        embeds = subject.embedding(run_ids).float()
    if method == "grad_input":
        grad = _gradients(subject, goal, run_ids, embeds)
        return (grad[0] * embeds[0]).sum(-1)
    alphas, weights = gauss_legendre(steps)
    points = alphas.float()[:, None, None] * embeds[0][None]  # from the zero embedding
    grads = _gradients(subject, goal, run_ids, points)
    mean = (grads * weights.float()[:, None, None]).sum(0)
    return (embeds[0] * mean).sum(-1)


def _occlusion(subject: Subject, goal: _Goal, ids: list[int]) -> Tensor:
    base = torch.tensor([ids])
    with torch.no_grad():
        whole = _value(subject, goal, subject.run(base))
        drops = []
        for start in range(0, len(ids), 16):
            stop = min(len(ids), start + 16)
            batch = base.repeat(stop - start, 1)
            batch[torch.arange(stop - start), torch.arange(start, stop)] = subject.baseline_id
            drops.append(whole - _value(subject, goal, subject.run(batch)))
    return torch.cat(drops)
