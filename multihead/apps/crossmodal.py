"""``multihead train crossmodal``: yes/no questions about real handwritten digits (scikit-learn's
bundled 8 x 8 ``load_digits``), answered by question tokens that cross-attend to image patches.

Each image becomes 16 patches of 2 x 2 pixels. Questions are generated from the label ("is it
even ?", "is it greater than 5 ?", "is it a 3 ?", ...), half of the "is it a N ?" questions
naming the true digit, so the answers are balanced and depend on the image. The query (question
tokens, width ``text_dim``) and the key/value (patches, width ``image_dim``) have different
widths: ``MultiHeadAttention(text_dim, H, kdim=image_dim, vdim=image_dim)``. Baselines trained
the same way: a question-only and an image-only model. Images are split, not questions, so no
test image was seen in training.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from .. import masks
from ..io import register, save
from ..modules import (
    AttentionOutput,
    LearnedPositionalEncoding,
    MultiHeadAttention,
    TransformerEncoderLayer,
)
from .common import Options, figure, finish, need, save_figure, seed_everything, training_curve
from .loop import Dist, FitResult, autocast, fit

__all__ = [
    "SUMMARY",
    "VOCAB",
    "CrossModalQA",
    "ImageOnly",
    "QuestionOnly",
    "Questions",
    "make_questions",
    "patches",
    "run",
    "throughput",
    "tokenize",
]

SUMMARY = "yes/no questions about digits, answered by cross-attention to image patches"

VOCAB = ["<pad>", "is", "it", "a", "even", "odd", "greater", "less", "than", "?"] + [
    str(d) for d in range(10)
]
_INDEX = {w: i for i, w in enumerate(VOCAB)}
KINDS = ("even", "odd", "greater", "less", "is_digit")
PATCH = 2  # patch side in pixels: an 8 x 8 image gives 16 patches of 4 values
MAX_QUESTION = 6


def patches(images: np.ndarray) -> Tensor:
    """(N, 8, 8) images with values 0..16 -> (N, 16, 4) patches scaled to [0, 1], row-major."""
    x = torch.as_tensor(images, dtype=torch.float32) / 16.0
    n, side = x.shape[0], x.shape[1] // PATCH
    x = x.reshape(n, side, PATCH, side, PATCH).permute(0, 1, 3, 2, 4)
    return x.reshape(n, side * side, PATCH * PATCH)


@dataclass
class Questions:
    """Generated questions: for each, the image it is about, its words, kind and answer."""

    image: np.ndarray  # (Q,) image index
    words: list[list[str]]
    kind: list[str]
    answer: np.ndarray  # (Q,) 1 = yes


def make_questions(labels: np.ndarray, per_image: int, seed: int) -> Questions:
    """``per_image`` questions about each image, drawn with a seeded generator."""
    rng = np.random.default_rng(seed)
    image, words, kind, answer = [], [], [], []
    for i, label in enumerate(labels):
        for _ in range(per_image):
            k = KINDS[rng.integers(len(KINDS))]
            if k in ("even", "odd"):
                w, yes = ["is", "it", k, "?"], (label % 2 == 0) == (k == "even")
            elif k == "greater":
                n = int(rng.integers(0, 9))
                w, yes = ["is", "it", "greater", "than", str(n), "?"], label > n
            elif k == "less":
                n = int(rng.integers(1, 10))
                w, yes = ["is", "it", "less", "than", str(n), "?"], label < n
            else:  # half the time the true digit, so yes and no are equally likely
                n = int(label) if rng.random() < 0.5 else int(rng.choice(
                    [d for d in range(10) if d != label]))  # fmt: skip
                w, yes = ["is", "it", "a", str(n), "?"], label == n
            image.append(i)
            words.append(w)
            kind.append(k)
            answer.append(int(yes))
    return Questions(np.array(image), words, kind, np.array(answer))


def tokenize(words: list[list[str]]) -> tuple[Tensor, Tensor]:
    """Questions -> token ids (Q, MAX_QUESTION) padded with 0, and lengths (Q,)."""
    ids = torch.zeros(len(words), MAX_QUESTION, dtype=torch.long)
    for i, w in enumerate(words):
        ids[i, : len(w)] = torch.tensor([_INDEX[t] for t in w])
    return ids, torch.tensor([len(w) for w in words])


def _pool(x: Tensor, lengths: Tensor) -> Tensor:
    keep = (torch.arange(x.shape[1], device=x.device)[None] < lengths[:, None]).to(x.dtype)
    return (x * keep[..., None]).sum(1) / keep.sum(1, keepdim=True).clamp_min(1)


@register
class CrossModalQA(nn.Module):
    """Question tokens self-attend, then cross-attend to image patches; pooled to one logit.

    Args:
        text_dim: E of the question tokens (query width).
        image_dim: width of the patch vectors (key/value width), different from text_dim.
        num_heads: H for every attention.
        num_patches: patches per image.
        patch_dim: values per patch.
        vocab_size: question vocabulary.
    """

    def __init__(
        self,
        *,
        text_dim: int = 32,
        image_dim: int = 48,
        num_heads: int = 4,
        num_patches: int = 16,
        patch_dim: int = PATCH * PATCH,
        vocab_size: int = len(VOCAB),
    ) -> None:
        super().__init__()
        self.words = nn.Embedding(vocab_size, text_dim, padding_idx=0)
        self.word_position = LearnedPositionalEncoding(MAX_QUESTION, text_dim)
        self.question = TransformerEncoderLayer(text_dim, num_heads, 2 * text_dim, norm_first=True)
        self.patch = nn.Linear(patch_dim, image_dim)
        self.patch_position = LearnedPositionalEncoding(num_patches, image_dim)
        self.image = TransformerEncoderLayer(image_dim, num_heads, 2 * image_dim, norm_first=True)
        self.cross = MultiHeadAttention(text_dim, num_heads, kdim=image_dim, vdim=image_dim)
        self.norm = nn.LayerNorm(text_dim)
        self.out = nn.Linear(text_dim, 1)

    def forward(self, ids: Tensor, lengths: Tensor, image: Tensor) -> Tensor:
        """ids (B, L) and lengths (B,) of the questions, image patches (B, S, patch_dim).

        Returns logits (B,) (yes > 0); ``run`` also returns the cross-attention weights.
        """
        q, v = self._encode(ids, lengths, image)
        return self._answer(q, self.cross(q, v, v), lengths)

    def run(self, ids: Tensor, lengths: Tensor, image: Tensor) -> AttentionOutput:
        """``forward`` with the cross-attention weights: ``AttentionOutput(logits (B,),
        weights (B, H, L, S))``, how much each question token looks at each patch."""
        q, v = self._encode(ids, lengths, image)
        attended, weights = self.cross.run(q, v, v)
        return AttentionOutput(self._answer(q, attended, lengths), weights)

    def _encode(self, ids: Tensor, lengths: Tensor, image: Tensor) -> tuple[Tensor, Tensor]:
        q = self.question(self.word_position(self.words(ids)), mask=masks.lengths(lengths))
        return q, self.image(self.patch_position(self.patch(image)))

    def _answer(self, q: Tensor, attended: Tensor, lengths: Tensor) -> Tensor:
        h = self.norm(q + attended)
        return self.out(_pool(h, lengths))[:, 0]


@register
class QuestionOnly(nn.Module):
    """Baseline that never sees the image: question tokens, self-attention, pooling, logit."""

    def __init__(self, *, text_dim: int = 32, num_heads: int = 4, vocab_size: int = len(VOCAB)):
        super().__init__()
        self.words = nn.Embedding(vocab_size, text_dim, padding_idx=0)
        self.word_position = LearnedPositionalEncoding(MAX_QUESTION, text_dim)
        self.question = TransformerEncoderLayer(text_dim, num_heads, 2 * text_dim, norm_first=True)
        self.out = nn.Linear(text_dim, 1)

    def forward(self, ids: Tensor, lengths: Tensor, image: Tensor) -> Tensor:
        q = self.question(self.word_position(self.words(ids)), mask=masks.lengths(lengths))
        return self.out(_pool(q, lengths))[:, 0]


@register
class ImageOnly(nn.Module):
    """Baseline that never sees the question: patches, self-attention, pooling, logit."""

    def __init__(self, *, image_dim: int = 48, num_heads: int = 4, num_patches: int = 16,
                 patch_dim: int = PATCH * PATCH) -> None:  # fmt: skip
        super().__init__()
        self.patch = nn.Linear(patch_dim, image_dim)
        self.patch_position = LearnedPositionalEncoding(num_patches, image_dim)
        self.image = TransformerEncoderLayer(image_dim, num_heads, 2 * image_dim, norm_first=True)
        self.out = nn.Linear(image_dim, 1)

    def forward(self, ids: Tensor, lengths: Tensor, image: Tensor) -> Tensor:
        return self.out(self.image(self.patch_position(self.patch(image))).mean(1))[:, 0]


@torch.inference_mode()
def predict(model: nn.Module, ids: Tensor, lengths: Tensor, image: Tensor,
            precision: str = "fp32") -> np.ndarray:  # fmt: skip
    """Yes-probabilities for questions (ids, lengths) about patch tensors ``image``."""
    model.eval()
    device = next(model.parameters()).device
    out = []
    for rows in torch.arange(len(ids)).split(512):
        with autocast(precision, device):
            logits = model(ids[rows].to(device), lengths[rows].to(device), image[rows].to(device))
        out.append(torch.sigmoid(logits.float()).cpu())
    return torch.cat(out).numpy()


def _accuracy(prob: np.ndarray, answer: np.ndarray, kinds: list[str]) -> dict[str, Any]:
    right = (prob > 0.5) == (answer == 1)
    kinds_arr = np.array(kinds)
    return {
        "accuracy": float(right.mean()),
        "by_kind": {
            k: float(right[kinds_arr == k].mean()) for k in KINDS if (kinds_arr == k).any()
        },
    }


def run(options: Options, info: Dist, out: Path | None) -> dict[str, Any]:
    """Train the cross-attention model and both baselines; write DIR (see module docstring)."""
    started = time.perf_counter()
    if options.data is not None:
        raise ValueError(
            "crossmodal reads scikit-learn's bundled digits; --data is for the sentiment task. "
            f"Received: --data {options.data}"
        )
    seed_everything(options.seed)
    digits = need("sklearn.datasets", "multihead train crossmodal").load_digits()
    order = np.random.default_rng(options.seed).permutation(len(digits.target))
    if options.quick:
        order = order[:300]
    cut = int(0.7 * len(order))
    train_images, test_images = np.sort(order[:cut]), np.sort(order[cut:])
    per_image = 2 if options.quick else 8
    all_patches = patches(digits.images)
    sets = {}
    for name, images, seed in (("train", train_images, 1), ("test", test_images, 2)):
        qs = make_questions(digits.target[images], per_image, options.seed * 100 + seed)
        ids, lengths = tokenize(qs.words)
        sets[name] = (qs, ids, lengths, all_patches[images[qs.image]], images[qs.image])
    qs, ids, lengths, image, _ = sets["train"]
    answers = torch.as_tensor(qs.answer, dtype=torch.float32)
    models, fitted = _fit_all(options, info, (ids, lengths, image, answers))
    if out is None:
        return {}
    save(models["model"], out / "model")
    tq, tids, tlengths, timage, timages = sets["test"]
    probs = {k: predict(m, tids, tlengths, timage, options.precision) for k, m in models.items()}
    metrics = {k: _accuracy(p, tq.answer, tq.kind) for k, p in probs.items()}
    training_curve(fitted, out / "training_curve.png", "crossmodal: binary cross-entropy")
    _confusion_figure(probs["model"], tq.answer, out / "confusion.png")
    _attention_figure(models["model"], tq, tids, tlengths, timage, timages, digits.images,
                      probs["model"], out / "attention.png")  # fmt: skip
    summary = {
        "task": "crossmodal",
        "split": {
            "images": len(order),
            "train_images": train_images.tolist(),
            "test_images": test_images.tolist(),
            "questions_per_image": per_image,
            "train_questions": len(answers),
            "test_questions": len(tq.answer),
            "test_yes_fraction": float(tq.answer.mean()),
        },
        "patches": "2 x 2 pixels, 16 per image, row-major; pixel values / 16",
        "widths": {"query (question tokens)": 32, "key/value (patches)": 48},
        "metrics": metrics,
        "goal_beats_both_baselines": (
            metrics["model"]["accuracy"]
            > max(metrics["question_only"]["accuracy"], metrics["image_only"]["accuracy"])
            if options.baselines
            else None
        ),
        "test_probabilities": [round(float(p), 6) for p in probs["model"][:50]],
        "training": {k: v.summary() for k, v in fitted.items()},
        "model_dir": "model",
        "figures": ["training_curve.png", "confusion.png", "attention.png"],
    }
    return finish(summary, options, info, started, out)


def _loss(m: nn.Module, batch: tuple[Tensor, ...]) -> Tensor:
    x, n, img, y = batch
    return nn.functional.binary_cross_entropy_with_logits(m(x, n, img).float(), y,
                                                          reduction="none")  # fmt: skip


def _collate(tensors: tuple[Tensor, ...], device: torch.device) -> Any:
    """A batch of the questions ``idx``: ids, lengths, patches and answers on ``device``."""

    def collate(idx: Tensor) -> tuple[Tensor, ...]:
        return tuple(t[idx].to(device) for t in tensors)

    return collate


def _fit_all(
    options: Options, info: Dist, tensors: tuple[Tensor, ...]
) -> tuple[dict[str, nn.Module], dict[str, FitResult]]:
    """The cross-attention model and, unless ``--no-baselines``, both baselines, trained on
    the questions ``tensors`` (ids, lengths, patches, answers)."""
    models: dict[str, nn.Module] = {"model": CrossModalQA()}
    if options.baselines:
        models["question_only"] = QuestionOnly()
        models["image_only"] = ImageOnly()
    fitted: dict[str, FitResult] = {}
    collate = _collate(tensors, info.device)
    for name, m in models.items():
        config = options.train_config(
            epochs=1 if options.quick else 20, batch_size=32 if options.quick else 64, lr=2e-3
        )
        if options.quick and config.max_steps is None:
            config.max_steps = 6
        fitted[name] = fit(m, len(tensors[3]), collate, _loss, config, info, desc=name)
        options.adopt(fitted[name])
    return models, fitted


def _confusion_figure(prob: np.ndarray, answer: np.ndarray, path: Path) -> Path:
    fig = figure(figsize=(3.4, 3.2))
    ax = fig.subplots()
    table = np.zeros((2, 2), dtype=int)
    for t, p in zip(answer, (prob > 0.5).astype(int)):
        table[t, p] += 1
    ax.imshow(table, cmap="Blues")
    for i in range(2):
        for j in range(2):
            ax.text(j, i, str(table[i, j]), ha="center", va="center")
    ax.set_xticks([0, 1], ["no", "yes"])
    ax.set_yticks([0, 1], ["no", "yes"])
    ax.set_xlabel("model")
    ax.set_ylabel("truth")
    ax.set_title("test questions", fontsize=9)
    return save_figure(fig, path)


def _attention_figure(model, qs, ids, lengths, image, images, pixels, prob, path: Path) -> Path:
    """Six test questions: the digit, and the cross-attention of the question (mean over its
    tokens and the heads) on each 2 x 2 patch, drawn over the image."""
    picks = []
    for kind in (*KINDS, "is_digit"):
        hits = [i for i, k in enumerate(qs.kind) if k == kind and i not in picks]
        if hits:
            picks.append(hits[0])
    picks = picks[:6]
    device = next(model.parameters()).device
    with torch.inference_mode():
        _, w = model.run(ids[picks].to(device), lengths[picks].to(device),
                         image[picks].to(device))  # fmt: skip
    w = w.float().cpu()  # [n, H, L, S]
    fig = figure(figsize=(3.0 * len(picks), 3.4))
    axes = fig.subplots(1, len(picks), squeeze=False)[0]
    side = 8 // PATCH
    for ax, i, wi in zip(axes, picks, w):
        n = int(lengths[i])
        heat = wi[:, :n].mean(dim=(0, 1)).reshape(side, side).numpy()
        big = np.kron(heat, np.ones((PATCH, PATCH)))
        ax.imshow(big, cmap="magma")  # the weights, with the digit's strokes outlined
        ax.contour(pixels[images[i]], levels=[6.0], colors="cyan", linewidths=1.2)
        answer = "yes" if qs.answer[i] else "no"
        ax.set_title(f"{' '.join(qs.words[i])}\ntruth {answer}, p(yes)={prob[i]:.2f}", fontsize=8)
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle("cross-attention of the question on image patches", fontsize=10)
    return save_figure(fig, path)


def throughput(options: Options, info: Dist, steps: int) -> dict[str, Any]:
    """The training step alone, for ``multihead bench train``: the cross-attention model on
    the questions (``options.max_steps`` bounds it); its ``FitResult`` summary."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    qs = make_questions(digits.target, 8, options.seed)
    ids, lengths = tokenize(qs.words)
    image = patches(digits.images)[qs.image]
    answers = torch.as_tensor(qs.answer, dtype=torch.float32)
    collate = _collate((ids, lengths, image, answers), info.device)
    config = options.train_config(epochs=1, batch_size=64, lr=2e-3)
    return fit(CrossModalQA(), len(answers), collate, _loss, config, info).summary()
