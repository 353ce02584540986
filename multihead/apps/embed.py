"""``multihead embed``: sentence embeddings of every line of a text file, saved as .npy.

One process by default; with ``ray=True`` the lines go through Ray Data (``map_batches`` over
a pool of actors, each holding the model), on a local Ray instance or an existing cluster.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import _validation as V
from .._extras import require
from .._flags import argument, option, positive_int, required
from .embed_precision import PRECISIONS, at_precision

__all__ = ["PROGRESS_FROM", "RAY_BATCH", "EmbedOptions", "embed_on_ray", "run"]

PROGRESS_FROM = 256  # lines; shorter inputs finish too fast for a progress bar to help
# texts per Ray batch: enough to fill several packed rows, small enough to spread over actors
RAY_BATCH = 256


@dataclass(frozen=True, kw_only=True)
class EmbedOptions:
    """What ``multihead embed`` takes (``multihead embed --help``)."""

    file: Path = argument("UTF-8 text, one sentence per line", metavar="FILE")
    out: Path = required("where to save them (its folder must exist)", metavar="OUT.npy")
    model: Path | None = option(
        None, "BERT-family model folder (default: all-MiniLM-L6-v2)", metavar="PATH"
    )
    max_tokens: int = option(1536, "tokens per packed row", parse=positive_int)
    precision: str = option(
        "fp32",
        "the linear layers' precision; bf16: weights and products in bf16, attention on the "
        "bf16 projections (norms and pooling stay fp32); auto: bf16 where an embedding pass of "
        "the input's first texts measures faster with it on this machine (timed once), else fp32",
        choices=PRECISIONS,
    )
    ray: bool = option(False, "run on Ray Data: an actor pool, each with the model")
    workers: int = option(2, "Ray actors", parse=positive_int)
    ray_address: str | None = option(
        None, "an existing Ray cluster (default: start one here)", metavar="ADDR"
    )
    ray_batch_size: int = option(RAY_BATCH, "lines per Ray batch", parse=positive_int)


def run(options: EmbedOptions, *, say: Callable[[str], None] = print) -> np.ndarray:
    """Embed each line of ``options.file`` (UTF-8; an empty line embeds as empty text) into
    ``options.out``.

    With ``options.ray`` the work runs on Ray Data (see ``embed_on_ray``); the result is the
    same, row for row in input order.

    Returns the (lines, E) float32 array that was saved.
    """
    from .. import models
    from ..models import kinds

    model_path, max_tokens = options.model, options.max_tokens
    target = V.check_out_file("--out", options.out, ".npy")
    kinds.check_encoder_kind(model_path, "multihead embed")
    V.check_positive_int("max_tokens", max_tokens)
    source = Path(options.file)
    if not source.is_file():
        raise FileNotFoundError(f"no such input file. Received: {source}")
    lines = V.read_utf8_lines(source)
    if not lines:
        raise ValueError(f"the input file has no lines to embed. Received: {source}")
    if options.ray:
        array = embed_on_ray(
            lines,
            model_path=model_path,
            workers=options.workers,
            max_tokens=max_tokens,
            batch_size=options.ray_batch_size,
            address=options.ray_address,
            precision=options.precision,
        )
    else:
        model = models.load(model_path)
        kinds.check_encoder(model, model_path, "multihead embed")
        model, choice = at_precision(
            model, options.precision, texts=lines, max_tokens=max_tokens, say=_stderr
        )
        if options.precision == "auto":
            _stderr(f"multihead embed: --precision auto chose {choice.precision}: {choice.reason}")
        bar = None
        if len(lines) >= PROGRESS_FROM:
            from tqdm import tqdm

            bar = tqdm(total=len(lines), unit="line", desc="embedding", file=sys.stderr)
        try:
            progress = bar.update if bar else None
            array = model.embed(lines, max_tokens=max_tokens, progress=progress).numpy()
        finally:
            if bar is not None:
                bar.close()
    array = array.astype(np.float32)
    np.save(target, array)
    say(f"wrote {array.shape[0]} embeddings of size {array.shape[1]} to {target}")
    return array


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)


class _RayEmbedder:
    """One Ray actor: loads the model once (at ``precision``: ``auto`` is measured in each
    actor, on the CPUs Ray gave it), then embeds batch after batch."""

    def __init__(
        self, model_path: str | None, max_tokens: int, threads: int, precision: str = "fp32"
    ) -> None:
        import torch

        from .. import models

        torch.set_num_threads(threads)  # one actor per CPU Ray gave it: no oversubscription
        self.model, _ = at_precision(models.load(model_path), precision, max_tokens=max_tokens)
        self.max_tokens = max_tokens

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        texts = [str(t) for t in batch["text"]]
        vectors = self.model.embed(texts, max_tokens=self.max_tokens).numpy()
        return {"index": batch["index"], "embedding": vectors}


def embed_on_ray(
    texts: Sequence[str],
    *,
    model_path: str | Path | None = None,
    workers: int = 2,
    max_tokens: int = 1536,
    batch_size: int = RAY_BATCH,
    address: str | None = None,
    cpus_per_worker: int = 1,
    precision: str = "fp32",
) -> np.ndarray:
    """Sentence embeddings (N, E) of ``texts`` on Ray Data, in input order.

    ``map_batches`` runs over a pool of ``workers`` actors, each holding the model and using
    ``cpus_per_worker`` torch threads; each batch is embedded exactly as ``Pretrained.embed``
    does (packed rows), and rows come back with their input index.

    Args:
        precision: the linear layers' precision in every actor (``embed_precision``).
        address: an existing Ray cluster (its nodes need multihead installed); None starts a
            local instance with ``workers * cpus_per_worker`` CPUs and shuts it down after.
    """
    ray = require("ray", "ray", "multihead embed --ray")
    require("ray.data", "ray", "multihead embed --ray")
    for name, value in (
        ("workers", workers),
        ("batch_size", batch_size),
        ("cpus_per_worker", cpus_per_worker),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int. Received: {name}={value!r}")
    if precision not in PRECISIONS:  # here, not in every actor
        raise ValueError(
            f"precision must be one of {', '.join(PRECISIONS)}. Received: precision={precision!r}"
        )
    texts = list(texts)
    started = not ray.is_initialized()
    if started:
        if address is None:
            ray.init(
                num_cpus=workers * cpus_per_worker,
                include_dashboard=False,
                log_to_driver=False,
                configure_logging=False,
            )
        else:
            ray.init(address=address, log_to_driver=False)
    try:
        items = [{"index": i, "text": t} for i, t in enumerate(texts)]
        dataset = ray.data.from_items(items).map_batches(
            _RayEmbedder,
            fn_constructor_kwargs={
                "model_path": None if model_path is None else str(model_path),
                "max_tokens": max_tokens,
                "threads": cpus_per_worker,
                "precision": precision,
            },
            batch_size=batch_size,
            batch_format="numpy",
            compute=ray.data.ActorPoolStrategy(size=workers),
            num_cpus=cpus_per_worker,
        )
        index, vectors = [], []
        for batch in dataset.iter_batches(batch_size=None, batch_format="numpy"):
            index.append(batch["index"])
            vectors.append(batch["embedding"])
    finally:
        if started:
            ray.shutdown()
    result = np.empty((len(texts), vectors[0].shape[1]), dtype=np.float32)
    result[np.concatenate(index)] = np.concatenate(vectors)  # back to input order
    return result
