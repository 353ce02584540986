"""``multihead bench serve``: a load test of ``multihead serve`` against a plain baseline.

Both servers run as their own processes on 127.0.0.1 (free ports): ours is ``multihead serve``
exactly as a user starts it; the baseline is a FastAPI handler that calls sentence-transformers'
``encode`` on each request, on the same uvicorn, with the same torch thread count. The same
closed-loop load (1, 8 and 32 concurrent clients, each sending one text per request until a
fixed number of requests is done) goes to both, in alternating order; every level stops by
itself after ``requests`` requests or ``level_timeout_s`` seconds. Reports throughput, p50/p99
latency, errors, and the largest difference between the two servers' embeddings.

``python -m multihead.bench.serve --port 0`` runs the baseline server alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .. import _validation as V
from .._extras import require
from .._flags import option
from .._progress import Stages
from .options import Results
from .texts import sentences

__all__ = [
    "BASELINE",
    "OURS",
    "ServeBenchOptions",
    "baseline_app",
    "command",
    "drive",
    "run_serve_bench",
]

OURS, BASELINE = "multihead serve", "FastAPI + sentence-transformers encode"
GOAL = 2.0  # throughput over the baseline at the largest client count
_TOLERANCE = 1e-5  # embeddings of the two servers (both fp32 of the same weights)
_START_TIMEOUT_S = 120
_WARM_UP = 8  # untimed requests per server before the first level


def baseline_app(model_path: str | Path | None = None) -> Any:
    """The baseline: POST /embed (TEI's request and response) -> ``SentenceTransformer.encode``
    per request. A plain ``def`` handler, which FastAPI runs on its thread pool."""
    fastapi = require("fastapi", "serve", "the baseline server of bench serve")
    from sentence_transformers import SentenceTransformer

    from ..models.bert import default_path

    model = SentenceTransformer(str(model_path or default_path()), device="cpu")
    app = fastapi.FastAPI()

    @app.post("/embed")
    def embed(body: dict) -> list:
        inputs = body["inputs"]
        texts = [inputs] if isinstance(inputs, str) else inputs
        normalize = body.get("normalize", True)
        return model.encode(texts, normalize_embeddings=normalize).tolist()

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok"}

    return app


async def drive(
    url: str,
    texts: Sequence[str],
    *,
    clients: int,
    requests: int,
    timeout_s: float = 300.0,
    keep: dict[int, list[float]] | None = None,
) -> dict[str, Any]:
    """Closed-loop load: ``clients`` tasks send POST /embed with one text each until
    ``requests`` are done or ``timeout_s`` passes. Request i sends ``texts[i % len(texts)]``.

    Returns throughput (requests/s over the wall time), latency percentiles, error count (non-200
    answers, exceptions and requests never sent before the deadline) and a few error samples.
    ``keep`` collects each text's embedding (by text index) from the first answer for it.
    """
    httpx = require("httpx", "serve", "bench serve")
    latencies: list[float] = []
    errors: list[str] = []
    answered_ok = 0
    counter = iter(range(requests))
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout_s) as client:

        async def one_client() -> None:
            nonlocal answered_ok
            for i in counter:
                if time.monotonic() > deadline:
                    errors.append("deadline passed before the request was sent")
                    continue
                text = texts[i % len(texts)]
                start = time.perf_counter()
                try:
                    response = await client.post("/embed", json={"inputs": text})
                except httpx.HTTPError as err:
                    errors.append(f"{type(err).__name__}: {err}")
                    continue
                latencies.append(time.perf_counter() - start)
                if response.status_code != 200:
                    errors.append(f"{response.status_code}: {response.text[:200]}")
                    continue
                answered_ok += 1
                if keep is not None and i % len(texts) not in keep:
                    keep[i % len(texts)] = response.json()[0]

        start = time.perf_counter()
        await asyncio.gather(*(one_client() for _ in range(clients)))
        wall = time.perf_counter() - start
    ms = sorted(1000 * t for t in latencies) or [float("nan")]
    return {
        "clients": clients,
        "requests": requests,
        "answered": len(latencies),
        "errors": len(errors),
        "error_samples": errors[:3],
        "wall_s": wall,
        "requests_per_s": answered_ok / wall,
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
        "mean_ms": statistics.fmean(ms),
    }


class _Process:
    """A server subprocess that prints 'http://HOST:PORT' on a line of its stdout when ready."""

    def __init__(self, name: str, command: list[str], log: Path) -> None:
        self.name, self.log = name, log
        self._log_file = log.open("w")
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=self._log_file, text=True
        )
        self.url = ""

    def wait_for_url(self) -> str:
        """Block until the server prints its URL (or raise with its log when it does not)."""
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            line = self.process.stdout.readline()
            if not line and self.process.poll() is not None:
                break
            for word in line.split():
                if word.startswith("http://"):
                    self.url = word
                    return word
        self.stop()
        tail = self.log.read_text()[-2000:]
        raise RuntimeError(f"{self.name} did not start. Received: {tail}")

    def cpu_seconds(self) -> float | None:
        """User + system CPU time the server process has used (Linux /proc), or None."""
        try:
            fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()  # SIGTERM: uvicorn finishes what is in flight
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process.stdout.close()
        self._log_file.close()


def _max_diff(a: dict[int, list[float]], b: dict[int, list[float]]) -> float:
    shared = sorted(set(a) & set(b))
    if not shared:
        return float("inf")
    return float(np.abs(np.array([a[i] for i in shared]) - np.array([b[i] for i in shared])).max())


def _check_sizes(requests: int, clients: Sequence[int], threads: int | None) -> None:
    require("httpx", "serve", "bench serve")
    require("fastapi", "serve", "bench serve")
    if isinstance(requests, bool) or not isinstance(requests, int) or requests < 1:
        raise ValueError(f"requests must be a positive int. Received: requests={requests!r}")
    if not clients or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in clients):
        raise ValueError(f"clients must be positive ints. Received: clients={list(clients)!r}")
    if threads is not None and (
        isinstance(threads, bool) or not isinstance(threads, int) or threads < 1
    ):
        raise ValueError(f"threads must be a positive int. Received: threads={threads!r}")


def _level(
    server: _Process,
    texts: list[str],
    count: int,
    requests: int,
    timeout_s: float,
    keep: dict[int, list[float]],
) -> dict[str, Any]:
    """Drive ``server`` with ``count`` clients; the row adds the server's CPU time per
    answered request."""
    cpu = server.cpu_seconds()
    row = asyncio.run(
        drive(server.url, texts, clients=count, requests=requests, timeout_s=timeout_s, keep=keep)
    )
    used = server.cpu_seconds()
    # CPU time per answered request: how much work each server spends, which a busy machine
    # disturbs far less than it disturbs throughput
    row["server_cpu_ms_per_request"] = (
        None
        if cpu is None or used is None or not row["answered"]
        else 1000 * (used - cpu) / row["answered"]
    )
    return row


def _row_line(name: str, count: int, row: dict[str, Any]) -> str:
    cpu = row["server_cpu_ms_per_request"]
    return (
        f"  {name:40} {count:3} clients: {row['requests_per_s']:7.1f} req/s, "
        f"p50 {row['p50_ms']:7.1f} ms, p99 {row['p99_ms']:7.1f} ms, {row['errors']} errors"
        + ("" if cpu is None else f", server CPU {cpu:.1f} ms/request")
    )


def _report(
    results: dict[str, list[dict[str, Any]]],
    vectors: dict[str, dict[int, list[float]]],
    clients: Sequence[int],
    requests: int,
    threads: int | None,
    texts: int,
) -> dict[str, Any]:
    """serve.json: every level's rows, the speedups, the goal and the embeddings' agreement."""
    diff = _max_diff(vectors[OURS], vectors[BASELINE])
    speedups = [
        a["requests_per_s"] / b["requests_per_s"] if b["requests_per_s"] else float("inf")
        for a, b in zip(results[OURS], results[BASELINE])
    ]
    errors = sum(r["errors"] for rows in results.values() for r in rows)
    report = {
        "command": f"multihead bench serve --requests {requests} --clients "
        + " ".join(map(str, clients))
        + ("" if threads is None else f" --threads {threads}"),
        "threads": threads,
        "cpus": os.cpu_count(),
        "texts": texts,
        "results": results,
        "speedup": dict(zip(map(str, clients), speedups)),
        "goal": f">= {GOAL}x at {max(clients)} clients",
        "goal_met": speedups[list(clients).index(max(clients))] >= GOAL,
        "max_abs_diff": diff,
        "errors": errors,
        "ok": errors == 0 and diff <= _TOLERANCE,
    }
    return report


@dataclass(frozen=True, kw_only=True)
class ServeBenchOptions(Results):
    """What ``multihead bench serve`` takes (``multihead bench serve --help``)."""

    requests: int = option(512, "requests per client count and server")
    clients: tuple[int, ...] = option((1, 8, 32), "concurrent client counts")
    threads: int | None = option(None, "torch threads in each server (default: all, one per core)")
    model: Path | None = option(
        None, "BERT-family model folder (default: all-MiniLM-L6-v2)", metavar="PATH"
    )


def command(options: ServeBenchOptions) -> int:
    """``multihead bench serve``: the exit status is 0 when ``run_serve_bench`` found no
    failed request and the embeddings agree, else 1."""
    return 0 if run_serve_bench(options)["ok"] else 1


def run_serve_bench(
    options: ServeBenchOptions,
    *,
    level_timeout_s: float = 300.0,
    texts: Sequence[str] | None = None,
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Start both servers, drive each client count at both, write serve.json and serve.png.

    Args:
        options: the requests per client count and server, the client counts, the torch
            threads of each server, the model and the output folder.
        texts: what the clients send (default: 512 generated sentences of 3 to 60 words).
        level_timeout_s: each level stops sending after this long (then counts errors).

    Returns the report; ``report["ok"]`` is True when no request failed and the embeddings
    agree to 1e-5 (the speed goal is reported, not enforced).
    """
    requests, clients, threads = options.requests, options.clients, options.threads
    model_path = options.model
    _check_sizes(requests, clients, threads)
    texts = list(texts) if texts is not None else sentences(512, min_words=3, max_words=60)
    out = V.check_out_dir("--out", options.out)
    out.mkdir(exist_ok=True)
    common = [] if threads is None else ["--threads", str(threads)]
    model = [] if model_path is None else ["--model", str(model_path)]
    env_python = [sys.executable, "-m"]
    commands = {
        OURS: [*env_python, "multihead.cli", "serve", "--port", "0", *model, *common],
        BASELINE: [*env_python, "multihead.bench.serve", "--port", "0", *model, *common],
    }
    servers: dict[str, _Process] = {}
    results: dict[str, list[dict[str, Any]]] = {OURS: [], BASELINE: []}
    vectors: dict[str, dict[int, list[float]]] = {OURS: {}, BASELINE: {}}
    steps = ["starting the servers", "warm-up", *(f"{c} clients" for c in clients)]
    progress = Stages("bench serve", steps, "level")
    tell = progress.say if say is print else say
    with tempfile.TemporaryDirectory(prefix="multihead-bench-serve-") as logs:
        try:
            progress.begin(steps[0])
            tell(f"starting {OURS} and {BASELINE} ...")
            for name, command in commands.items():  # both load at once
                servers[name] = _Process(name, command, Path(logs) / f"{len(servers)}.log")
            for server in servers.values():
                server.wait_for_url()
            names = list(commands)
            progress.begin(steps[1])
            for name in names:  # first-call costs (thread pools, allocator) out of the timings
                asyncio.run(drive(servers[name].url, texts, clients=4, requests=_WARM_UP))
            for level, count in enumerate(clients):
                progress.begin(steps[2 + level])
                order = names[level % 2 :] + names[: level % 2]  # alternate who goes first
                for name in order:
                    row = _level(servers[name], texts, count, requests, level_timeout_s,
                                 vectors[name])  # fmt: skip
                    results[name].append(row)
                    tell(_row_line(name, count, row))
        finally:
            progress.close()
            for server in servers.values():
                server.stop()
    report = _report(results, vectors, clients, requests, threads, len(texts))
    speedups = [report["speedup"][str(c)] for c in clients]
    diff, errors = report["max_abs_diff"], report["errors"]
    for count, ratio in zip(clients, speedups):
        say(f"  {count:3} clients: {ratio:.2f}x the baseline's throughput")
    say(f"  max |difference| of embeddings {diff:.1e}; {errors} errors")
    (out / "serve.json").write_text(json.dumps(report, indent=2))
    _chart(report, clients, out / "serve.png")
    return report


def _chart(report: dict[str, Any], clients: Sequence[int], path: Path) -> Path | None:
    """Throughput and p99 latency against client count, both servers."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for name, rows in report["results"].items():
        left.plot(clients, [r["requests_per_s"] for r in rows], marker="o", label=name)
        right.plot(clients, [r["p99_ms"] for r in rows], marker="o", label=name)
    left.set(xlabel="concurrent clients", ylabel="requests / s", title="throughput")
    right.set(xlabel="concurrent clients", ylabel="ms", title="p99 latency", yscale="log")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(clients), [str(c) for c in clients])
        ax.legend(fontsize=8)
    fig.suptitle(f"multihead bench serve ({report['threads'] or 'default'} threads)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _main(argv: list[str] | None = None) -> int:
    """The baseline server as a process: prints its URL, serves until SIGTERM."""
    parser = argparse.ArgumentParser(prog="python -m multihead.bench.serve", description=__doc__)
    parser.add_argument("--model", metavar="PATH")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    import torch

    from ..serve.server import bind, uvicorn_server

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    sock = bind(args.host, args.port)
    server = uvicorn_server(baseline_app(args.model))
    print(f"baseline listening on http://{args.host}:{sock.getsockname()[1]}", flush=True)
    server.run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(_main())
