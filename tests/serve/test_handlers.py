"""The route handlers alone: each is a function of a request and a ``ServeState``, called here
without a server, a socket or a model (a small engine computes known answers in numpy)."""

from __future__ import annotations

import asyncio
import base64
import json

import numpy as np
import pytest
from starlette.requests import Request

from multihead.serve import Access, ClientError, Limits, ServeState, handlers
from multihead.serve.engine import Tokens, TooLong


class Engine:
    """Two layers, three heads, E=3: a text's tokens are [CLS], one id per word (its length
    plus 1000), [SEP]; its embedding and weights are fixed functions of the ids."""

    model_id, runtime, dim, layers, heads, max_input_length = "small", "numpy", 3, 2, 3, 6
    precision = "fp32"

    def __init__(self) -> None:
        self.calls: list[str] = []

    def tokenize(self, texts, *, truncate):
        out = []
        for i, text in enumerate(texts):
            ids = [101, *(1000 + len(w) for w in text.split()), 102]
            if len(ids) > self.max_input_length and not truncate:
                raise TooLong(i, len(ids), self.max_input_length)
            ids = ids[: self.max_input_length - 1] + [102] if truncate else ids
            out.append(Tokens(ids, [str(t) for t in ids], [t in (101, 102) for t in ids]))
        return out

    def embed(self, ids):
        self.calls.append(f"embed {len(ids)}")
        return np.array([[len(s), sum(s) / 1000, s[1] - 1000] for s in ids], dtype=np.float32)

    def attention(self, ids):
        self.calls.append("attention")
        size = self.layers * self.heads * len(ids) ** 2
        return (np.arange(size, dtype=np.float32) / 7).reshape(
            self.layers, self.heads, len(ids), -1
        )


def _request(path: str, body: object = None, query: bytes = b"") -> Request:
    raw = json.dumps(body).encode() if body is not None else b""

    async def receive() -> dict:
        return {"type": "http.request", "body": raw, "more_body": False}

    method = "POST" if body is not None else "GET"
    scope = {"type": "http", "method": method, "path": path, "query_string": query, "headers": []}
    return Request(scope, receive)


def _call(handler, request: Request, engine: Engine | None = None, limits: Limits | None = None):
    """``handler(request, state)`` inside a started state; returns (response, engine)."""
    engine = engine or Engine()

    async def main():
        state = ServeState(engine, limits or Limits(max_wait_ms=0), Access())
        state.start()
        try:
            return await handler(request, state)
        finally:
            await state.stop()

    return asyncio.run(main()), engine


def test_embed_normalizes_the_engines_vectors():
    body = {"inputs": ["a bb", "ccc dd e"]}
    response, engine = _call(handlers.embed, _request("/embed", body))
    rows = np.array([[4, (101 + 1001 + 1002 + 102) / 1000, 1], [5, 3.209, 3]], dtype=np.float64)
    expected = rows / np.linalg.norm(rows, axis=1, keepdims=True)
    got = np.array(json.loads(response.body))
    assert np.abs(got - expected).max() < 1e-6  # the engine's float32 rows, normalized
    assert engine.calls == ["embed 2"]  # one batch for the request's two texts
    raw, _ = _call(handlers.embed, _request("/embed", {"inputs": "a bb", "normalize": False}))
    assert json.loads(raw.body) == [[4.0, np.float32(2.206).item(), 1.0]]


def test_openai_embeddings_base64_and_usage():
    body = {"input": ["a bb", "ccc"], "model": "any", "encoding_format": "base64"}
    response, _ = _call(handlers.openai_embeddings, _request("/v1/embeddings", body))
    answer = json.loads(response.body)
    first = np.frombuffer(base64.b64decode(answer["data"][0]["embedding"]), dtype="<f4")
    row = np.array([4, 2.206, 1])
    assert np.abs(first - row / np.linalg.norm(row)).max() < 1e-6
    assert answer["usage"] == {"prompt_tokens": 7, "total_tokens": 7}
    assert (answer["model"], [d["index"] for d in answer["data"]]) == ("small", [0, 1])


def test_openai_options_are_checked_before_the_model():
    body = {"input": "a", "dimensions": 4}
    with pytest.raises(ClientError, match=r'"dimensions" can only be 3 for this model'):
        _call(handlers.openai_embeddings, _request("/v1/embeddings", body))
    body = {"input": "a", "encoding_format": "hex"}
    with pytest.raises(ClientError, match=r'"encoding_format" must be "float" or "base64"'):
        _call(handlers.openai_embeddings, _request("/v1/embeddings", body))


def test_attention_returns_the_chosen_layers_and_heads_exactly():
    body = {"inputs": "a bb", "layers": [1], "heads": [2, 0]}
    response, engine = _call(handlers.attention, _request("/attention", body))
    answer = json.loads(response.body)
    weights = engine.attention([0] * 4)
    assert answer["tokens"] == ["101", "1001", "1002", "102"]
    assert answer["special"] == [True, False, False, True]
    assert np.array_equal(np.array(answer["weights"]), weights[[1]][:, [2, 0]])  # exact floats


def test_attention_too_large_is_refused_before_the_model_runs():
    limits = Limits(max_wait_ms=0, max_response_mb=0.0001)  # 100 bytes
    body = {"inputs": "a bb ccc"}  # 2 layers x 3 heads x 5 x 5 numbers of at least 4 bytes
    engine = Engine()
    with pytest.raises(ClientError, match="larger than the response limit") as err:
        _call(handlers.attention, _request("/attention", body), engine, limits)
    assert err.value.status == 413 and engine.calls == []


def test_too_many_requests_at_once_get_429_without_the_model():
    engine = Engine()

    async def main():
        state = ServeState(engine, Limits(max_concurrent_requests=1), Access())
        state.in_flight = 1  # one request already admitted
        await handlers.embed(_request("/embed", {"inputs": "a"}), state)

    with pytest.raises(ClientError, match="limit of 1 requests at once") as err:
        asyncio.run(main())
    assert err.value.status == 429 and engine.calls == []


def test_a_text_too_long_without_truncate_is_422():
    with pytest.raises(ClientError, match=r"inputs\[0\] has 7 tokens but at most 6"):
        _call(handlers.embed, _request("/embed", {"inputs": "a b c d e"}))


def test_info_reports_the_engine_and_every_limit():
    limits = Limits(max_client_batch_size=5)
    response, _ = _call(handlers.info, _request("/info"), limits=limits)
    answer = json.loads(response.body)
    assert (answer["model_id"], answer["runtime"], answer["dim"]) == ("small", "numpy", 3)
    assert answer["precision"] == "fp32"
    assert answer["max_client_batch_size"] == 5 and answer["api_key"] is False


def test_view_reads_its_text_from_the_query():
    response, engine = _call(handlers.view, _request("/view", query=b"text=a+bb"))
    assert response.media_type == "text/html" and engine.calls == ["attention"]
    assert b"attention: a bb" in response.body
    with pytest.raises(ClientError, match='the body must have "text"'):
        _call(handlers.view, _request("/view"))


def test_client_error_answers_in_the_routes_error_shape():
    err = ClientError(422, "bad input")
    tei = asyncio.run(handlers.client_error(_request("/embed", {}), err))
    openai = asyncio.run(handlers.client_error(_request("/v1/embeddings", {}), err))
    assert json.loads(tei.body) == {"error": "bad input", "error_type": "Validation"}
    assert json.loads(openai.body)["error"]["message"] == "bad input"
    busy = asyncio.run(handlers.client_error(_request("/embed", {}), ClientError(429, "x")))
    assert busy.status_code == 429 and busy.headers["retry-after"] == "1"
