"""The HTTP API: TEI and OpenAI embeddings, attention weights, the head view, health, metrics.

Every client mistake gets a 4xx with a JSON body naming the problem (TEI's shape
``{"error": ..., "error_type": ...}``; OpenAI's ``{"error": {"message": ..., "type": ...}}``
under ``/v1/``): 413 body too large, 422 bad JSON, wrong types, empty or too many inputs, a
text too long with ``truncate: false``, 429 too many requests at once, 404/405 unknown routes.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._extras import require
from .batcher import MicroBatcher
from .engine import Engine, TooLong
from .metrics import Metrics

__all__ = ["ClientError", "Limits", "create_app"]

# how much of a too-large body is read and dropped before the 413 (see _Guard._read)
_DRAIN_FACTOR = 8
ROUTES = ("/embed", "/v1/embeddings", "/attention", "/view", "/health", "/info", "/metrics")


@dataclass(frozen=True)
class Limits:
    """What one server accepts (defaults as in text-embeddings-inference where it has one).

    max_batch_tokens: most tokens in one model batch (TEI: 16384).
    max_wait_ms: how long a request may wait for others to share its batch.
    max_client_batch_size: most texts in one request (TEI: 32).
    max_concurrent_requests: requests admitted at once; more get 429 (TEI: 512).
    payload_limit: most bytes in a request body; more get 413 (TEI: 2 MB).
    """

    max_batch_tokens: int = 16384
    max_wait_ms: float = 2.0
    max_client_batch_size: int = 32
    max_concurrent_requests: int = 512
    payload_limit: int = 2_000_000

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


class ClientError(Exception):
    """A request the server refuses: status, message and TEI's error type."""

    def __init__(self, status: int, message: str, kind: str = "Validation") -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def _error_body(path: str, status: int, message: str, kind: str) -> dict[str, Any]:
    if path.startswith("/v1/"):  # what OpenAI clients parse
        return {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return {"error": message, "error_type": kind}


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _parse_object(body: bytes) -> dict[str, Any]:
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as err:  # UnicodeDecodeError is a ValueError
        raise ClientError(
            422, f"the body must be JSON (UTF-8). Received: {len(body)} bytes that do not parse"
        ) from err
    if not isinstance(data, dict):
        raise ClientError(422, f"the body must be a JSON object. Received: {type(data).__name__}")
    return data


def _flag(data: dict[str, Any], name: str, default: bool) -> bool:
    value = data.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ClientError(422, f'"{name}" must be true or false. Received: {_short(value)}')
    return value


def _texts(data: dict[str, Any], field: str, limit: int, *, single: bool = False) -> list[str]:
    if field not in data:
        raise ClientError(422, f'the body must have "{field}". Received: keys {sorted(data)}')
    value = data[field]
    if isinstance(value, str):
        texts = [value]
    elif isinstance(value, list) and not single:
        texts = value
    else:
        wanted = "a string" if single else "a string or a list of strings"
        raise ClientError(422, f'"{field}" must be {wanted}. Received: {type(value).__name__}')
    if not texts:
        raise ClientError(422, f'"{field}" must not be an empty list. Received: []')
    if len(texts) > limit:
        raise ClientError(
            422,
            f'"{field}" holds {len(texts)} texts but at most {limit} are allowed per request '
            f"(max_client_batch_size); split the request. Received: {len(texts)} texts",
        )
    for i, text in enumerate(texts):
        where = field if single else f"{field}[{i}]"
        if not isinstance(text, str):
            raise ClientError(422, f'"{where}" must be a string. Received: {type(text).__name__}')
        if not text.strip():
            raise ClientError(422, f'"{where}" is empty; send some text. Received: {text!r}')
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:  # a lone surrogate escape such as "\ud800"
            raise ClientError(
                422, f'"{where}" is not valid Unicode text. Received: {_short(text)}'
            ) from err
    return texts


def _indices(data: dict[str, Any], field: str, count: int) -> list[int]:
    value = data.get(field)
    if value is None:
        return list(range(count))
    if (
        not isinstance(value, list)
        or not value
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        raise ClientError(
            422, f'"{field}" must be a non-empty list of integers. Received: {_short(value)}'
        )
    bad = [v for v in value if not 0 <= v < count]
    if bad:
        raise ClientError(
            422, f'"{field}" must be in [0, {count}). Received: {_short(bad)} out of range'
        )
    return value


def create_app(engine: Engine, limits: Limits | None = None) -> Any:
    """The ASGI app (Starlette) serving ``engine``; run it with uvicorn (see ``serve.run``).

    The model runs on one worker thread; tokenization on Starlette's thread pool; the event
    loop only parses, batches and answers.
    """
    require("starlette", "serve", "multihead serve")
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.responses import HTMLResponse, JSONResponse, Response
    from starlette.routing import Route

    limits = limits or Limits()
    metrics = Metrics()
    model_thread = ThreadPoolExecutor(1, thread_name_prefix="multihead-model")
    batcher = MicroBatcher(
        engine.embed,
        model_thread,
        max_batch_tokens=limits.max_batch_tokens,
        max_wait_ms=limits.max_wait_ms,
        on_batch=metrics.batch,
    )
    state = {"in_flight": 0}

    @asynccontextmanager
    async def lifespan(app: Any):
        batcher.start()
        try:
            yield
        finally:  # uvicorn has let the requests in flight finish before this runs
            await batcher.stop()
            model_thread.shutdown(wait=True)

    def error(request: Request, status: int, message: str, kind: str) -> JSONResponse:
        headers = {"Retry-After": "1"} if status == 429 else None
        body = _error_body(request.url.path, status, message, kind)
        return JSONResponse(body, status_code=status, headers=headers)

    async def client_error(request: Request, err: ClientError) -> JSONResponse:
        return error(request, err.status, err.message, err.kind)

    async def http_error(request: Request, err: HTTPException) -> JSONResponse:
        kinds = {404: "NotFound", 405: "MethodNotAllowed"}
        message = f"{err.detail} ({request.method} {request.url.path}); routes: {list(ROUTES)}"
        return error(request, err.status_code, message, kinds.get(err.status_code, "Validation"))

    async def admitted(call: Callable[[], Awaitable[Any]]) -> Any:
        """Run a model request if fewer than max_concurrent_requests are in flight, else 429."""
        if state["in_flight"] >= limits.max_concurrent_requests:
            raise ClientError(
                429,
                f"the server is answering its limit of {limits.max_concurrent_requests} "
                f"requests at once; retry shortly. Received: one request too many",
                "Overloaded",
            )
        state["in_flight"] += 1
        metrics.in_flight.inc()
        try:
            return await call()
        finally:
            state["in_flight"] -= 1
            metrics.in_flight.dec()

    async def tokenize(texts: list[str], truncate: bool) -> list[Any]:
        try:
            return await run_in_threadpool(engine.tokenize, texts, truncate=truncate)
        except TooLong as err:
            raise ClientError(422, str(err)) from err

    async def vectors(texts: list[str], truncate: bool, normalize: bool) -> tuple[np.ndarray, int]:
        tokens = await tokenize(texts, truncate)
        pooled = await batcher.submit([t.ids for t in tokens])
        if normalize:
            pooled = pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)
        return pooled, sum(len(t.ids) for t in tokens)

    async def embed(request: Request) -> JSONResponse:
        """TEI: {"inputs": str | [str], "normalize": true, "truncate": false} -> [[float]]."""
        data = _parse_object(await request.body())
        texts = _texts(data, "inputs", limits.max_client_batch_size)
        normalize, truncate = _flag(data, "normalize", True), _flag(data, "truncate", False)

        async def run() -> JSONResponse:
            pooled, _ = await vectors(texts, truncate, normalize)
            return JSONResponse(pooled.tolist())

        return await admitted(run)

    async def openai_embeddings(request: Request) -> JSONResponse:
        """OpenAI: {"input": str | [str], "model": ..., "encoding_format": "float"|"base64"}."""
        data = _parse_object(await request.body())
        texts = _texts(data, "input", limits.max_client_batch_size)
        model = data.get("model")
        if model is not None and not isinstance(model, str):
            raise ClientError(422, f'"model" must be a string. Received: {_short(model)}')
        encoding = data.get("encoding_format") or "float"
        if encoding not in ("float", "base64"):
            raise ClientError(
                422, f'"encoding_format" must be "float" or "base64". Received: {_short(encoding)}'
            )
        dimensions = data.get("dimensions")
        if dimensions is not None and dimensions != engine.dim:
            raise ClientError(
                422,
                f'"dimensions" can only be {engine.dim} for this model. Received: '
                f"{_short(dimensions)}",
            )

        async def run() -> JSONResponse:
            pooled, tokens = await vectors(texts, False, True)
            items = []
            for i, row in enumerate(pooled):
                value: Any = row.tolist()
                if encoding == "base64":
                    value = base64.b64encode(row.astype("<f4").tobytes()).decode("ascii")
                items.append({"object": "embedding", "embedding": value, "index": i})
            usage = {"prompt_tokens": tokens, "total_tokens": tokens}
            body = {"object": "list", "data": items, "model": engine.model_id, "usage": usage}
            return JSONResponse(body)

        return await admitted(run)

    async def weights_for(text: str) -> tuple[Any, np.ndarray]:
        (tokens,) = await tokenize([text], False)
        weights = await asyncio.get_running_loop().run_in_executor(
            model_thread, engine.attention, tokens.ids
        )
        return tokens, weights

    async def attention(request: Request) -> JSONResponse:
        """{"inputs": str, "layers": [int], "heads": [int]} -> tokens and weights, exact floats:
        weights[i][j] is the (L, L) matrix of layers[i], heads[j]."""
        data = _parse_object(await request.body())
        (text,) = _texts(data, "inputs", 1, single=True)
        layers = _indices(data, "layers", engine.layers)
        heads = _indices(data, "heads", engine.heads)

        async def run() -> JSONResponse:
            tokens, weights = await weights_for(text)
            chosen = weights[np.ix_(layers, heads)]  # [layers, heads, L, L]
            body = {
                "tokens": tokens.pieces,
                "special": tokens.special,
                "layers": layers,
                "heads": heads,
                # float32 -> float64 is exact, and JSON keeps every digit of a float64
                "weights": chosen.astype(np.float64).tolist(),
            }
            return JSONResponse(body)

        return await admitted(run)

    async def view(request: Request) -> HTMLResponse:
        """GET /view?text=...: the offline HTML head view (every layer and head) of the text."""
        query = dict(request.query_params)
        (text,) = _texts(query, "text", 1, single=True)

        async def run() -> HTMLResponse:
            import torch

            from ..viz.html import head_view

            tokens, weights = await weights_for(text)
            page = await run_in_threadpool(
                head_view,
                torch.from_numpy(weights),
                tokens.pieces,
                special=tokens.special,
                title=f"attention: {text}",
            )
            return HTMLResponse(page)

        return await admitted(run)

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    async def info(request: Request) -> JSONResponse:
        return JSONResponse(
            {
                "model_id": engine.model_id,
                "runtime": engine.runtime,
                "dim": engine.dim,
                "layers": engine.layers,
                "heads": engine.heads,
                "max_input_length": engine.max_input_length,
                **{k: getattr(limits, k) for k in Limits.__dataclass_fields__},
            }
        )

    async def prometheus(request: Request) -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    app = Starlette(
        routes=[
            Route("/embed", embed, methods=["POST"]),
            Route("/v1/embeddings", openai_embeddings, methods=["POST"]),
            Route("/attention", attention, methods=["POST"]),
            Route("/view", view, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/info", info, methods=["GET"]),
            Route("/metrics", prometheus, methods=["GET"]),
        ],
        exception_handlers={ClientError: client_error, HTTPException: http_error},
        lifespan=lifespan,
    )
    app.state.engine, app.state.limits, app.state.metrics = engine, limits, metrics
    app.state.batcher = batcher
    return _Guard(app, limits.payload_limit, metrics)


class _Guard:
    """ASGI wrapper around the app: the body size limit (413, before the app reads anything)
    and the request metrics (so refused requests are counted too)."""

    def __init__(self, app: Any, payload_limit: int, metrics: Metrics) -> None:
        self.app, self.payload_limit, self.metrics = app, payload_limit, metrics

    def __getattr__(self, name: str) -> Any:  # app.state and friends stay reachable
        return getattr(self.app, name)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        path = scope.get("path", "")
        status = {"code": 500}

        async def sending(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            body = await self._read(scope, receive)
            if body is None:
                await self._too_large(path, sending)
                return
            replayed = False

            async def replay() -> dict:
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()

            await self.app(scope, replay, sending)
        finally:
            endpoint = path if path in ROUTES else "other"
            self.metrics.observe(endpoint, status["code"], time.perf_counter() - start)

    async def _read(self, scope: dict, receive: Callable) -> bytes | None:
        """The whole body, or None once it passes the limit (declared or actual).

        A body over the limit is still read to its end (and dropped), up to ``_DRAIN_FACTOR``
        times the limit: answering while the client is still sending would reset the
        connection, and the client would see a broken pipe instead of the 413.
        """
        declared = None
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit():
                declared = int(value)
        too_large = declared is not None and declared > self.payload_limit
        chunks, size, more = [], 0, True
        while more and size <= _DRAIN_FACTOR * self.payload_limit:
            message = await receive()
            if message["type"] != "http.request":  # the client left
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            too_large = too_large or size > self.payload_limit
            if not too_large:
                chunks.append(chunk)
            more = message.get("more_body", False)
        return None if too_large else b"".join(chunks)

    async def _too_large(self, path: str, send: Callable) -> None:
        message = (
            f"the request body is larger than the limit of {self.payload_limit} bytes "
            "(payload_limit); send fewer or shorter texts. Received: a larger body"
        )
        body = json.dumps(_error_body(path, 413, message, "PayloadTooLarge")).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
