"""Training throughput of each application's model on its real data, without the evaluation
and baselines of a full run: ``python -m multihead.apps.throughput TASK [--precision bf16]
[--compile] [--steps N]``, also under ``torchrun --nproc-per-node N``. Prints one JSON line
(rank 0) with samples/s measured after the first two steps (which pay for compilation)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .common import Options
from .loop import setup, teardown

__all__ = ["main"]


def _sentiment(options: Options, info: Any, steps: int) -> dict[str, Any]:
    from ..models import bert
    from . import sentiment as s

    corpora = s.read_corpora(options.data)
    pretrained = bert.load()
    texts = [c.texts[i] for c in corpora for i in s.split(c, options.seed)[0]]
    ratings = np.concatenate([c.ratings[s.split(c, options.seed)[0]] for c in corpora])
    count = min(len(texts), 32 * (steps + 2) * 4)  # enough texts for the batches, few to encode
    ids = s.encode(pretrained.tokenizer, texts[:count], 128)
    model = s.SentimentRegressor(pretrained.model, alphas=s.STRETCHES)
    config = options.train_config(epochs=1, batch_size=32, lr=5e-5)
    targets = np.stack([s.stretch(ratings[:count], a) for a in s.STRETCHES], axis=1)
    result = s._train(model, ids, targets, config, info, "MiniLM")
    return result.summary()


def _forecast(options: Options, info: Any, steps: int) -> dict[str, Any]:
    from . import forecast as f

    return f._train_one(f.load_series("co2"), options, info)[1].summary()


def _crossmodal(options: Options, info: Any, steps: int) -> dict[str, Any]:
    from sklearn.datasets import load_digits

    from . import crossmodal as c
    from .loop import fit

    digits = load_digits()
    qs = c.make_questions(digits.target, 8, options.seed)
    ids, lengths = c.tokenize(qs.words)
    image = c.patches(digits.images)[qs.image]
    answers = torch.as_tensor(qs.answer, dtype=torch.float32)

    def collate(idx):
        return tuple(t[idx].to(info.device) for t in (ids, lengths, image, answers))

    def loss_fn(m, batch):
        x, n, img, y = batch
        logits = m(x, n, img).float()
        return torch.nn.functional.binary_cross_entropy_with_logits(logits, y, reduction="none")

    config = options.train_config(epochs=1, batch_size=64, lr=2e-3)
    return fit(c.CrossModalQA(), len(answers), collate, loss_fn, config, info).summary()


_TASKS = {"sentiment": _sentiment, "forecast": _forecast, "crossmodal": _crossmodal}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m multihead.apps.throughput")
    parser.add_argument("task", choices=sorted(_TASKS))
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps (default 20)")
    parser.add_argument("--data", help="sentiment data folder (as for multihead train)")
    args = parser.parse_args(argv)
    options = Options(
        out=Path("."),
        data=args.data,
        precision=args.precision,
        compile=args.compile,
        max_steps=args.steps,
        progress=False,
    )
    info = setup()
    try:
        summary = _TASKS[args.task](options, info, args.steps)
    finally:
        teardown(info)
    if info.main:
        keep = ("steps", "samples", "samples_per_s", "first_step_s", "train_seconds")
        row = {"task": args.task, "precision": args.precision, "compile": args.compile,
               "processes": info.world, "threads": torch.get_num_threads(),
               **{k: summary[k] for k in keep}}  # fmt: skip
        if "compile" in summary:
            row["graph_breaks"] = summary["compile"]
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
