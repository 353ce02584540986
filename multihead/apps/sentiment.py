"""``multihead train sentiment``: fine-tune all-MiniLM-L6-v2 with a small regression head on the
VADER ground truth (Hutto & Gilbert 2014: 23,703 short texts in four domains, each rated by
about 20 people from -4 to +4).

Protocol (the paper's): per domain, one half trains and the other half tests (a seeded random
half: the files are ordered). One model is fine-tuned on the four training halves together
(less a seeded validation slice of each) and scored on each domain's test half. Scores are in
[-1, 1]: the target is the mean rating stretched away from 0 (``stretch``: VADER's
normalization x / sqrt(x^2 + alpha), rescaled so that +-4 -> +-1). The head predicts the target
for every alpha in ``STRETCHES`` at once; the alpha whose output is kept is chosen on the
validation slices (the worst margin over VADER across domains and metrics), never on the test
halves.

- Pearson r of the score against the mean rating.
- Three-class weighted F1: the human rating classed by its sign (0 = neutral), a model's score
  by the thresholds +-0.05 (>= 0.05 positive, <= -0.05 negative, else neutral). On the whole
  files this gives VADER 0.95 / 0.59 / 0.63 / 0.55 (tweets, movies, Amazon, NYT) against the
  paper's 0.96 / 0.61 / 0.63 / 0.55 (the packaged VADER is a later version).

Baselines in the same run and on the same split: VADER (``vaderSentiment``), TF-IDF + logistic
regression trained on each domain's half (the paper's machine-learning protocol; score
P(positive) - P(negative)) and the seed's from-scratch ``AttentionClassifier``.
"""

from __future__ import annotations

import functools
import html
import math
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from .. import _validation as V
from .. import data as datasets
from .. import masks
from ..io import register, save
from ..modules import MultiHeadAttention
from .common import Options, figure, finish, need, save_figure, seed_everything, training_curve
from .loop import Dist, FitResult, autocast, fit

__all__ = [
    "PAPER_VADER",
    "STRETCHES",
    "SUMMARY",
    "AttentionClassifier",
    "Corpus",
    "SentimentRegressor",
    "classify",
    "evaluate",
    "read_corpora",
    "run",
    "split",
    "stretch",
    "throughput",
    "validation_split",
]

SUMMARY = "fine-tune all-MiniLM-L6-v2 to rate the VADER ground truth, beside VADER and TF-IDF"
SUFFIX = "_GroundTruth.txt"
# Hutto & Gilbert (2014), Table 3: VADER's Pearson r and three-class F1 per corpus
PAPER_VADER = {
    "tweets": {"r": 0.881, "f1": 0.96},
    "movieReviewSnippets": {"r": 0.451, "f1": 0.61},
    "amazonReviewSnippets": {"r": 0.565, "f1": 0.63},
    "nytEditorialSnippets": {"r": 0.492, "f1": 0.55},
}
THRESHOLD = 0.05
# alpha of ``stretch`` per output of the head; None is the plain rating / 4. With VADER's own
# alpha (15) the slope at 0 is that of rating / 4: smaller alphas stretch mild ratings.
STRETCHES: tuple[float | None, ...] = (None, 16.0, 4.0, 1.0, 0.25)
VALIDATION = 0.15  # of each domain's training half, for choosing the stretch


@dataclass
class Corpus:
    """One domain: row ids, mean human ratings (-4..4) and texts (HTML entities decoded)."""

    domain: str
    ids: list[str]
    ratings: np.ndarray
    texts: list[str]


def _read_file(path: Path) -> Corpus:
    ids, ratings, texts = [], [], []
    for number, line in enumerate(V.read_utf8_lines(path), 1):
        if not line.strip():
            continue
        parts = line.split("\t", 2)
        try:
            if len(parts) != 3:
                raise ValueError
            rating = float(parts[1])
        except ValueError:
            raise ValueError(
                f"{path.name}:{number} must be id<TAB>mean_rating<TAB>text with a numeric "
                f"rating. Received: {line[:80]!r}"
            ) from None
        if not math.isfinite(rating):  # nan or inf would reach the metrics as null
            raise ValueError(
                f"{path.name}:{number}: the mean rating must be a finite number (the ratings "
                f"are -4 to +4); fix or remove the row. Received: {parts[1]!r}"
            )
        ids.append(parts[0])
        ratings.append(rating)
        texts.append(_unescape(parts[2]).strip())
    if not ids:
        raise ValueError(f"{path} holds no rows. Received: an empty file")
    return Corpus(
        path.name.removesuffix(SUFFIX).removesuffix(".txt"), ids, np.array(ratings), texts
    )


def _unescape(text: str) -> str:
    """Decode HTML entities; a few texts are escaped twice (``&amp;amp;``)."""
    for _ in range(3):
        decoded = html.unescape(text)
        if decoded == text:
            break
        text = decoded
    return text


def read_corpora(path: str | Path | None) -> list[Corpus]:
    """Read a folder of ``*_GroundTruth.txt`` files (one domain each) or a single such file;
    None: the VADER ground truth in the cache (``multihead data download vader``)."""
    folder = datasets.find("vader") if path is None else Path(path)
    if not folder.exists():
        raise FileNotFoundError(
            f"sentiment data not found at '{folder}'; pass --data with the folder of VADER "
            f"ground-truth files (id<TAB>rating<TAB>text) or one such file. Received: "
            f"--data {'(default) ' if path is None else ''}{folder}"
        )
    files = [folder] if folder.is_file() else sorted(folder.glob(f"*{SUFFIX}"))
    if not files:
        raise FileNotFoundError(
            f"no *{SUFFIX} files in '{folder}'. Received: "
            f"{sorted(p.name for p in folder.iterdir())[:8]}"
        )
    return [_read_file(f) for f in files]


def split(corpus: Corpus, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A seeded random half of the rows for training, the other half for testing."""
    rng = np.random.default_rng([seed, zlib.crc32(corpus.domain.encode())])
    order = rng.permutation(len(corpus.ids))
    half = len(order) // 2
    return np.sort(order[:half]), np.sort(order[half:])


def validation_split(train: np.ndarray, domain: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A seeded ``VALIDATION`` share of a training half (at least one row) for choosing the
    stretch; returns (fit rows, validation rows), both sorted."""
    rng = np.random.default_rng([seed, zlib.crc32(domain.encode()), 1])
    order = rng.permutation(train)
    cut = max(1, round(VALIDATION * len(order)))
    return np.sort(order[cut:]), np.sort(order[:cut])


def stretch(rating: np.ndarray, alpha: float | None) -> np.ndarray:
    """A mean rating in [-4, 4] -> a target in [-1, 1], monotone and odd.

    ``alpha=None``: rating / 4. Otherwise VADER's normalization of its valence sum applied to
    the rating, rescaled so that +-4 maps to +-1:
    ``rating / sqrt(rating^2 + alpha) * sqrt(16 + alpha) / 4``. Its slope at 0 is
    ``sqrt(16 + alpha) / (4 sqrt(alpha))`` (1.03 for alpha = 1, against 0.25 for rating / 4), so
    a mild rating lands away from the +-0.05 neutral band; large alphas approach rating / 4.
    """
    r = np.asarray(rating, dtype=float)
    if alpha is None:
        return np.clip(r / 4, -1.0, 1.0)
    if not alpha > 0:
        raise ValueError(f"alpha must be > 0 (or None for rating / 4). Received: alpha={alpha!r}")
    return np.clip(r / np.sqrt(r * r + alpha) * np.sqrt(16 + alpha) / 4, -1.0, 1.0)


def classify(score: np.ndarray) -> np.ndarray:
    """A model's score in [-1, 1] -> 1 / 0 / -1 with the paper's +-0.05 thresholds."""
    return np.where(score >= THRESHOLD, 1, np.where(score <= -THRESHOLD, -1, 0))


def evaluate(score: np.ndarray, rating: np.ndarray) -> dict[str, float]:
    """Pearson r against the mean rating and weighted three-class F1 (rating classed by sign)."""
    metrics = need("sklearn.metrics", "sentiment metrics")
    score = np.asarray(score, dtype=float)
    r = float(np.corrcoef(score, rating)[0, 1]) if np.std(score) > 0 else float("nan")
    f1 = metrics.f1_score(
        np.sign(rating), classify(score), average="weighted", labels=[-1, 0, 1], zero_division=0
    )
    return {"r": r, "f1": float(f1)}


# ---------------------------------------------------------------------------------------------
# models


def _write_tokenizer(model: SentimentRegressor, folder: Path) -> None:
    if model.tokenizer is not None:
        model.tokenizer.save(str(folder / "tokenizer.json"))


def _read_tokenizer(model: SentimentRegressor, folder: Path) -> None:
    if (folder / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        model.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))


def _mean_pool(hidden: Tensor, lengths: Tensor) -> Tensor:
    """(B, L, E) -> (B, E): the mean over each row's first ``lengths`` tokens."""
    keep = torch.arange(hidden.shape[1], device=hidden.device)[None] < lengths[:, None]
    keep = keep.to(hidden.dtype)[..., None]
    return (hidden * keep).sum(1) / keep.sum(1).clamp_min(1)


@register(files=_write_tokenizer, restore=_read_tokenizer)
class SentimentRegressor(nn.Module):
    """A BERT encoder, mean pooling over real tokens, then a small head to scores in [-1, 1].

    Args:
        encoder: a ``multihead.models.bert.Bert`` (its pooler is dropped: unused here).
        hidden: width of the head's hidden layer.
        dropout: dropout before the head's output layer.
        max_tokens: where ``predict`` truncates a text.
        alphas: the ``stretch`` each output was trained to predict, one output per entry
            (None: rating / 4).
        output: the output that is the score (set by ``keep``); None returns all of them.

    ``tokenizer`` (a ``tokenizers.Tokenizer``) is saved beside the weights as tokenizer.json.
    """

    def __init__(
        self,
        encoder: nn.Module,
        *,
        hidden: int = 256,
        dropout: float = 0.1,
        max_tokens: int = 128,
        alphas: Sequence[float | None] = (None,),
        output: int | None = None,
    ) -> None:
        super().__init__()
        if not alphas or any(a is not None and not a > 0 for a in alphas):
            raise ValueError(
                f"alphas must be a non-empty list of stretches > 0 or None. Received: "
                f"alphas={alphas!r}"
            )
        encoder.pooler = None
        self.encoder = encoder
        self.max_tokens = max_tokens
        self.alphas = list(alphas)
        self.output: int | None = None
        if output is not None:
            self.keep(output)
        width = encoder.config.hidden_size
        self.head = nn.Sequential(
            nn.Linear(width, hidden), nn.GELU(), nn.Dropout(dropout), nn.Linear(hidden, len(alphas))
        )
        self.tokenizer: Any = None

    def forward(self, input_ids: Tensor, lengths: Tensor) -> Tensor:
        """input_ids (B, L), lengths (B,) -> scores (B,) in [-1, 1]: the kept output, or the
        only one; (B, K) for K alphas before ``keep``."""
        hidden = self.encoder(input_ids, lengths=lengths)
        out = torch.tanh(self.head(_mean_pool(hidden, lengths)))  # [B, K]
        if self.output is not None:
            return out[:, self.output]
        return out[:, 0] if out.shape[1] == 1 else out

    def keep(self, index: int) -> None:
        """Make output ``index`` (the stretch ``alphas[index]``) the score: one per text."""
        if (
            isinstance(index, bool)
            or not isinstance(index, int)
            or not 0 <= index < len(self.alphas)
        ):
            raise ValueError(
                f"output must pick one of the {len(self.alphas)} outputs (0 .. "
                f"{len(self.alphas) - 1}). Received: output={index!r}"
            )
        self.output = index

    @property
    def alpha(self) -> float | None:
        """The stretch of the score (``stretch``); only once one output is the score."""
        if self.output is None and len(self.alphas) > 1:
            raise ValueError(
                f"no output is kept yet; call keep(index). Received: {len(self.alphas)} outputs"
            )
        return self.alphas[self.output or 0]

    def predict(self, texts: Sequence[str], *, batch_size: int = 64) -> np.ndarray:
        """Scores in [-1, 1] for texts ((N,); (N, K) before ``keep``), with the saved tokenizer."""
        if self.tokenizer is None:
            raise ValueError(
                "this model has no tokenizer; set model.tokenizer or load a folder with "
                "tokenizer.json. Received: tokenizer=None"
            )
        return _predict(self, encode(self.tokenizer, texts, self.max_tokens), batch_size)


@register
class AttentionClassifier(nn.Module):
    """The seed's from-scratch model: embedding, one multi-head self-attention layer, mean
    pooling over real tokens, a dense layer; ``num_outputs=1`` with tanh gives a score.

    Args:
        vocab_size: token ids are below this.
        embed_dim: E.
        num_heads: H.
        num_outputs: outputs of the dense layer (1: a regression score in [-1, 1]).
        dropout: dropout on the attention weights and the pooled vector.
    """

    def __init__(
        self,
        vocab_size: int,
        *,
        embed_dim: int = 64,
        num_heads: int = 4,
        num_outputs: int = 1,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embed_dim, padding_idx=0)
        self.attention = MultiHeadAttention(embed_dim, num_heads, dropout=dropout)
        self.dropout = nn.Dropout(dropout)
        self.dense = nn.Linear(embed_dim, num_outputs)
        self.num_outputs = num_outputs

    def forward(self, input_ids: Tensor, lengths: Tensor) -> Tensor:
        """input_ids (B, L), lengths (B,) -> (B,) scores (one output) or (B, num_outputs)."""
        x = self.embedding(input_ids)
        x = self.attention(x, mask=masks.lengths(lengths))
        out = self.dense(self.dropout(_mean_pool(x, lengths)))
        return torch.tanh(out[:, 0]) if self.num_outputs == 1 else out


def encode(tokenizer: Any, texts: Sequence[str], max_tokens: int) -> list[list[int]]:
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_tokens)
    return [e.ids for e in tokenizer.encode_batch(list(texts))]


def _pad(ids: list[list[int]], device: torch.device) -> tuple[Tensor, Tensor]:
    lengths = torch.tensor([len(x) for x in ids])
    batch = torch.zeros(len(ids), int(lengths.max()), dtype=torch.long)
    for i, row in enumerate(ids):
        batch[i, : len(row)] = torch.tensor(row)
    return batch.to(device), lengths.to(device)


@torch.inference_mode()
def _predict(
    model: nn.Module, ids: list[list[int]], batch_size: int, precision: str = "fp32"
) -> np.ndarray:
    """Scores for pre-tokenized texts, batched by length so little padding is computed."""
    model.eval()
    device = next(model.parameters()).device
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    out: np.ndarray | None = None
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        x, lengths = _pad([ids[i] for i in rows], device)
        with autocast(precision, device):
            scores = model(x, lengths).float().cpu().numpy()
        if out is None:
            out = np.empty((len(ids), *scores.shape[1:]))
        out[rows] = scores
    return out if out is not None else np.empty(0)


# ---------------------------------------------------------------------------------------------
# the run


def _train(
    model: nn.Module,
    ids: list[list[int]],
    targets: np.ndarray,
    config: Any,
    info: Dist,
    desc: str,
    param_groups: list[dict[str, Any]] | None = None,
) -> FitResult:
    y = torch.as_tensor(targets, dtype=torch.float32)

    def collate(idx: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        x, lengths = _pad([ids[i] for i in idx.tolist()], info.device)
        return x, lengths, y[idx].to(info.device)

    def loss_fn(m: nn.Module, batch: tuple[Tensor, Tensor, Tensor]) -> Tensor:
        x, lengths, target = batch
        error = (m(x, lengths).float() - target).pow(2)
        return error.mean(-1) if error.ndim == 2 else error  # the mean over the K targets

    return fit(model, len(ids), collate, loss_fn, config, info, desc=desc,
               param_groups=param_groups, lengths=[len(x) for x in ids])  # fmt: skip


def _tfidf(train_texts: list[str], train_y: np.ndarray, test_texts: list[str], quick: bool):
    fe = need("sklearn.feature_extraction.text", "the TF-IDF baseline")
    lm = need("sklearn.linear_model", "the TF-IDF baseline")
    vectorizer = fe.TfidfVectorizer(ngram_range=(1, 2), min_df=1 if quick else 2, sublinear_tf=True)
    x = vectorizer.fit_transform(train_texts)
    labels = np.sign(train_y).astype(int)
    classifier = lm.LogisticRegression(C=4.0, max_iter=2000).fit(x, labels)
    proba = classifier.predict_proba(vectorizer.transform(test_texts))
    column = {c: i for i, c in enumerate(classifier.classes_)}
    pos = proba[:, column[1]] if 1 in column else 0.0
    neg = proba[:, column[-1]] if -1 in column else 0.0
    return pos - neg


@functools.cache
def _analyzer() -> Any:
    """VADER's analyzer; it reads its lexicon when built, so it is built once."""
    return need("vaderSentiment.vaderSentiment", "the VADER baseline").SentimentIntensityAnalyzer()


def _vader(texts: list[str]) -> np.ndarray:
    analyzer = _analyzer()
    return np.array([analyzer.polarity_scores(t)["compound"] for t in texts])


def _choose(
    validation: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]],
) -> tuple[int, dict[str, Any]]:
    """The output (stretch) with the largest worst-case margin over VADER on the validation
    slices: min over domains and over r and F1 of (ours - VADER). Returns its index and the
    table behind the choice."""
    table: dict[str, Any] = {}
    margins = []
    for k, alpha in enumerate(STRETCHES):
        rows = {}
        worst = np.inf
        for domain, (scores, vader, rating) in validation.items():
            ours, theirs = evaluate(scores[:, k], rating), evaluate(vader, rating)
            rows[domain] = ours
            for key in ("r", "f1"):
                margin = ours[key] - theirs[key]
                worst = min(worst, margin if np.isfinite(margin) else -np.inf)
        table["inf" if alpha is None else str(alpha)] = {"worst_margin": worst, "domains": rows}
        margins.append(worst)
    table["vader"] = {d: evaluate(v, r) for d, (_, v, r) in validation.items()}
    return int(np.argmax(margins)), table


@dataclass
class _Domain:
    """One corpus in the run: its two halves, the training half cut into fit and validation
    rows, and the token ids of every text."""

    corpus: Corpus
    train: np.ndarray
    test: np.ndarray
    fit: np.ndarray
    validation: np.ndarray
    ids: list[list[int]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.corpus.domain

    def token_ids(self, rows: np.ndarray) -> list[list[int]]:
        return [self.ids[i] for i in rows]

    def texts(self, rows: np.ndarray) -> list[str]:
        return [self.corpus.texts[i] for i in rows]


def _sample(corpora: list[Corpus], seed: int, size: int = 32) -> None:
    """Quick runs: keep a seeded sample of ``size`` rows per domain (in file order)."""
    rng = np.random.default_rng(seed)
    for c in corpora:
        keep = np.sort(rng.permutation(len(c.ids))[:size])
        c.ids = [c.ids[i] for i in keep]
        c.ratings = c.ratings[keep]
        c.texts = [c.texts[i] for i in keep]


def _split_domains(corpora: list[Corpus], seed: int) -> list[_Domain]:
    domains = []
    for c in corpora:
        train, test = split(c, seed)
        domains.append(_Domain(c, train, test, *validation_split(train, c.domain, seed)))
    return domains


def _fit_regressor(
    pretrained: Any, domains: list[_Domain], max_tokens: int, options: Options, info: Dist
) -> tuple[SentimentRegressor, FitResult]:
    """MiniLM with the regression head, fine-tuned on every domain's fit rows towards the
    targets of every stretch at once."""
    fit_ids = [d.ids[i] for d in domains for i in d.fit]
    fit_ratings = np.array([d.corpus.ratings[i] for d in domains for i in d.fit])
    targets = np.stack([stretch(fit_ratings, a) for a in STRETCHES], axis=1)  # [N, K]

    model = SentimentRegressor(pretrained.model, max_tokens=max_tokens, alphas=STRETCHES)
    model.tokenizer = pretrained.tokenizer
    if options.quick:
        config = options.train_config(epochs=1, batch_size=8, lr=5e-5)
    else:
        config = options.train_config(epochs=2, batch_size=32, lr=5e-5, warmup=0.06)
    groups = [
        {"params": list(model.encoder.parameters())},
        {"params": list(model.head.parameters()), "lr_scale": 20.0},  # a new head learns faster
    ]
    return model, _train(model, fit_ids, targets, config, info, "MiniLM", groups)


def _fit_baseline(
    vocab_size: int, domains: list[_Domain], options: Options, info: Dist
) -> tuple[AttentionClassifier, FitResult]:
    """The from-scratch classifier, trained on the whole training halves (as before the
    stretch)."""
    train_ids = [d.ids[i] for d in domains for i in d.train]
    train_y = np.concatenate([stretch(d.corpus.ratings[d.train], None) for d in domains])
    baseline = AttentionClassifier(vocab_size)
    small = options.train_config(
        epochs=1 if options.quick else 8, batch_size=8 if options.quick else 64, lr=2e-3
    )
    return baseline, _train(baseline, train_ids, train_y, small, info, "AttentionClassifier")


def _scores(model: nn.Module, domain: _Domain, rows: np.ndarray, precision: str) -> np.ndarray:
    """The regressor's outputs (rows, K): one column per stretch."""
    return _predict(model, domain.token_ids(rows), 128, precision).reshape(len(rows), -1)


def _choose_stretch(
    model: SentimentRegressor, domains: list[_Domain], precision: str
) -> tuple[int, dict[str, Any]]:
    """``_choose`` on every domain's validation rows (never the test halves)."""
    validation = {}
    for d in domains:
        rows = d.validation
        scores = _scores(model, d, rows, precision)
        validation[d.name] = (scores, _vader(d.texts(rows)), d.corpus.ratings[rows])
    return _choose(validation)


def _baseline_scores(
    domain: _Domain, baseline: AttentionClassifier, options: Options
) -> dict[str, np.ndarray]:
    """VADER, TF-IDF + logistic regression (trained on this domain's half) and the
    from-scratch classifier on the domain's test half."""
    d, test = domain, domain.test
    return {
        "vader": _vader(d.texts(test)),
        "tfidf_logreg": _tfidf(
            d.texts(d.train), d.corpus.ratings[d.train], d.texts(test), options.quick
        ),
        "attention_classifier": _predict(baseline, d.token_ids(test), 128, options.precision),
    }


def _domain_entry(domain: _Domain, scores: dict[str, np.ndarray]) -> dict[str, Any]:
    """One domain's part of the summary: its sizes, rows and the metrics of every scorer."""
    d = domain
    truth = d.corpus.ratings[d.test]
    metrics = {k: evaluate(v, truth) for k, v in scores.items()}
    if d.name in PAPER_VADER:
        metrics["paper_vader"] = PAPER_VADER[d.name]
    return {
        "n_train": len(d.train),
        "n_fit": len(d.fit),
        "n_validation": len(d.validation),
        "n_test": len(d.test),
        "validation_ids": [d.corpus.ids[i] for i in d.validation],
        "test_ids": [d.corpus.ids[i] for i in d.test],
        "metrics": metrics,
        "first_scores": [round(float(v), 6) for v in scores["model"][:20]],
    }


@dataclass
class _TestReport:
    """The test halves: per domain, the metrics of every stretch (reported, not used for the
    choice), the summary's entry and the (truth, predicted) classes of the confusion figure."""

    every_alpha: dict[str, Any] = field(default_factory=dict)
    domains: dict[str, Any] = field(default_factory=dict)
    confusion: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    def above_vader_everywhere(self) -> bool:
        return all(
            d["metrics"]["model"][k] > d["metrics"]["vader"][k]
            for d in self.domains.values()
            for k in ("r", "f1")
        )


def _test(
    every: dict[str, np.ndarray],
    chosen: int,
    domains: list[_Domain],
    baseline: AttentionClassifier | None,
    options: Options,
) -> _TestReport:
    """Score the test halves: ``every`` holds the regressor's outputs at every stretch."""
    report = _TestReport()
    for d in domains:
        truth = d.corpus.ratings[d.test]
        scores = {"model": every[d.name][:, chosen]}
        report.every_alpha[d.name] = {
            "inf" if a is None else str(a): evaluate(every[d.name][:, k], truth)
            for k, a in enumerate(STRETCHES)
        }
        if baseline is not None:
            scores.update(_baseline_scores(d, baseline, options))
        report.domains[d.name] = _domain_entry(d, scores)
        report.confusion[d.name] = (np.sign(truth), classify(scores["model"]))
    return report


def _summary(
    chosen: int,
    selection: dict[str, Any],
    report: _TestReport,
    goal: bool | None,
    fitted: dict[str, FitResult],
) -> dict[str, Any]:
    alpha = STRETCHES[chosen]
    return {
        "task": "sentiment",
        "protocol": "per domain: a seeded random half trains, the other half tests; one model "
        f"fine-tuned on all training halves less a seeded {VALIDATION:.0%} validation slice of "
        "each; score = tanh output in [-1, 1], target stretch(rating, alpha)",
        "f1": "weighted three-class F1; rating classed by sign (0 = neutral), score by >= 0.05 "
        "positive, <= -0.05 negative",
        "stretch": {
            "formula": "rating / sqrt(rating^2 + alpha) * sqrt(16 + alpha) / 4 (alpha inf: "
            "rating / 4)",
            "alphas": ["inf" if a is None else a for a in STRETCHES],
            "chosen": "inf" if alpha is None else alpha,
            "criterion": "largest worst-case margin over VADER (min over domains of ours - VADER "
            "in r and F1) on the validation slices",
            "validation": selection,
            "test_of_every_alpha": report.every_alpha,  # reported, not used for the choice
        },
        "domains": report.domains,
        "goal_above_vader_everywhere": goal,
        "training": {k: v.summary() for k, v in fitted.items()},
        "model_dir": "model",
        "figures": ["training_curve.png", "confusion.png", "attention.png"],
    }


def run(options: Options, info: Dist, out: Path | None) -> dict[str, Any]:
    """Fine-tune, choose the stretch, measure the baselines, write the run into ``out`` (None
    on processes other than rank 0, which write nothing; see module docstring)."""
    from ..models import bert

    started = time.perf_counter()
    seed_everything(options.seed)
    corpora = read_corpora(options.data)
    if options.quick:  # a seeded sample of 32 rows per domain
        _sample(corpora, options.seed)
    domains = _split_domains(corpora, options.seed)
    pretrained = bert.load()
    max_tokens = 48 if options.quick else 128
    for d in domains:
        d.ids = encode(pretrained.tokenizer, d.corpus.texts, max_tokens)

    model, result = _fit_regressor(pretrained, domains, max_tokens, options, info)
    options.adopt(result)
    fitted = {"model": result}
    baseline = None
    if options.baselines:
        baseline, fitted["attention_classifier"] = _fit_baseline(
            pretrained.config.vocab_size, domains, options, info
        )
    if out is None:
        return {}

    chosen, selection = _choose_stretch(model, domains, options.precision)
    every = {d.name: _scores(model, d, d.test, options.precision) for d in domains}
    model.keep(chosen)
    save(model, out / "model")
    report = _test(every, chosen, domains, baseline, options)
    goal = report.above_vader_everywhere() if options.baselines else None
    training_curve(fitted, out / "training_curve.png", "sentiment: MSE on the stretched ratings")
    _confusion_figure(report.confusion, out / "confusion.png")
    example = min(corpora[0].texts, key=lambda t: abs(len(t) - 60))
    _attention_figure(model, pretrained, example, out / "attention.png", options.quick)
    summary = _summary(chosen, selection, report, goal, fitted)
    return finish(summary, options, info, started, out)


def _confusion_figure(confusion: dict[str, tuple[np.ndarray, np.ndarray]], path: Path) -> Path:
    fig = figure(figsize=(3.3 * len(confusion), 3.3))
    axes = fig.subplots(1, len(confusion), squeeze=False)[0]
    names = ["neg", "neu", "pos"]
    for ax, (domain, (truth, pred)) in zip(axes, confusion.items()):
        table = np.zeros((3, 3), dtype=int)
        for t, p in zip(truth.astype(int), pred.astype(int)):
            table[t + 1, p + 1] += 1
        ax.imshow(table, cmap="Blues")
        for i in range(3):
            for j in range(3):
                ax.text(j, i, str(table[i, j]), ha="center", va="center", fontsize=8)
        ax.set_xticks(range(3), names)
        ax.set_yticks(range(3), names)
        ax.set_xlabel("model (score, +-0.05)")
        ax.set_title(domain, fontsize=9)
    axes[0].set_ylabel("people (sign of the mean rating)")
    return save_figure(fig, path)


def _attention_figure(
    model: SentimentRegressor, pretrained: Any, text: str, path: Path, quick: bool
) -> Path:
    """Every layer and head of the fine-tuned encoder on one text (``quick``: the last layer,
    as 72 panels take matplotlib seconds)."""
    from ..inspect import for_text
    from ..viz import heatmap_grid

    batch = pretrained.tokenize([text])
    device = next(model.parameters()).device
    with torch.inference_mode():
        out = model.encoder.run(
            batch.input_ids.to(device), lengths=batch.lengths.to(device), return_weights=True
        )
    weights = for_text([w.cpu() for w in out.weights], 0, int(batch.lengths[0]))
    fig = heatmap_grid(weights, batch.tokens[0], layers=[len(weights) - 1] if quick else None)
    fig.suptitle(f"fine-tuned encoder on: {text[:70]}", fontsize=9)
    return save_figure(fig, path)


def throughput(options: Options, info: Dist, steps: int) -> dict[str, Any]:
    """The training step alone, for ``multihead bench train``: ``steps`` optimizer steps of the
    fine-tuning on the real texts (no evaluation, no baselines); its ``FitResult`` summary."""
    from ..models import bert

    corpora = read_corpora(options.data)
    pretrained = bert.load()
    texts = [c.texts[i] for c in corpora for i in split(c, options.seed)[0]]
    ratings = np.concatenate([c.ratings[split(c, options.seed)[0]] for c in corpora])
    count = min(len(texts), 32 * (steps + 2) * 4)  # enough texts for the batches, few to encode
    ids = encode(pretrained.tokenizer, texts[:count], 128)
    model = SentimentRegressor(pretrained.model, alphas=STRETCHES)
    config = options.train_config(epochs=1, batch_size=32, lr=5e-5)
    targets = np.stack([stretch(ratings[:count], a) for a in STRETCHES], axis=1)
    return _train(model, ids, targets, config, info, "MiniLM").summary()
