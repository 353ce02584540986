"""The HTTP API: TEI and OpenAI embeddings, attention weights, the head view, health, metrics.

Every client mistake gets a 4xx with a JSON body naming the problem (TEI's shape
``{"error": ..., "error_type": ...}``; OpenAI's ``{"error": {"message": ..., "type": ...}}``
under ``/v1/``): 413 body or response too large, 422 bad JSON, wrong types, empty or too many
inputs, duplicate layers or heads, a text too long with ``truncate: false``, 429 too many
requests at once, 404/405 unknown routes; the checks before the handlers (Host, API key,
content type, body deadline) are in ``guard.py``. Responses are serialized off the event loop.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
import unicodedata
from collections import Counter
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._extras import require
from .batcher import MicroBatcher
from .engine import Engine, TooLong
from .guard import ROUTES, Access, Guard, error_body
from .memory import release_free_memory
from .metrics import Metrics

__all__ = ["ClientError", "Limits", "create_app"]

# characters that leave a text as empty as whitespace does: controls (NUL), format characters
# (zero-width space and joiners, BOM) and separators; the tokenizer drops them all
_INVISIBLE = frozenset(("Cc", "Cf", "Zs", "Zl", "Zp"))
# malloc_trim takes 0.3 to 15 ms (measured): at most once a second, so a stream of small
# requests on a quiet machine does not pay it every time
_RELEASE_EVERY_S = 1.0
# the shortest a JSON number of the weights can be ("0.0" and its comma): with it a request
# whose answer cannot fit the response limit is refused before the model runs
_MIN_NUMBER_BYTES = 4


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

    max_batch_tokens: int = 16384
    max_wait_ms: float = 2.0
    max_client_batch_size: int = 32
    max_concurrent_requests: int = 512
    payload_limit: int = 2_000_000
    max_response_mb: float = 16.0
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    drain_timeout_s: float = 20.0

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
        if _blank(text):
            raise ClientError(
                422, f'"{where}" is empty; send some visible text. Received: {_short(text)}'
            )
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:  # a lone surrogate escape such as "\ud800"
            raise ClientError(
                422, f'"{where}" is not valid Unicode text. Received: {_short(text)}'
            ) from err
    return texts


def _blank(text: str) -> bool:
    """No visible character: whitespace, NUL and other controls, zero-width characters."""
    # each distinct character once: 2 MB of NUL, char by char, held the event loop for 1 s
    return all(c.isspace() or unicodedata.category(c) in _INVISIBLE for c in set(text))


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
    if len(set(value)) != len(value):  # each copy would repeat an L x L matrix in the answer
        twice = sorted(v for v, n in Counter(value).items() if n > 1)
        raise ClientError(
            422, f'"{field}" must not repeat an index. Received: {_short(twice)} more than once'
        )
    return value


def _dumps(value: Any) -> bytes:
    """JSON as Starlette's JSONResponse writes it (compact, UTF-8, no NaN)."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def _attention_json(head: dict[str, Any], weights: np.ndarray, limit: int) -> bytes | None:
    """``head`` plus ``"weights"`` (layers, heads, L, L) as JSON, one matrix at a time; None as
    soon as the text passes ``limit`` bytes, so a refused answer never exists whole.

    float32 -> float64 is exact, and JSON keeps every digit of a float64.
    """
    parts = [_dumps(head)[:-1], b',"weights":[']
    size = len(parts[0]) + len(parts[1])
    for i, layer in enumerate(weights):
        for j, matrix in enumerate(layer):
            opening = (b"," if i else b"") + b"[" if j == 0 else b","
            parts += [opening, _dumps(matrix.astype(np.float64).tolist())]
            size += len(parts[-2]) + len(parts[-1])
            if size + len(b"]]}") > limit:  # the closing brackets still to come
                return None
        parts.append(b"]")
        size += 1
    parts.append(b"]}")
    return b"".join(parts)


def create_app(engine: Engine, limits: Limits | None = None, access: Access | None = None) -> Any:
    """The ASGI app (Starlette) serving ``engine``; run it with uvicorn (see ``serve.run``).

    The model runs on one worker thread; tokenization and JSON on Starlette's thread pool; the
    event loop only checks, batches and answers. ``access`` (default: loopback Host names
    only, no API key, no CORS) is enforced by the ``Guard`` around the app. ``app.drain()``
    starts the shutdown's drain deadline (``serve.server`` calls it on SIGTERM).
    """
    require("starlette", "serve", "multihead serve")
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.responses import HTMLResponse, JSONResponse, Response
    from starlette.routing import Route

    limits = limits or Limits()
    access = access or Access()
    metrics = Metrics()
    model_thread = ThreadPoolExecutor(1, thread_name_prefix="multihead-model")

    def then_release(call: Callable[..., Any]) -> Callable[..., Any]:
        """``call`` on the model thread, then the heap's free pages back to the OS if no
        request waits for the model (see memory.py: without it the RSS creeps up)."""

        def run(*args: Any) -> Any:
            try:
                return call(*args)
            finally:
                now = time.monotonic()
                if not batcher.queued and now - state["released"] >= _RELEASE_EVERY_S:
                    state["released"] = now
                    release_free_memory()

        return run

    batcher = MicroBatcher(
        then_release(engine.embed),
        model_thread,
        max_batch_tokens=limits.max_batch_tokens,
        max_wait_ms=limits.max_wait_ms,
        on_batch=metrics.batch,
    )
    state: dict[str, Any] = {"in_flight": 0, "expired": False, "drain": None, "released": 0.0}

    def unavailable() -> ClientError:
        return ClientError(
            503,
            f"the server is shutting down and this request was still waiting for the model "
            f"{limits.drain_timeout_s:g} s after (drain_timeout_s); retry, another replica or "
            "the restarted server will answer. Received: a request in the queue",
            "Unavailable",
        )

    def drain() -> None:
        """Shutdown began: after drain_timeout_s, whatever still waits for the model gets 503."""
        if state["drain"] is not None:
            return

        async def expire() -> None:
            await asyncio.sleep(limits.drain_timeout_s)
            state["expired"] = True
            batcher.expire(unavailable)

        state["drain"] = asyncio.get_running_loop().create_task(expire())

    @asynccontextmanager
    async def lifespan(app: Any):
        batcher.start()
        try:
            yield
        finally:  # uvicorn has let the requests in flight finish before this runs
            if state["drain"] is not None:
                state["drain"].cancel()
            await batcher.stop()
            model_thread.shutdown(wait=True)

    def error(request: Request, status: int, message: str, kind: str) -> JSONResponse:
        headers = {"Retry-After": "1"} if status in (429, 503) else None
        body = error_body(request.url.path, status, message, kind)
        return JSONResponse(body, status_code=status, headers=headers)

    async def client_error(request: Request, err: ClientError) -> JSONResponse:
        return error(request, err.status, err.message, err.kind)

    async def http_error(request: Request, err: HTTPException) -> JSONResponse:
        kinds = {404: "NotFound", 405: "MethodNotAllowed"}
        message = f"{err.detail} ({request.method} {request.url.path}); routes: {list(ROUTES)}"
        return error(request, err.status_code, message, kinds.get(err.status_code, "Validation"))

    async def admitted(call: Callable[[], Awaitable[Any]]) -> Any:
        """Run a model request if fewer than max_concurrent_requests are in flight, else 429."""
        if state["expired"]:
            raise unavailable()
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

    async def json_response(value: Any) -> Response:
        """Serialized on a worker thread: a large answer must not hold the event loop."""
        return Response(await run_in_threadpool(_dumps, value), media_type="application/json")

    async def on_model_thread(call: Callable[..., Any], *args: Any) -> Any:
        def guarded() -> Any:  # queued past the drain deadline: not worth the model's time
            if state["expired"]:
                raise unavailable()
            return call(*args)

        run = then_release(guarded)
        return await asyncio.get_running_loop().run_in_executor(model_thread, run)

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

    async def embed(request: Request) -> Response:
        """TEI: {"inputs": str | [str], "normalize": true, "truncate": false} -> [[float]]."""
        data = _parse_object(await request.body())
        texts = _texts(data, "inputs", limits.max_client_batch_size)
        normalize, truncate = _flag(data, "normalize", True), _flag(data, "truncate", False)

        async def run() -> Response:
            pooled, _ = await vectors(texts, truncate, normalize)
            return await json_response(pooled.tolist())

        return await admitted(run)

    async def openai_embeddings(request: Request) -> Response:
        """OpenAI: {"input": str | [str], "model": ..., "encoding_format": "float"|"base64"}.
        Any "model" is accepted (clients must send one); ``engine.model_id`` answers, and the
        response and /info say so."""
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
        if dimensions is not None and (
            isinstance(dimensions, bool) or not isinstance(dimensions, int)
        ):
            raise ClientError(
                422, f'"dimensions" must be an integer. Received: {_short(dimensions)}'
            )
        if dimensions is not None and dimensions != engine.dim:
            raise ClientError(
                422,
                f'"dimensions" can only be {engine.dim} for this model. Received: '
                f"{_short(dimensions)}",
            )

        async def run() -> Response:
            pooled, tokens = await vectors(texts, False, True)
            items = []
            for i, row in enumerate(pooled):
                value: Any = row.tolist()
                if encoding == "base64":
                    value = base64.b64encode(row.astype("<f4").tobytes()).decode("ascii")
                items.append({"object": "embedding", "embedding": value, "index": i})
            usage = {"prompt_tokens": tokens, "total_tokens": tokens}
            body = {"object": "list", "data": items, "model": engine.model_id, "usage": usage}
            return await json_response(body)

        return await admitted(run)

    def too_large(layers: int, heads: int, length: int) -> ClientError:
        return ClientError(
            413,
            f"the answer would be larger than the response limit of {limits.max_response_mb:g} "
            f"MB (max_response_mb): it holds layers x heads x tokens x tokens weights; ask for "
            f'fewer "layers" or "heads", or send a shorter text. Received: {layers} layers x '
            f"{heads} heads x {length} tokens",
            "ResponseTooLarge",
        )

    async def attention(request: Request) -> Response:
        """{"inputs": str, "layers": [int], "heads": [int]} -> tokens and weights, exact floats:
        weights[i][j] is the (L, L) matrix of layers[i], heads[j]."""
        data = _parse_object(await request.body())
        (text,) = _texts(data, "inputs", 1, single=True)
        layers = _indices(data, "layers", engine.layers)
        heads = _indices(data, "heads", engine.heads)

        async def run() -> Response:
            (tokens,) = await tokenize([text], False)
            length = len(tokens.ids)
            limit = limits.max_response_bytes
            if len(layers) * len(heads) * length * length * _MIN_NUMBER_BYTES > limit:
                raise too_large(len(layers), len(heads), length)  # before the model runs
            weights = await on_model_thread(engine.attention, tokens.ids)
            head = {
                "tokens": tokens.pieces,
                "special": tokens.special,
                "layers": layers,
                "heads": heads,
            }
            chosen = weights[np.ix_(layers, heads)]  # [layers, heads, L, L]
            body = await run_in_threadpool(_attention_json, head, chosen, limit)
            if body is None:
                raise too_large(len(layers), len(heads), length)
            return Response(body, media_type="application/json")

        return await admitted(run)

    async def view(request: Request) -> HTMLResponse:
        """GET /view?text=...: the offline HTML head view (every layer and head) of the text."""
        query = dict(request.query_params)
        (text,) = _texts(query, "text", 1, single=True)

        async def run() -> HTMLResponse:
            import torch

            from ..viz.html import head_view

            (tokens,) = await tokenize([text], False)
            weights = await on_model_thread(engine.attention, tokens.ids)
            page = await run_in_threadpool(
                head_view,
                torch.from_numpy(weights),
                tokens.pieces,
                special=tokens.special,
                title=f"attention: {text}",
            )
            body = page.encode()
            if len(body) > limits.max_response_bytes:
                raise too_large(engine.layers, engine.heads, len(tokens.ids))
            return HTMLResponse(body)

        return await admitted(run)

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    async def info(request: Request) -> JSONResponse:
        return JSONResponse(
            {
                "model_id": engine.model_id,
                "model_names": (
                    f'any "model" value is accepted; {engine.model_id} answers every request'
                ),
                "runtime": engine.runtime,
                "dim": engine.dim,
                "layers": engine.layers,
                "heads": engine.heads,
                "max_input_length": engine.max_input_length,
                **{k: getattr(limits, k) for k in Limits.__dataclass_fields__},
                "api_key": access.api_key is not None,
                "cors_origin": access.cors_origin,
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
    app.state.batcher, app.state.access, app.state.drain = batcher, access, drain
    return Guard(app, limits, access, metrics)
