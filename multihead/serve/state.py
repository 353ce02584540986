"""What one server accepts and holds between requests: its ``Limits``, the ``ClientError`` its
handlers raise, and the ``ServeState`` they share (the model thread, the micro-batcher, the
count of requests admitted, the shutdown's drain deadline). No HTTP here: the handlers in
``handlers.py`` take a request and this state, so each runs without a server.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from .._flags import option
from .batcher import MicroBatcher
from .engine import Engine
from .guard import Access
from .memory import release_free_memory
from .metrics import Metrics

__all__ = ["ClientError", "Limits", "ServeState"]

# malloc_trim takes milliseconds: at most once a second, so a stream of small requests on a
# quiet machine does not pay it every time
_RELEASE_EVERY_S = 1.0


@dataclass(frozen=True)
class Limits:
    """What one server accepts (defaults as in text-embeddings-inference where it has one).

    max_batch_tokens: most tokens in one model batch (TEI: 16384).
    max_wait_ms: how long a request may wait for others to share its batch.
    max_client_batch_size: most texts in one request (TEI: 32).
    max_concurrent_requests: requests admitted at once; more get 429 (TEI: 512).
    payload_limit: most bytes in a request body; more get 413 (TEI: 2 MB).
    max_response_mb: most megabytes (10**6 bytes) in one response; a larger one (all layers
        and heads of a long text from /attention) gets 413 asking for fewer layers, heads or
        tokens. 16 MB holds every layer and head of MiniLM for up to about 100 tokens.
    header_timeout_s: a connection must send a request's whole header within this time of
        opening (or of its previous answer); else it is closed (nginx: 60 s).
    body_timeout_s: a request's whole body must arrive within this time of its header; else
        408 (nginx: 60 s between reads; 2 MB at 1 Mbit/s takes 16 s).
    drain_timeout_s: on SIGTERM, requests still waiting for the model this long after it get
        503 with Retry-After; the batch already in the model finishes.
    """

    max_batch_tokens: int = option(16384, "most tokens in one model batch")
    max_wait_ms: float = option(2.0, "how long a request waits for company")
    max_client_batch_size: int = option(32, "most texts in one request")
    max_concurrent_requests: int = option(512, "more at once get 429")
    payload_limit: int = option(2_000_000, "most bytes per body (else 413)")
    max_response_mb: float = option(
        16.0, "most MB per response, else 413 asking for fewer layers, heads or tokens"
    )
    header_timeout_s: float = option(
        10.0,
        "seconds to send a request's header, else the connection closes",
        flag="--header-timeout",
        metavar="S",
    )
    body_timeout_s: float = option(
        30.0,
        "seconds to send a request's body after its header, else 408",
        flag="--body-timeout",
        metavar="S",
    )
    drain_timeout_s: float = option(
        20.0,
        "on SIGTERM, requests still queued after S seconds get 503",
        flag="--drain-timeout",
        metavar="S",
    )

    def __post_init__(self) -> None:
        for name in ("max_batch_tokens", "max_client_batch_size", "max_concurrent_requests"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int. Received: {name}={value!r}")
        if isinstance(self.payload_limit, bool) or not isinstance(self.payload_limit, int):
            raise ValueError(f"payload_limit must be an int. Received: {self.payload_limit!r}")
        if self.payload_limit < 1:
            raise ValueError(f"payload_limit must be positive. Received: {self.payload_limit}")
        if not isinstance(self.max_wait_ms, int | float) or not 0 <= self.max_wait_ms <= 10_000:
            raise ValueError(
                f"max_wait_ms must be a number in [0, 10000]. Received: {self.max_wait_ms!r}"
            )
        for name in ("max_response_mb", "header_timeout_s", "body_timeout_s", "drain_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(
                    f"{name} must be a positive number. Received: {name}={value!r}"
                )  # `not value > 0` also refuses NaN

    @property
    def max_response_bytes(self) -> int:
        return int(self.max_response_mb * 1_000_000)


class ClientError(Exception):
    """A request the server refuses: status, message and TEI's error type."""

    def __init__(self, status: int, message: str, kind: str = "Validation") -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


class ServeState:
    """The state the handlers of one app share (stored as ``app.state.serve``).

    The model runs on one worker thread (``model_thread``): embeddings through the
    ``batcher``, attention weights through ``on_model_thread``. ``admitted`` bounds the
    requests in flight; ``drain`` starts the shutdown's deadline, after which whatever still
    waits for the model gets 503. ``start`` and ``stop`` run in the app's lifespan.
    """

    def __init__(self, engine: Engine, limits: Limits, access: Access) -> None:
        self.engine, self.limits, self.access = engine, limits, access
        self.metrics = Metrics()
        self.model_thread = ThreadPoolExecutor(1, thread_name_prefix="multihead-model")
        self.batcher = MicroBatcher(
            self._then_release(engine.embed),
            self.model_thread,
            max_batch_tokens=limits.max_batch_tokens,
            max_wait_ms=limits.max_wait_ms,
            on_batch=self.metrics.batch,
        )
        self.in_flight = 0
        self.expired = False  # past the drain deadline
        self._drain: asyncio.Task | None = None
        self._released = 0.0

    def _then_release(self, call: Callable[..., Any]) -> Callable[..., Any]:
        """``call`` on the model thread, then the heap's free pages back to the OS if no
        request waits for the model (see memory.py: without it the RSS creeps up)."""

        def run(*args: Any) -> Any:
            try:
                return call(*args)
            finally:
                now = time.monotonic()
                if not self.batcher.queued and now - self._released >= _RELEASE_EVERY_S:
                    self._released = now
                    release_free_memory()

        return run

    def start(self) -> None:
        self.batcher.start()

    async def stop(self) -> None:
        """After uvicorn has let the requests in flight finish: the batcher and the model
        thread end."""
        if self._drain is not None:
            self._drain.cancel()
        await self.batcher.stop()
        self.model_thread.shutdown(wait=True)

    def unavailable(self) -> ClientError:
        return ClientError(
            503,
            f"the server is shutting down and this request was still waiting for the model "
            f"{self.limits.drain_timeout_s:g} s after (drain_timeout_s); retry, another replica "
            "or the restarted server will answer. Received: a request in the queue",
            "Unavailable",
        )

    def drain(self) -> None:
        """Shutdown began: after drain_timeout_s, whatever still waits for the model gets 503."""
        if self._drain is not None:
            return

        async def expire() -> None:
            await asyncio.sleep(self.limits.drain_timeout_s)
            self.expired = True
            self.batcher.expire(self.unavailable)

        self._drain = asyncio.get_running_loop().create_task(expire())

    async def admitted(self, call: Callable[[], Awaitable[Any]]) -> Any:
        """Run a model request if fewer than max_concurrent_requests are in flight, else 429."""
        if self.expired:
            raise self.unavailable()
        if self.in_flight >= self.limits.max_concurrent_requests:
            raise ClientError(
                429,
                f"the server is answering its limit of {self.limits.max_concurrent_requests} "
                f"requests at once; retry shortly. Received: one request too many",
                "Overloaded",
            )
        self.in_flight += 1
        self.metrics.in_flight.inc()
        try:
            return await call()
        finally:
            self.in_flight -= 1
            self.metrics.in_flight.dec()

    async def on_model_thread(self, call: Callable[..., Any], *args: Any) -> Any:
        """``call(*args)`` on the model thread (after the batches queued before it)."""

        def guarded() -> Any:  # queued past the drain deadline: not worth the model's time
            if self.expired:
                raise self.unavailable()
            return call(*args)

        run = self._then_release(guarded)
        return await asyncio.get_running_loop().run_in_executor(self.model_thread, run)
