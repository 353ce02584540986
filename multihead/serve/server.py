"""Running the app: ``multihead serve`` in the foreground, or a server on a background thread
(tests and benchmarks) that stops cleanly."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._extras import require
from .._flags import option
from ..apps.embed_precision import PRECISIONS, at_precision
from .app import create_app
from .engine import Engine, OnnxRuntime
from .guard import Access, is_loopback_host
from .protocol import header_timeout_protocol
from .state import Limits

__all__ = [
    "RUNTIMES",
    "Background",
    "ServeOptions",
    "bind",
    "load_engine",
    "open_warning",
    "run",
    "uvicorn_server",
]

RUNTIMES = ("torch", "onnx")
# after the drain deadline only the batch already in the model is left to finish: uvicorn's
# own deadline (past which it cancels requests with a 500) comes this much later
LAST_BATCH_S = 60


def load_engine(
    model_path: str | Path | None = None,
    *,
    runtime: str = "torch",
    onnx_path: str | Path | None = None,
    threads: int | None = None,
    precision: str = "fp32",
    say: Callable[[str], None] = print,
) -> Engine:
    """Load the model for serving.

    Args:
        model_path: BERT-family folder (default: all-MiniLM-L6-v2 from its package).
        runtime: "torch", or "onnx" for onnxruntime on CPU.
        onnx_path: with runtime "onnx", a graph from ``multihead export onnx --weights`` of the
            same model; None exports one at start-up (about 20 s).
        threads: intra-op threads of torch and onnxruntime (None: their defaults).
        precision: with runtime "torch", the linear layers' "fp32", "bf16" or "auto" (bf16
            where an embedding pass measures faster with it, timed at start-up; see
            ``apps.embed_precision``).
    """
    import torch

    from .. import models
    from ..models import kinds

    _check(runtime, onnx_path, threads, precision)
    kinds.check_encoder_kind(model_path, "multihead serve")
    if threads is not None:
        torch.set_num_threads(threads)
    pretrained = models.load(model_path)
    kinds.check_encoder(pretrained, model_path, "multihead serve")
    if runtime == "torch":
        pretrained, choice = at_precision(pretrained, precision, say=say)
        if precision == "auto":
            say(f"multihead serve: --precision auto chose {choice.precision}: {choice.reason}")
        return Engine(pretrained)
    from ..export import OnnxBert, to_onnx

    if onnx_path is not None:
        given = OnnxRuntime(OnnxBert(onnx_path, pretrained, threads=threads))
        return Engine(pretrained, runtime=given)
    say("exporting the model to ONNX for onnxruntime (with attention weights)...")
    with tempfile.TemporaryDirectory(prefix="multihead-serve-") as folder:
        graph = to_onnx(pretrained, Path(folder) / "model.onnx", weights=True)
        onnx = OnnxBert(graph, pretrained, threads=threads)  # sessions hold the graph in memory
    return Engine(pretrained, runtime=OnnxRuntime(onnx))


def _check(runtime: str, onnx_path: str | Path | None, threads: int | None, precision: str) -> None:
    if runtime not in RUNTIMES:
        raise ValueError(f"runtime must be one of {list(RUNTIMES)}. Received: runtime={runtime!r}")
    if precision not in PRECISIONS:
        raise ValueError(
            f"precision must be one of {', '.join(PRECISIONS)}. Received: precision={precision!r}"
        )
    if precision != "fp32" and runtime != "torch":
        raise ValueError(
            "--precision applies to the torch runtime (onnxruntime runs the exported fp32 "
            f"graph). Received: runtime={runtime!r}, precision={precision!r}"
        )
    if onnx_path is not None and runtime != "onnx":
        raise ValueError(
            f"an ONNX file is only used with runtime 'onnx'. Received: runtime={runtime!r}"
        )
    if threads is not None and (
        isinstance(threads, bool) or not isinstance(threads, int) or threads < 1
    ):
        raise ValueError(f"threads must be a positive int. Received: threads={threads!r}")


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket; port 0 picks a free one (read it from ``getsockname()``)."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port must be an int in [0, 65535]. Received: port={port!r}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {err}. Received: {host}:{port}") from err
    sock.listen(2048)
    return sock


def _limits(app: Any) -> Limits:
    limits = getattr(getattr(app, "state", None), "limits", None)
    return limits if isinstance(limits, Limits) else Limits()


def uvicorn_server(app: Any) -> Any:
    """A uvicorn server for ``app``: quiet logs, the header deadline, and a graceful shutdown
    that starts the app's drain deadline (``app.state.drain``) before waiting for requests."""
    uvicorn = require("uvicorn", "serve", "multihead serve")
    limits = _limits(app)

    class Server(uvicorn.Server):
        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            drain = getattr(getattr(app, "state", None), "drain", None)
            if drain is not None:
                drain()
            await super().shutdown(sockets)

    config = uvicorn.Config(
        app,
        http=header_timeout_protocol(limits.header_timeout_s),
        log_level="warning",
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=limits.drain_timeout_s + LAST_BATCH_S,
    )
    return Server(config)


def open_warning(host: str, access: Access) -> str | None:
    """The warning for a server other machines can reach with no API key, else None."""
    if is_loopback_host(host) or access.api_key is not None:
        return None
    return (
        f"multihead serve: warning: listening on {host}, which other machines may reach, "
        "without an API key: anyone who can reach this port can use the model and its CPU. "
        "Set MULTIHEAD_API_KEY (or --api-key), or listen on 127.0.0.1."
    )


@dataclass(kw_only=True)
class ServeOptions:
    """What ``multihead serve`` takes (``multihead serve --help``): the model, where to listen,
    the ``Limits`` and the ``Access`` rules. ``access.api_key`` defaults to the environment's
    ``MULTIHEAD_API_KEY``."""

    model: Path | None = option(
        None, "BERT-family model folder (default: all-MiniLM-L6-v2)", metavar="PATH"
    )
    runtime: str = option("torch", "what runs the model", choices=RUNTIMES)
    onnx: Path | None = option(
        None,
        "with --runtime onnx: a graph from 'export onnx --weights' (default: export now)",
        metavar="FILE.onnx",
    )
    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(8080, "0 picks a free port")
    threads: int | None = option(None, "torch/onnxruntime threads (default: all)")
    precision: str = option(
        "fp32",
        "the linear layers' precision (torch runtime); bf16: weights and products in bf16, "
        "attention on the bf16 projections (norms and pooling stay fp32); auto: bf16 where an "
        "embedding pass measures faster with it on this machine (timed at start-up), else fp32",
        choices=PRECISIONS,
    )
    limits: Limits = field(default_factory=Limits)
    access: Access = field(default_factory=Access)

    def __post_init__(self) -> None:
        if self.access.api_key is None and os.environ.get("MULTIHEAD_API_KEY"):
            self.access = dataclasses.replace(self.access, api_key=os.environ["MULTIHEAD_API_KEY"])


def run(options: ServeOptions, *, say: Callable[[str], None] = print) -> None:
    """Serve until SIGINT/SIGTERM; the requests in flight then finish before it returns (those
    still queued ``limits.drain_timeout_s`` after the signal get 503).

    ``access.loopback`` is set from ``host``: only a loopback listener checks Host headers.
    """
    model_path, runtime, onnx_path = options.model, options.runtime, options.onnx
    host, port, threads, limits = options.host, options.port, options.threads, options.limits
    precision = options.precision
    access = dataclasses.replace(options.access, loopback=is_loopback_host(host))
    _check(runtime, onnx_path, threads, precision)  # before taking the port or loading anything
    sock = bind(host, port)
    try:
        warning = open_warning(host, access)
        if warning:
            print(warning, file=sys.stderr, flush=True)
        engine = load_engine(
            model_path,
            runtime=runtime,
            onnx_path=onnx_path,
            threads=threads,
            precision=precision,
            say=say,
        )
        server = uvicorn_server(create_app(engine, limits, access))
        shown = f"[{host}]" if ":" in host else host
        say(
            f"multihead serve: {engine.model_id} on {engine.runtime} ({engine.precision}), "
            f"listening on "
            f"http://{shown}:{sock.getsockname()[1]} (Ctrl-C to stop)"
        )
        with _stop_quietly():
            server.run(sockets=[sock])
    finally:
        sock.close()
    say("multihead serve: stopped")


class _Stopped(Exception):
    """SIGTERM or SIGINT, raised once uvicorn has finished its graceful shutdown."""


@contextmanager
def _stop_quietly() -> Iterator[None]:
    """uvicorn shuts down gracefully on SIGTERM/SIGINT, then raises the signal again with the
    handlers it found. Finding these, the process returns normally (exit 0) instead of
    dying from SIGTERM or printing a KeyboardInterrupt traceback."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: object) -> None:
        raise _Stopped(signum)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    except _Stopped:
        pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class Background:
    """A server on a daemon thread: ``with Background(app) as server: server.url``.

    Listens on 127.0.0.1 and a free port by default. Leaving the block asks the server to stop
    as SIGTERM would (requests in flight finish, those queued past the drain deadline get 503)
    and waits for the thread, at most uvicorn's shutdown deadline + 5 seconds.
    """

    def __init__(self, app: Any, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self._sock = bind(host, port)
        self.port = self._sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self._server = uvicorn_server(app)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )

    def __enter__(self) -> Background:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self._sock.close()
                raise RuntimeError(f"the server did not start. Received: {self.url}")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Ask the server to stop (requests in flight finish) and wait for it."""
        self._server.should_exit = True
        self._thread.join(self._server.config.timeout_graceful_shutdown + 5)
        self._sock.close()

    @property
    def stopped(self) -> bool:
        return not self._thread.is_alive()

    def __exit__(self, *exc: object) -> None:
        self.stop()
