"""The route handlers, each a function of the request and the app's ``ServeState``: read and
check the request, run the model through the state, write the answer. Errors are raised as
``ClientError`` and answered by ``client_error``. Needs the ``serve`` extra (``create_app``
checks it before importing this module).

Every client mistake gets a 4xx with a JSON body naming the problem (TEI's shape
``{"error": ..., "error_type": ...}``; OpenAI's ``{"error": {"message": ..., "type": ...}}``
under ``/v1/``): 413 response too large, 422 bad JSON, wrong types, empty or too many inputs,
duplicate layers or heads, a text too long with ``truncate: false``, 429 too many requests at
once, 503 past the drain deadline, 404/405 unknown routes. Responses are serialized off the
event loop.
"""

from __future__ import annotations

import base64
import json
import unicodedata
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response

from .engine import Tokens, TooLong
from .guard import ROUTES, error_body
from .state import ClientError, Limits, ServeState

__all__ = [
    "HANDLERS",
    "attention",
    "client_error",
    "embed",
    "endpoint",
    "health",
    "http_error",
    "info",
    "openai_embeddings",
    "prometheus",
    "view",
]

# characters that leave a text as empty as whitespace does: controls (NUL), format characters
# (zero-width space and joiners, BOM) and separators; the tokenizer drops them all
_INVISIBLE = frozenset(("Cc", "Cf", "Zs", "Zl", "Zp"))
# the shortest a JSON number of the weights can be ("0.0" and its comma): with it a request
# whose answer cannot fit the response limit is refused before the model runs
_MIN_NUMBER_BYTES = 4

Handler = Callable[[Request, ServeState], Awaitable[Response]]


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


def _error(request: Request, status: int, message: str, kind: str) -> JSONResponse:
    headers = {"Retry-After": "1"} if status in (429, 503) else None
    body = error_body(request.url.path, status, message, kind)
    return JSONResponse(body, status_code=status, headers=headers)


async def client_error(request: Request, err: ClientError) -> JSONResponse:
    """The answer to a refused request, in the error shape of its route."""
    return _error(request, err.status, err.message, err.kind)


async def http_error(request: Request, err: HTTPException) -> JSONResponse:
    """404 and 405 (no such route or method), in the same error shape."""
    kinds = {404: "NotFound", 405: "MethodNotAllowed"}
    message = f"{err.detail} ({request.method} {request.url.path}); routes: {list(ROUTES)}"
    return _error(request, err.status_code, message, kinds.get(err.status_code, "Validation"))


async def _json_response(value: Any) -> Response:
    """Serialized on a worker thread: a large answer must not hold the event loop."""
    return Response(await run_in_threadpool(_dumps, value), media_type="application/json")


async def _tokenize(state: ServeState, texts: list[str], truncate: bool) -> list[Tokens]:
    try:
        return await run_in_threadpool(state.engine.tokenize, texts, truncate=truncate)
    except TooLong as err:
        raise ClientError(422, str(err)) from err


async def _vectors(
    state: ServeState, texts: list[str], truncate: bool, normalize: bool
) -> tuple[np.ndarray, int]:
    """The texts' embeddings through the batcher, and how many tokens they had."""
    tokens = await _tokenize(state, texts, truncate)
    pooled = await state.batcher.submit([t.ids for t in tokens])
    if normalize:
        pooled = pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)
    return pooled, sum(len(t.ids) for t in tokens)


def _too_large(limits: Limits, layers: int, heads: int, length: int) -> ClientError:
    return ClientError(
        413,
        f"the answer would be larger than the response limit of {limits.max_response_mb:g} "
        f"MB (max_response_mb): it holds layers x heads x tokens x tokens weights; ask for "
        f'fewer "layers" or "heads", or send a shorter text. Received: {layers} layers x '
        f"{heads} heads x {length} tokens",
        "ResponseTooLarge",
    )


async def embed(request: Request, state: ServeState) -> Response:
    """TEI: {"inputs": str | [str], "normalize": true, "truncate": false} -> [[float]]."""
    data = _parse_object(await request.body())
    texts = _texts(data, "inputs", state.limits.max_client_batch_size)
    normalize, truncate = _flag(data, "normalize", True), _flag(data, "truncate", False)

    async def run() -> Response:
        pooled, _ = await _vectors(state, texts, truncate, normalize)
        return await _json_response(pooled.tolist())

    return await state.admitted(run)


def _openai_options(data: dict[str, Any], dim: int) -> str:
    """Checks "model" and "dimensions" (only the model's own); returns the encoding format."""
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise ClientError(422, f'"model" must be a string. Received: {_short(model)}')
    encoding = data.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise ClientError(
            422, f'"encoding_format" must be "float" or "base64". Received: {_short(encoding)}'
        )
    dimensions = data.get("dimensions")
    if dimensions is not None and (isinstance(dimensions, bool) or not isinstance(dimensions, int)):
        raise ClientError(422, f'"dimensions" must be an integer. Received: {_short(dimensions)}')
    if dimensions is not None and dimensions != dim:
        raise ClientError(
            422,
            f'"dimensions" can only be {dim} for this model. Received: {_short(dimensions)}',
        )
    return encoding


async def openai_embeddings(request: Request, state: ServeState) -> Response:
    """OpenAI: {"input": str | [str], "model": ..., "encoding_format": "float"|"base64"}.
    Any "model" is accepted (clients must send one); ``engine.model_id`` answers, and the
    response and /info say so."""
    data = _parse_object(await request.body())
    texts = _texts(data, "input", state.limits.max_client_batch_size)
    encoding = _openai_options(data, state.engine.dim)

    async def run() -> Response:
        pooled, tokens = await _vectors(state, texts, False, True)
        items = []
        for i, row in enumerate(pooled):
            value: Any = row.tolist()
            if encoding == "base64":
                value = base64.b64encode(row.astype("<f4").tobytes()).decode("ascii")
            items.append({"object": "embedding", "embedding": value, "index": i})
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        body = {"object": "list", "data": items, "model": state.engine.model_id, "usage": usage}
        return await _json_response(body)

    return await state.admitted(run)


async def attention(request: Request, state: ServeState) -> Response:
    """{"inputs": str, "layers": [int], "heads": [int]} -> tokens and weights, exact floats:
    weights[i][j] is the (L, L) matrix of layers[i], heads[j]."""
    engine, limits = state.engine, state.limits
    data = _parse_object(await request.body())
    (text,) = _texts(data, "inputs", 1, single=True)
    layers = _indices(data, "layers", engine.layers)
    heads = _indices(data, "heads", engine.heads)

    async def run() -> Response:
        (tokens,) = await _tokenize(state, [text], False)
        length = len(tokens.ids)
        limit = limits.max_response_bytes
        if len(layers) * len(heads) * length * length * _MIN_NUMBER_BYTES > limit:
            raise _too_large(limits, len(layers), len(heads), length)  # before the model runs
        weights = await state.on_model_thread(engine.attention, tokens.ids)
        head = {
            "tokens": tokens.pieces,
            "special": tokens.special,
            "layers": layers,
            "heads": heads,
        }
        chosen = weights[np.ix_(layers, heads)]  # [layers, heads, L, L]
        body = await run_in_threadpool(_attention_json, head, chosen, limit)
        if body is None:
            raise _too_large(limits, len(layers), len(heads), length)
        return Response(body, media_type="application/json")

    return await state.admitted(run)


async def view(request: Request, state: ServeState) -> Response:
    """GET /view?text=...: the offline HTML head view (every layer and head) of the text."""
    engine = state.engine
    query = dict(request.query_params)
    (text,) = _texts(query, "text", 1, single=True)

    async def run() -> HTMLResponse:
        import torch

        from ..viz.html import head_view

        (tokens,) = await _tokenize(state, [text], False)
        weights = await state.on_model_thread(engine.attention, tokens.ids)
        page = await run_in_threadpool(
            head_view,
            torch.from_numpy(weights),
            tokens.pieces,
            special=tokens.special,
            title=f"attention: {text}",
        )
        body = page.encode()
        if len(body) > state.limits.max_response_bytes:
            raise _too_large(state.limits, engine.layers, engine.heads, len(tokens.ids))
        return HTMLResponse(body)

    return await state.admitted(run)


async def health(request: Request, state: ServeState) -> Response:
    return JSONResponse({"status": "ok"})


async def info(request: Request, state: ServeState) -> Response:
    """The model, the runtime and every limit this server applies."""
    engine, limits, access = state.engine, state.limits, state.access
    return JSONResponse(
        {
            "model_id": engine.model_id,
            "model_names": (
                f'any "model" value is accepted; {engine.model_id} answers every request'
            ),
            "runtime": engine.runtime,
            "precision": engine.precision,
            "dim": engine.dim,
            "layers": engine.layers,
            "heads": engine.heads,
            "max_input_length": engine.max_input_length,
            **{k: getattr(limits, k) for k in Limits.__dataclass_fields__},
            "api_key": access.api_key is not None,
            "cors_origin": access.cors_origin,
        }
    )


async def prometheus(request: Request, state: ServeState) -> Response:
    body, content_type = state.metrics.render()
    return Response(body, media_type=content_type)


# every route's handler; their methods are guard.METHODS
HANDLERS: dict[str, Handler] = {
    "/embed": embed,
    "/v1/embeddings": openai_embeddings,
    "/attention": attention,
    "/view": view,
    "/health": health,
    "/info": info,
    "/metrics": prometheus,
}


def endpoint(handler: Handler) -> Callable[[Request], Awaitable[Response]]:
    """A Starlette endpoint: ``handler`` with the app's ``ServeState`` (``app.state.serve``)."""

    async def call(request: Request) -> Response:
        return await handler(request, request.app.state.serve)

    call.__name__ = call.__qualname__ = handler.__name__
    return call
