"""``multihead train lm``: a small decoder (GPT-2 or Llama shape, built from this library's
modules) and its own byte-level BPE tokenizer, trained from scratch and offline on text files.

Data (``--data``, default: the VADER ground truth ``multihead data download vader`` puts in
the cache): a UTF-8 file or a folder. A
file named ``*_GroundTruth.txt`` is read as VADER ground truth (``id<TAB>rating<TAB>text``:
the text field, HTML entities decoded); any other file gives one text per non-empty line. A
folder gives its ``*_GroundTruth.txt`` files when it has some, else all its ``*.txt`` files
(sorted by name; so the VADER folder's README and LICENSE are not read). Exact duplicate texts
are dropped, then a seeded random ``HELD_OUT`` share of the texts is held out. The seed of the
split is fixed (``SPLIT_SEED``), so runs with different ``--seed`` (initialization and batch
order) are scored on the same texts.

Each text becomes ``<|endoftext|> tokens <|endoftext|>``: the model predicts every token after
the first, the closing one included; a text longer than the model's positions is cut into
windows that overlap by one token, so every token is predicted exactly once. Held-out
perplexity is exp(mean negative log-likelihood) over those predicted tokens, for the model and
for an interpolated Kneser-Ney bigram model (``KneserNeyBigram``) counted on the training
tokens: the baseline the model must beat.

The run folder is a transformers-format model folder (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json) that ``multihead.models.load`` opens, plus
metrics.json, loss_curve.png, samples.txt and held_out.txt (the held-out texts, one per line:
what ``multihead bench decode --model DIR --text DIR/held_out.txt`` scores the packed weight
formats on). Needs the ``train`` extra.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from .. import _validation as V
from .. import data as datasets
from .._flags import option, positive_int
from .common import Options, figure, finish, save_figure, seed_everything
from .loop import Dist, FitResult, fit

__all__ = [
    "END",
    "FULL",
    "HELD_OUT",
    "QUICK",
    "SPLIT_SEED",
    "SUMMARY",
    "KneserNeyBigram",
    "LMOptions",
    "Recipe",
    "archs",
    "build_model",
    "examples",
    "pack",
    "perplexity",
    "read_texts",
    "run",
    "split_texts",
    "train_tokenizer",
]

SUMMARY = "a small GPT-2 or Llama decoder and its own tokenizer, trained on --data text"
VADER_SUFFIX = "_GroundTruth.txt"
END = "<|endoftext|>"  # id 0: opens and closes every text; prompts begin with it too
HELD_OUT = 0.1  # share of the texts held out for perplexity
SPLIT_SEED = 19  # fixed: the held-out texts do not change with --seed
MIN_VOCAB = 260  # the 256 byte symbols, the end-of-text token and a few merges
MAX_VOCAB = 65536
SAMPLE_SETTINGS = {"temperature": 0.8, "top_p": 0.95}  # samples.txt: varied but on topic


def archs() -> list[str]:
    """The decoder shapes ``--arch`` takes: every causal model family that builds a fresh
    model from sizes (``Family.sized``)."""
    from ..models import all_families

    return [f.model_type for f in all_families() if f.causal and f.sized is not None]


@dataclass
class LMOptions(Options):
    """``multihead train lm``'s options: the common ones and the decoder's shape."""

    arch: str = option("gpt2", "the decoder's shape (its model family)", choices=archs)
    vocab_size: int | None = option(
        None, "the BPE vocabulary (default: the recipe's)", parse=positive_int
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.arch not in archs():
            raise ValueError(
                f"arch must be one of {', '.join(archs())}. Received: arch={self.arch!r}"
            )


@dataclass(frozen=True)
class Recipe:
    """The sizes of one run; ``FULL`` is the default, ``QUICK`` the ``--quick`` one."""

    vocab_size: int  # BPE vocabulary asked of the trainer (small data may give fewer)
    context: int  # positions: longer texts are cut into windows of this many tokens
    width: int  # E
    layers: int
    heads: int  # H (head dim D = E / H)
    kv_heads: int  # H_kv of the Llama shape: grouped-query attention
    batch_size: int  # blocks of `context` tokens per optimizer step
    epochs: int
    lr: float  # peak AdamW learning rate (linear warm-up over 10% of steps, linear decay)
    max_texts: int | None = None  # a seeded sample of the texts (None: all)


# about 2.6M parameters for GPT-2 (4 layers, E=192, 4096 tokens). On the VADER sentences (626k
# training tokens) 3 epochs of 32 blocks (231 steps) left it far above the bigram (held-out
# perplexity 248 against 144); 10 epochs of 16 blocks (1530 steps, 16 min on 2 cores in bf16)
# reached 130, best after epoch 9 (the held-out loss turned up in epoch 10): 8 epochs of 16
FULL = Recipe(vocab_size=4096, context=256, width=192, layers=4, heads=6, kv_heads=2,
              batch_size=16, epochs=8, lr=2e-3)  # fmt: skip
# about 0.1M parameters on 3000 texts: seconds, still well below the bigram baseline
QUICK = Recipe(vocab_size=512, context=96, width=64, layers=2, heads=4, kv_heads=2,
               batch_size=16, epochs=3, lr=3e-3, max_texts=3000)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# data


def _text_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = sorted(path.glob(f"*{VADER_SUFFIX}")) or sorted(
        p for p in path.glob("*.txt") if p.is_file() and not p.name.startswith(".")
    )
    if not files:
        raise FileNotFoundError(
            f"no text files in '{path}': --data takes a UTF-8 file or a folder of *.txt files "
            f"(one text per line) or of VADER *{VADER_SUFFIX} files. "
            f"Received: {sorted(p.name for p in path.iterdir())[:8]}"
        )
    return files


def read_texts(path: str | Path | None) -> list[str]:
    """The texts of ``path`` (a file or a folder; see the module docstring), in file order.

    Raises:
        FileNotFoundError: ``path`` is missing, or a folder without text files.
        ValueError: a file that is not UTF-8, a malformed VADER row (named), or no text at all.
    """
    from .sentiment import read_corpora

    source = datasets.find("vader") if path is None else Path(path)
    if not source.exists():
        raise FileNotFoundError(
            f"text not found at '{source}'; pass --data with a UTF-8 file or a folder of them. "
            f"Received: --data {'(default) ' if path is None else ''}{source}"
        )
    texts: list[str] = []
    for file in _text_files(source):
        if file.name.endswith(VADER_SUFFIX):
            texts += read_corpora(file)[0].texts
        else:
            texts += [line.strip() for line in V.read_utf8_lines(file)]
    texts = [t for t in texts if t]
    if not texts:
        raise ValueError(f"--data {source} holds no text. Received: only empty lines")
    return texts


def split_texts(
    texts: Sequence[str], *, share: float = HELD_OUT, seed: int = SPLIT_SEED
) -> tuple[list[str], list[str], int]:
    """Drop exact duplicates (the first copy stays), then a seeded random ``share`` of the
    texts (at least one) is held out. Returns (training texts, held-out texts, duplicates
    dropped); both lists keep the input order."""
    unique = list(dict.fromkeys(texts))
    if len(unique) < 2:
        raise ValueError(
            "--data needs at least two different texts (one to train on, one held out). "
            f"Received: {len(unique)} distinct text(s)"
        )
    order = np.random.default_rng(seed).permutation(len(unique))
    held = set(order[: max(1, round(share * len(unique)))].tolist())
    train = [t for i, t in enumerate(unique) if i not in held]
    return train, [t for i, t in enumerate(unique) if i in held], len(texts) - len(unique)


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Any:
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on ``texts``: id 0 is ``END``, which
    the post-processor puts before every encoded text (as a beginning-of-text token; decode
    with ``skip_special_tokens=True`` to drop it). Byte-level: every string encodes and
    decodes back unchanged, with no unknown token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{END} $A", pair=f"{END} $A {END} $B:1", special_tokens=[(END, 0)]
            ),
        ]
    )
    return tokenizer


def examples(tokenizer: Any, texts: Sequence[str], context: int) -> list[list[int]]:
    """Every text as ``END tokens END`` (the opening END from the tokenizer), cut into windows
    of at most ``context + 1`` tokens that overlap by one: a window's first ``n - 1`` tokens
    are the input, its last ``n - 1`` the targets, so each token after a text's first is a
    target exactly once."""
    out = []
    for encoding in tokenizer.encode_batch(list(texts)):
        ids = [*encoding.ids, 0]
        out += [ids[i : i + context + 1] for i in range(0, len(ids) - 1, context)]
    return out


def pack(tokenizer: Any, texts: Sequence[str], context: int, seed: int) -> Tensor:
    """The training texts in a seeded random order as one stream ``END t1 END t2 ... END``,
    cut into blocks of ``context + 1`` tokens that overlap by one: (N, context + 1), inputs
    ``[:, :-1]``, targets ``[:, 1:]``. A text may span two blocks and a block sees the texts
    before its own, as in GPT-2's training; the tail shorter than a block is left out."""
    order = np.random.default_rng(seed).permutation(len(texts)).tolist()
    stream = [0]
    for encoding in tokenizer.encode_batch([texts[i] for i in order]):
        stream += [*encoding.ids[1:], 0]  # the encoding opens with END already in the stream
    count = (len(stream) - 1) // context
    if count == 0:
        raise ValueError(
            f"the training text is too short for one block of {context} tokens. Received: "
            f"{len(stream)} tokens"
        )
    flat = torch.tensor(stream[: count * context + 1])
    return flat.unfold(0, context + 1, context)


def _targets(rows: Sequence[Sequence[int]]) -> int:
    return sum(len(r) - 1 for r in rows)


# ---------------------------------------------------------------------------------------------
# the baseline


class KneserNeyBigram:
    """Interpolated Kneser-Ney bigram model over token ids (Chen & Goodman 1998, eq. 21 with
    one discount), counted on the bigrams of ``rows``:

        P(w | v) = max(c(v, w) - d, 0) / c(v) + d * N(v .) / c(v) * P_cont(w)
        P_cont(w) = max(N(. w) - d, 0) / N(. .) + d * |{w : N(. w) > 0}| / N(. .) / V

    with c(v) = sum_w c(v, w); N(v .) the distinct tokens seen after v, N(. w) the distinct
    tokens seen before w, N(. .) the distinct bigrams; a context never seen uses P_cont. The
    continuation model keeps mass for tokens never seen (uniform over V), so every probability
    is > 0 and each P(. | v) sums to 1. The discount is Ney's estimate d = n1 / (n1 + 2 n2)
    (n1, n2: bigrams seen once, twice), 0.75 when no bigram is seen once.
    """

    def __init__(self, rows: Iterable[Sequence[int]], vocab_size: int) -> None:
        self.vocab_size = v = int(vocab_size)
        prev, nxt = _pairs(rows)
        if prev.size == 0:
            raise ValueError("the bigram model needs at least one bigram. Received: none")
        codes, counts = np.unique(prev * v + nxt, return_counts=True)
        first, second = codes // v, codes % v
        self._codes, self._counts = codes, counts.astype(np.float64)
        self.context_counts = np.bincount(first, weights=self._counts, minlength=v)
        self.followers = np.bincount(first, minlength=v).astype(np.float64)  # N(v .)
        self.predecessors = np.bincount(second, minlength=v).astype(np.float64)  # N(. w)
        types = float(codes.size)  # N(. .)
        n1, n2 = int((counts == 1).sum()), int((counts == 2).sum())
        self.discount = n1 / (n1 + 2 * n2) if n1 else 0.75
        d = self.discount
        seen = float((self.predecessors > 0).sum())
        self.continuation = np.maximum(self.predecessors - d, 0) / types + d * seen / types / v

    def log_prob(self, prev: np.ndarray, nxt: np.ndarray) -> np.ndarray:
        """ln P(nxt | prev) for arrays of token ids (float64)."""
        prev, nxt = np.asarray(prev, dtype=np.int64), np.asarray(nxt, dtype=np.int64)
        code = prev * self.vocab_size + nxt
        at = np.minimum(np.searchsorted(self._codes, code), self._codes.size - 1)
        count = np.where(self._codes[at] == code, self._counts[at], 0.0)
        context = self.context_counts[prev]
        seen = context > 0
        safe = np.where(seen, context, 1.0)
        d = self.discount
        cont = self.continuation[nxt]
        p = np.where(
            seen, (np.maximum(count - d, 0) + d * self.followers[prev] * cont) / safe, cont
        )
        return np.log(p)

    def nll(self, rows: Iterable[Sequence[int]]) -> tuple[float, int]:
        """(summed negative log-likelihood in nats, tokens predicted) of every row's tokens
        after its first."""
        prev, nxt = _pairs(rows)
        return float(-self.log_prob(prev, nxt).sum()), int(prev.size)


def _pairs(rows: Iterable[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    prev: list[int] = []
    nxt: list[int] = []
    for row in rows:
        prev += row[:-1]
        nxt += row[1:]
    return np.asarray(prev, dtype=np.int64), np.asarray(nxt, dtype=np.int64)


def _unigram_nll(train: Sequence[Sequence[int]], held: Sequence[Sequence[int]], v: int):
    """Add-one unigram over the training targets: (nll, tokens) on ``held``'s targets."""
    counts = np.bincount(_pairs(train)[1], minlength=v).astype(np.float64) + 1.0
    _, nxt = _pairs(held)
    return float(-np.log(counts[nxt] / counts.sum()).sum()), int(nxt.size)


# ---------------------------------------------------------------------------------------------
# the model


def build_model(arch: str, recipe: Recipe, vocab_size: int) -> Any:
    """A freshly initialized decoder of the family ``arch`` (see ``archs``) and ``recipe``'s
    sizes: tied input and output embeddings, ``END`` (id 0) as beginning, end and padding
    token. Weights are drawn as in GPT-2: N(0, 0.02), the projections back into the residual
    stream N(0, 0.02 / sqrt(2 * layers)), biases 0."""
    from ..models import family

    if arch not in archs():
        raise ValueError(f"arch must be one of {', '.join(archs())}. Received: arch={arch!r}")
    chosen = family(arch)
    r = recipe
    config = chosen.sized(vocab_size=vocab_size, context=r.context, width=r.width,
                          layers=r.layers, heads=r.heads, kv_heads=r.kv_heads,
                          bos_token_id=0, eos_token_id=0, pad_token_id=0)  # fmt: skip
    model = chosen.model(config)
    _initialize(model, r.layers)
    return model


def _initialize(model: nn.Module, layers: int) -> None:
    residual = ("out_proj", "linear2", "down_proj")  # write into the residual stream
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(residual) else 0.02
                module.weight.normal_(0.0, std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                module.bias.zero_()


def _pad(rows: Sequence[Sequence[int]], device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """Windows -> right-padded inputs (B, L), targets (B, L) (-100 on padding) and lengths
    (B,), where L is the longest window less one."""
    lengths = torch.tensor([len(r) - 1 for r in rows])
    inputs = torch.zeros(len(rows), int(lengths.max()), dtype=torch.long)
    targets = torch.full_like(inputs, -100)
    for i, row in enumerate(rows):
        inputs[i, : len(row) - 1] = torch.tensor(row[:-1])
        targets[i, : len(row) - 1] = torch.tensor(row[1:])
    return inputs.to(device), targets.to(device), lengths.to(device)


def _token_nll(model: nn.Module, batch: tuple[Tensor, Tensor, Tensor]) -> Tensor:
    """(B, L) negative log-likelihood of every target (0 on padding)."""
    inputs, targets, lengths = batch
    logits = model(inputs, lengths=lengths).float()
    return nn.functional.cross_entropy(
        logits.transpose(1, 2), targets, ignore_index=-100, reduction="none"
    )


@torch.inference_mode()
def perplexity(
    model: nn.Module, rows: Sequence[Sequence[int]], *, batch_size: int = 64, progress: bool = False
) -> tuple[float, int]:
    """(summed negative log-likelihood in nats, tokens predicted) of ``model`` on windows
    ``rows`` (see ``examples``); the perplexity is exp(nll / tokens). Summed in float64."""
    from tqdm.auto import tqdm

    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    total = 0.0
    starts = range(0, len(order), batch_size)
    for start in tqdm(starts, desc="held-out perplexity", unit="batch", disable=not progress,
                      leave=False):  # fmt: skip
        batch = _pad([rows[i] for i in order[start : start + batch_size]], device)
        total += float(_token_nll(model, batch).double().sum())
    model.train(was_training)
    return total, _targets(rows)


def _fit(
    model: nn.Module,
    blocks: Tensor,
    config: Any,
    info: Dist,
    after_epoch: Callable[[int], None],
    steps: list[int],
) -> FitResult:
    """Train on ``blocks`` (N, context + 1) (see ``pack``): every step's loss is the mean over
    its target tokens. ``steps[0]`` counts the steps taken (the x axis of the held-out curve).
    Full blocks need no padding mask, so attention runs its plain causal path."""

    def collate(idx: Tensor) -> Tensor:
        steps[0] += 1
        return blocks[idx].to(info.device)

    def loss_fn(m: nn.Module, batch: Tensor) -> Tensor:
        logits = m(batch[:, :-1]).float()
        nll = nn.functional.cross_entropy(logits.transpose(1, 2), batch[:, 1:], reduction="none")
        return nll.mean(dim=1)  # [B]: blocks hold equally many targets

    return fit(model, len(blocks), collate, loss_fn, config, info, desc="lm",
               after_epoch=after_epoch)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# the run


def _recipe(options: LMOptions) -> Recipe:
    recipe = QUICK if options.quick else FULL
    if options.vocab_size is not None:
        recipe = replace(recipe, vocab_size=options.vocab_size)
    if not MIN_VOCAB <= recipe.vocab_size <= MAX_VOCAB:
        raise ValueError(
            f"--vocab-size must be between {MIN_VOCAB} (the 256 bytes, {END} and a few "
            f"merges) and {MAX_VOCAB}. Received: --vocab-size {recipe.vocab_size}"
        )
    return recipe


def _data(options: Options, recipe: Recipe) -> dict[str, Any]:
    texts = read_texts(options.data)
    if recipe.max_texts is not None and len(texts) > recipe.max_texts:
        keep = np.random.default_rng(SPLIT_SEED).permutation(len(texts))[: recipe.max_texts]
        texts = [texts[i] for i in sorted(keep.tolist())]
    train, held, duplicates = split_texts(texts)
    return {"texts": len(texts), "duplicates": duplicates, "train": train, "held": held}


def run(options: LMOptions, info: Dist, out: Path | None) -> dict[str, Any]:
    """Train the tokenizer and the decoder, measure the baselines, write the run into ``out``
    (None on processes other than rank 0, which write nothing; see the module docstring)."""
    started = time.perf_counter()
    recipe = _recipe(options)
    seed_everything(options.seed)
    data = _data(options, recipe)
    tokenizer = train_tokenizer(data["train"], recipe.vocab_size)
    vocab = tokenizer.get_vocab_size()
    blocks = pack(tokenizer, data["train"], recipe.context, options.seed)
    train_rows = examples(tokenizer, data["train"], recipe.context)
    held_rows = examples(tokenizer, data["held"], recipe.context)
    model = build_model(options.arch, recipe, vocab).to(info.device)
    model.tokenizer = tokenizer
    initial = perplexity(model, held_rows) if info.main else (math.nan, 1)
    curve: list[tuple[int, float]] = [(0, initial[0] / initial[1])]
    steps_done = [0]

    def after_epoch(epoch: int) -> None:
        if info.main:
            nll, count = perplexity(model, held_rows)
            curve.append((steps_done[0], nll / count))

    config = options.train_config(epochs=recipe.epochs, batch_size=recipe.batch_size,
                                  lr=recipe.lr)  # fmt: skip
    result = _fit(model, blocks, config, info, after_epoch, steps_done)
    options.adopt(result)
    if out is None:
        return {}
    model.eval()
    return _finish(options, info, started, out, model, recipe, data, train_rows, held_rows,
                   result, curve, blocks.numel() - len(blocks))  # fmt: skip


def _finish(options, info, started, out, model, recipe, data, train_rows, held_rows, result,
            curve, trained) -> dict[str, Any]:  # fmt: skip
    from ..models.folder_writing import save_pretrained

    vocab = model.vocab_size
    nll, tokens = perplexity(model, held_rows, progress=options.progress)
    bigram = KneserNeyBigram(train_rows, vocab)
    bigram_nll, _ = bigram.nll(held_rows)
    unigram_nll, _ = _unigram_nll(train_rows, held_rows, vocab)
    table = {
        "model": _scores(nll, tokens),
        "bigram_kneser_ney": _scores(bigram_nll, tokens),
        "unigram_add_one": _scores(unigram_nll, tokens),
    }
    save_pretrained(model, out)
    samples = _samples(model, data["held"], options.seed)
    (out / "samples.txt").write_text(_samples_text(samples))
    (out / "held_out.txt").write_text("".join(f"{t}\n" for t in data["held"]), encoding="utf-8")
    title = f"{options.arch} shape, {model.shape}"
    _loss_figure(result, curve, table, out / "loss_curve.png", title)
    parameters = sum(p.numel() for p in model.parameters())
    metrics = {
        "task": "lm",
        "metrics": table,
        "goal_model_beats_bigram": table["model"]["perplexity"]
        < table["bigram_kneser_ney"]["perplexity"],
        "arch": options.arch,
        "parameters": parameters,
        "tokens": {
            "train": _targets(train_rows),
            "held_out": tokens,
            "trained_per_epoch": trained,
        },
        "steps": result.steps,
        "seconds": round(result.seconds, 2),
        "precision": (
            options.precision_choice.as_json()
            if options.precision_choice is not None
            else {"requested": options.precision, "chosen": options.precision}
        ),
        "evaluation_precision": "fp32",
        "data": {
            "path": str(datasets.folder("vader") if options.data is None else options.data),
            "texts": data["texts"],
            "duplicates_dropped": data["duplicates"],
            "train_texts": len(data["train"]),
            "held_out_texts": len(data["held"]),
            "held_out_share": HELD_OUT,
            "split_seed": SPLIT_SEED,
        },
        "tokenizer": {
            "kind": "byte-level BPE",
            "vocab_size": vocab,
            "asked": recipe.vocab_size,
            "special": [END],
        },
        "recipe": asdict(recipe),
        "bigram_discount": round(bigram.discount, 6),
        "held_out_curve": [{"step": s, "loss": round(v, 6)} for s, v in curve],
        "training": result.summary(),
        "samples": samples,
        "files": [
            "config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
            "loss_curve.png",
            "samples.txt",
            "held_out.txt",
        ],
    }
    return finish(metrics, options, info, started, out)


def _scores(nll: float, tokens: int) -> dict[str, float]:
    loss = nll / tokens
    return {"perplexity": round(math.exp(loss), 4), "loss": round(loss, 6)}


@torch.inference_mode()
def _samples(model: Any, held: Sequence[str], seed: int) -> list[dict[str, str]]:
    """Four texts from nothing (the END token alone) and three continuations of the first words
    of held-out texts, sampled with ``SAMPLE_SETTINGS`` from a generator seeded by ``seed``."""
    tokenizer = model.tokenizer
    prompts = [""] * 4 + [" ".join(t.split()[:3]) for t in held[:3]]
    generator = torch.Generator(device=model.lm_head.weight.device).manual_seed(seed)
    out = []
    for prompt in prompts:
        ids = tokenizer.encode(prompt).ids
        room = min(48, model.max_positions - len(ids))
        prompt_ids = torch.tensor([ids], device=model.lm_head.weight.device)
        new = model.generate(prompt_ids, room, do_sample=True, generator=generator,
                             eos_token_id=0, **SAMPLE_SETTINGS)[0, len(ids):].tolist()  # fmt: skip
        new = new[: new.index(0)] if 0 in new else new
        out.append({"prompt": prompt, "text": tokenizer.decode(new, skip_special_tokens=True)})
    return out


def _samples_text(samples: list[dict[str, str]]) -> str:
    settings = ", ".join(f"{k}={v}" for k, v in SAMPLE_SETTINGS.items())
    lines = [f"# sampled with {settings}; prompt in [brackets], empty = from nothing", ""]
    lines += [f"[{s['prompt']}]{s['text']}" for s in samples]
    return "\n".join(lines) + "\n"


def _loss_figure(result: FitResult, curve: list[tuple[int, float]], table: dict[str, Any],
                 path: Path, title: str) -> Path:  # fmt: skip
    """Training loss after every step (and its running mean), held-out loss before training and
    after every epoch, and the bigram baseline's held-out loss, in nats per token."""
    fig = figure(figsize=(6.4, 3.6))
    ax = fig.subplots()
    steps = np.arange(1, len(result.losses) + 1)
    ax.plot(steps, result.losses, lw=0.6, color="tab:blue", alpha=0.35, label="train (step)")
    window = max(1, len(steps) // 30)
    if window > 1:
        smooth = np.convolve(result.losses, np.ones(window) / window, mode="valid")
        ax.plot(steps[window - 1 :], smooth, color="tab:blue", label=f"train (mean of {window})")
    x, y = zip(*curve)
    ax.plot(x, y, "o-", color="tab:orange", label="held out")
    bigram = table["bigram_kneser_ney"]["loss"]
    ax.axhline(bigram, color="tab:gray", ls="--", lw=1, label="bigram (Kneser-Ney), held out")
    ax.set_yscale("log")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats per token)")
    ax.set_title(f"lm: {title}", fontsize=9)
    ax.legend(fontsize=7)
    return save_figure(fig, path)
