"""The HTTP service over real sockets (uvicorn on 127.0.0.1): answers against the model, and
every client mistake answered with a 4xx and a JSON error."""

from __future__ import annotations

import base64
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from multihead.bench.texts import sentences
from multihead.export import OnnxBert
from multihead.serve import Background, Engine, Limits, create_app
from multihead.serve.engine import OnnxRuntime

# the service's embeddings against the model's own embed (itself within 1e-5 of
# sentence-transformers, tests/models): the same packed path, so only the order of the rows
# in a pack differs, worth a few 1e-7
FP32 = 1e-5
TEXTS = ["The animal didn't cross the street because it was too tired.", "hello world", "ok"]


def _mean_pool(pretrained, text: str) -> np.ndarray:
    """Mean of the last hidden states over the text's tokens, computed here directly."""
    batch = pretrained.tokenize([text])
    with torch.inference_mode():
        hidden = pretrained.model(batch.input_ids, lengths=batch.lengths)
    return hidden[0].mean(0).numpy()


def _metrics(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(url + "/metrics").text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_embed_tei_format(server, pretrained):
    url = server.url
    one = httpx.post(url + "/embed", json={"inputs": TEXTS[0]})
    assert one.status_code == 200 and one.headers["content-type"] == "application/json"
    many = httpx.post(url + "/embed", json={"inputs": TEXTS, "normalize": True}).json()
    expected = pretrained.embed(TEXTS).numpy()
    assert np.array(one.json()).shape == (1, 384)
    assert np.abs(np.array(many) - expected).max() <= FP32
    assert np.abs(np.array(one.json()[0]) - expected[0]).max() <= FP32
    raw = httpx.post(url + "/embed", json={"inputs": TEXTS[1], "normalize": False}).json()[0]
    assert np.abs(np.array(raw) - _mean_pool(pretrained, TEXTS[1])).max() <= FP32
    long_text = " ".join(["word"] * 400)  # 402 tokens: cut to 256 as sentence-transformers does
    cut = httpx.post(url + "/embed", json={"inputs": long_text, "truncate": True}).json()[0]
    with pytest.warns(UserWarning, match="truncated"):
        assert np.abs(np.array(cut) - pretrained.embed([long_text]).numpy()[0]).max() <= FP32


def test_openai_embeddings(server, pretrained):
    body = {"input": TEXTS, "model": "anything", "encoding_format": "float"}
    answer = httpx.post(server.url + "/v1/embeddings", json=body).json()
    assert (
        answer["object"] == "list" and answer["model"] == "sentence-transformers/all-MiniLM-L6-v2"
    )
    assert [d["index"] for d in answer["data"]] == [0, 1, 2]
    assert all(d["object"] == "embedding" for d in answer["data"])
    tokens = sum(len(ids) for ids in (pretrained.tokenizer.encode(t).ids for t in TEXTS))
    assert answer["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    vectors = np.array([d["embedding"] for d in answer["data"]])
    assert np.abs(vectors - pretrained.embed(TEXTS).numpy()).max() <= FP32
    packed = httpx.post(
        server.url + "/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64"}
    ).json()["data"][0]["embedding"]
    decoded = np.frombuffer(base64.b64decode(packed), dtype="<f4")
    np.testing.assert_array_equal(decoded, vectors[0].astype(np.float32))


def test_attention_returns_exact_weights(server, pretrained, engine):
    text = TEXTS[0]
    answer = httpx.post(server.url + "/attention", json={"inputs": text}).json()
    batch, out = pretrained([text], return_weights=True)
    assert answer["tokens"] == batch.tokens[0] and answer["special"] == batch.special[0]
    weights = np.array(answer["weights"])  # [layers, heads, L, L]
    expected = torch.stack(out.weights)[:, 0].numpy()
    assert weights.shape == expected.shape == (6, 12, 16, 16)
    assert np.abs(weights - expected).max() <= FP32
    # JSON carried the float32 values bit for bit: nothing was rounded on the way
    direct = engine.attention(batch.input_ids[0].tolist())
    np.testing.assert_array_equal(weights.astype(np.float32), direct)
    assert weights.astype(np.float32).tolist() == weights.tolist()
    picked = httpx.post(
        server.url + "/attention", json={"inputs": text, "layers": [5, 0], "heads": [11]}
    ).json()
    assert picked["layers"] == [5, 0] and picked["heads"] == [11]
    np.testing.assert_array_equal(np.array(picked["weights"]), weights[[5, 0]][:, [11]])


def test_view_is_the_offline_head_view(server):
    page = httpx.get(server.url + "/view", params={"text": "The cat sat on the mat"})
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in page.text  # the page can make no request at all
    assert "attention: The cat sat on the mat" in page.text and '"mat"' in page.text


def test_health_and_info(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    info = httpx.get(server.url + "/info").json()
    assert info["runtime"] == "torch" and info["dim"] == 384
    assert info["max_input_length"] == 256 and info["max_batch_tokens"] == 16384
    assert info["max_response_mb"] == 16 and info["drain_timeout_s"] == 20
    assert info["api_key"] is False and info["cors_origin"] is None


def test_any_model_name_is_answered_by_the_served_model_and_info_says_so(server, engine):
    body = {"input": "hello", "model": "text-embedding-3-large"}
    answer = httpx.post(server.url + "/v1/embeddings", json=body)
    assert answer.status_code == 200 and answer.json()["model"] == engine.model_id
    info = httpx.get(server.url + "/info").json()
    assert info["model_id"] == engine.model_id
    assert info["model_names"] == (
        f'any "model" value is accepted; {engine.model_id} answers every request'
    )


def test_attention_answers_past_the_response_limit_get_413(engine):
    """The answer is counted as it is written: one byte over max_response_mb is refused, with
    a message saying how to ask for less; the exact size fits."""
    full = {"inputs": TEXTS[0]}
    with Background(create_app(engine, Limits())) as running:
        size = len(httpx.post(running.url + "/attention", json=full).content)
        # 250 words with all layers and heads (the probe's 100 MB answer): refused before the
        # model runs, since even "0.0," for every weight would not fit in 16 MB
        words = {"inputs": " ".join(["word"] * 250)}
        refused = httpx.post(running.url + "/attention", json=words)
        assert refused.status_code == 413 and refused.json()["error_type"] == "ResponseTooLarge"
        assert refused.json()["error"].endswith("Received: 6 layers x 12 heads x 252 tokens")
        assert 'fewer "layers" or "heads", or send a shorter text' in refused.json()["error"]
        fewer = httpx.post(running.url + "/attention", json={**words, "layers": [5], "heads": [0]})
        assert fewer.status_code == 200 and len(fewer.content) < 16_000_000
    assert 300_000 < size < 16_000_000  # 72 matrices of 16 x 16
    with Background(create_app(engine, Limits(max_response_mb=size / 1e6))) as running:
        assert httpx.post(running.url + "/attention", json=full).status_code == 200
    with Background(create_app(engine, Limits(max_response_mb=(size - 1) / 1e6))) as running:
        over = httpx.post(running.url + "/attention", json=full)
    assert over.status_code == 413 and "(max_response_mb)" in over.json()["error"]
    with Background(create_app(engine, Limits(max_response_mb=0.05))) as running:
        page = httpx.get(running.url + "/view", params={"text": TEXTS[0]})
    # the head view holds the same weights (rounded): 16 tokens need more than 50 kB
    assert page.status_code == 413 and "x 16 tokens" in page.json()["error"]


def test_health_answers_within_a_second_while_a_large_answer_is_built(engine):
    """Before, a 60 MB answer was serialized on the event loop, and /health waited for it."""
    text = " ".join(["word"] * 200)  # 72 matrices of 202 x 202 weights: about 60 MB of JSON
    with Background(create_app(engine, Limits(max_response_mb=500))) as running:
        pool = ThreadPoolExecutor(1)
        big = pool.submit(httpx.post, running.url + "/attention", json={"inputs": text},
                          timeout=120)  # fmt: skip
        waits = []
        with httpx.Client(base_url=running.url, timeout=10) as client:
            while not big.done() and len(waits) < 2000:
                start = time.monotonic()
                assert client.get("/health").status_code == 200
                waits.append(time.monotonic() - start)
                time.sleep(0.02)
        answer = big.result()
        pool.shutdown()
    assert answer.status_code == 200 and len(answer.content) > 30_000_000
    assert len(waits) >= 10 and max(waits) < 1.0, max(waits)


def _raw(body: bytes) -> dict:
    """httpx arguments sending ``body`` as it is, declared as JSON."""
    return {"content": body, "headers": {"content-type": "application/json"}}


def _malformed(url: str) -> list[tuple[str, str, dict, int, str]]:
    """(method, path, httpx keyword arguments, expected status, words of the message)."""
    long_text = " ".join(["word"] * 300)
    return [
        ("POST", "/embed", _raw(b"{"), 422, "must be JSON"),
        ("POST", "/embed", _raw(b""), 422, "must be JSON"),
        ("POST", "/embed", _raw(b"[]"), 422, "JSON object. Received: list"),
        ("POST", "/embed", _raw(b'"text"'), 422, "JSON object. Received: str"),
        ("POST", "/embed", _raw(b"null"), 422, "JSON object"),
        ("POST", "/embed", {"json": {"input": "x"}}, 422, 'must have "inputs"'),
        ("POST", "/embed", {"json": {"inputs": 3}}, 422, "string or a list of strings"),
        ("POST", "/embed", {"json": {"inputs": None}}, 422, "string or a list of strings"),
        ("POST", "/embed", {"json": {"inputs": []}}, 422, "must not be an empty list"),
        ("POST", "/embed", {"json": {"inputs": ""}}, 422, "is empty"),
        ("POST", "/embed", {"json": {"inputs": " \n "}}, 422, "is empty"),
        ("POST", "/embed", {"json": {"inputs": "\x00\x00\x00"}}, 422, "is empty"),
        ("POST", "/embed", {"json": {"inputs": "\u200b\u200b"}}, 422, "is empty"),
        ("POST", "/embed", {"json": {"inputs": ["ok", "\ufeff \u200d\t"]}}, 422, "inputs[1]"),
        ("POST", "/embed", {"json": {"inputs": ["ok", 5]}}, 422, '"inputs[1]" must be a string'),
        ("POST", "/embed", {"json": {"inputs": ["ok", None]}}, 422, "must be a string"),
        ("POST", "/embed", {"json": {"inputs": [["x"]]}}, 422, "must be a string"),
        ("POST", "/embed", {"json": {"inputs": ["a"] * 33}}, 422, "at most 32"),
        ("POST", "/embed", {"json": {"inputs": long_text}}, 422, "302 tokens but at most 256"),
        ("POST", "/embed", {"json": {"inputs": "x", "normalize": "yes"}}, 422, '"normalize"'),
        ("POST", "/embed", {"json": {"inputs": "x", "truncate": 1}}, 422, '"truncate"'),
        ("POST", "/embed", _raw(b'{"inputs": "\\ud800"}'), 422, "not valid Unicode"),
        ("POST", "/embed", _raw(b"\xff\xfe\x00"), 422, "must be JSON"),
        ("POST", "/embed", _raw(b"[" * 200_000), 422, "must be JSON"),
        ("POST", "/embed", _raw(b"x" * 2_000_001), 413, "larger than the limit"),
        (
            "POST",
            "/embed",
            {"content": b"hello", "headers": {"content-type": "text/plain"}},
            415,
            "Received: Content-Type: text/plain",
        ),
        ("POST", "/embed", {"content": b'{"inputs": "x"}'}, 415, "Content-Type: (none)"),
        ("POST", "/v1/embeddings", {"json": {"inputs": "x"}}, 422, 'must have "input"'),
        (
            "POST",
            "/v1/embeddings",
            {"json": {"input": "x", "encoding_format": "hex"}},
            422,
            "encoding_format",
        ),
        ("POST", "/v1/embeddings", {"json": {"input": "x", "model": 7}}, 422, '"model"'),
        ("POST", "/v1/embeddings", {"json": {"input": "x", "dimensions": 8}}, 422, "384"),
        (
            "POST",
            "/v1/embeddings",
            {"json": {"input": "x", "dimensions": 384.0}},
            422,
            '"dimensions" must be an integer. Received: 384.0',
        ),
        ("POST", "/v1/embeddings", {"json": {"input": "x", "dimensions": True}}, 422, "integer"),
        ("POST", "/attention", {"json": {"inputs": "x", "layers": [1, 0, 1]}}, 422, "repeat"),
        (
            "POST",
            "/attention",
            {"json": {"inputs": "x", "heads": [0] * 20000}},
            422,
            '"heads" must not repeat an index. Received: [0] more than once',
        ),
        ("POST", "/v1/embeddings", {"json": {"input": [101, 102]}}, 422, "must be a string"),
        ("POST", "/v1/embeddings", _raw(b"x" * 2_000_001), 413, "larger than the limit"),
        ("POST", "/attention", {"json": {"inputs": ["a", "b"]}}, 422, "must be a string"),
        ("POST", "/attention", {"json": {"inputs": "x", "layers": [6]}}, 422, "[0, 6)"),
        ("POST", "/attention", {"json": {"inputs": "x", "heads": [-1]}}, 422, "[0, 12)"),
        ("POST", "/attention", {"json": {"inputs": "x", "layers": []}}, 422, "non-empty list"),
        ("POST", "/attention", {"json": {"inputs": "x", "heads": [True]}}, 422, "integers"),
        ("POST", "/attention", {"json": {"inputs": "x", "layers": "all"}}, 422, "integers"),
        ("POST", "/attention", {"json": {"inputs": long_text}}, 422, "at most 256"),
        ("GET", "/view", {}, 422, 'must have "text"'),
        ("GET", "/view", {"params": {"text": ""}}, 422, "is empty"),
        ("GET", "/embed", {}, 405, "Method Not Allowed"),
        ("POST", "/health", {}, 405, "Method Not Allowed"),
        ("DELETE", "/v1/embeddings", {}, 405, "Method Not Allowed"),
        ("GET", "/nothing/here", {}, 404, "Not Found"),
    ]


def test_malformed_requests_get_4xx_with_a_json_error(server):
    cases = _malformed(server.url)
    assert len(cases) >= 30
    with httpx.Client(base_url=server.url) as client:
        for method, path, kwargs, status, words in cases:
            answer = client.request(method, path, **kwargs)
            assert answer.status_code == status, (method, path, answer.text[:200])
            assert answer.headers["content-type"] == "application/json"
            error = answer.json()["error"]
            message = error["message"] if path.startswith("/v1/") else error
            assert words in message, (path, kwargs, message)
            if not path.startswith("/v1/"):
                assert answer.json()["error_type"]
    statuses = [
        dict(labels)["status"]
        for name, labels in _metrics(server.url)
        if name == "multihead_requests_total"
    ]
    assert "422" in statuses and not [s for s in statuses if s.startswith("5")]


def test_metrics_count_requests_batches_and_tokens(engine):
    app = create_app(engine, Limits())
    with Background(app) as running:
        for text in TEXTS:
            assert httpx.post(running.url + "/embed", json={"inputs": text}).status_code == 200
        httpx.post(running.url + "/embed", json={"inputs": []})
        values = _metrics(running.url)
    tokens = sum(len(engine.pretrained.tokenizer.encode(t).ids) for t in TEXTS)
    assert values[("multihead_requests_total", (("endpoint", "/embed"), ("status", "200")))] == 3
    assert (
        values[("multihead_request_errors_total", (("endpoint", "/embed"), ("status", "422")))] == 1
    )
    assert values[("multihead_request_duration_seconds_count", (("endpoint", "/embed"),))] == 4
    assert values[("multihead_batch_size_sum", ())] == 3
    assert values[("multihead_batch_tokens_sum", ())] == tokens
    assert values[("multihead_tokens_total", ())] == tokens
    assert values[("multihead_in_flight", ())] == 0


def _post_all(url: str, bodies: list[dict]) -> list:
    """Send each body from its own thread; return the futures (answers in order)."""
    pool = ThreadPoolExecutor(len(bodies))
    client = httpx.Client(base_url=url, timeout=60, limits=httpx.Limits(max_connections=64))
    futures = [pool.submit(client.post, "/embed", json=body) for body in bodies]
    pool.shutdown(wait=False)
    return futures


def test_concurrent_requests_share_batches_within_the_token_budget(gated, wait_until):
    """While the model thread is busy, ten requests queue up; they then run as batches of at
    most max_batch_tokens tokens, in arrival order, and each gets its own vector back."""
    texts = ["hello world again"] + [f"text number {i}" for i in range(10)]  # 5 tokens each
    with gated(Limits(max_batch_tokens=20, max_wait_ms=50)) as (engine, app, running):
        first = _post_all(running.url, [{"inputs": texts[0]}])
        wait_until(lambda: engine.calls == [1])  # the model thread now holds the first batch
        rest = _post_all(running.url, [{"inputs": t} for t in texts[1:]])
        wait_until(lambda: app.state.batcher.queued == 10)
        engine.gate.set()
        answers = [f.result() for f in first + rest]
    assert engine.calls == [1, 4, 4, 2]  # 20-token budget: four 5-token texts per batch
    got = np.array([a.json()[0] for a in answers])
    assert np.abs(got - engine.pretrained.embed(texts).numpy()).max() <= FP32


def test_too_many_requests_at_once_get_429(gated, wait_until):
    with gated(Limits(max_concurrent_requests=2)) as (engine, app, running):
        held = _post_all(running.url, [{"inputs": "one"}])
        wait_until(lambda: engine.calls == [1])  # in the model
        held += _post_all(running.url, [{"inputs": "two"}])
        wait_until(lambda: app.state.batcher.queued == 1)  # in the queue
        refused = httpx.post(running.url + "/embed", json={"inputs": "three"})
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert refused.json()["error_type"] == "Overloaded"
        assert "limit of 2 requests at once" in refused.json()["error"]
        engine.gate.set()
        assert [f.result().status_code for f in held] == [200, 200]
        after = httpx.post(running.url + "/embed", json={"inputs": "three"})
        assert after.status_code == 200


def test_shutdown_finishes_requests_in_flight(gated, wait_until, pretrained):
    """Stopping (what SIGTERM does) while one request is in the model and three wait in the
    queue: no new connection is taken, and all four still get their embeddings."""
    with gated(Limits()) as (engine, app, running):
        texts = [f"request {i} before the shutdown" for i in range(4)]
        futures = _post_all(running.url, [{"inputs": texts[0]}])
        wait_until(lambda: engine.calls == [1])
        futures += _post_all(running.url, [{"inputs": t} for t in texts[1:]])
        wait_until(lambda: app.state.batcher.queued == 3)
        stopper = ThreadPoolExecutor(1).submit(running.stop)
        wait_until(lambda: _refused(running.url))
        assert not running.stopped  # still waiting for the requests in flight
        engine.gate.set()
        answers = [f.result(timeout=30) for f in futures]
        stopper.result(timeout=30)
        assert running.stopped
    assert [a.status_code for a in answers] == [200] * 4
    got = np.array([a.json()[0] for a in answers])
    assert np.abs(got - pretrained.embed(texts).numpy()).max() <= FP32


def _refused(url: str) -> bool:
    """No new request is served: the connection is refused, or (while the listening socket
    closes) accepted and then dropped or reset without a response. A timeout is not a refusal:
    it may only mean a busy server."""
    try:
        httpx.get(url + "/health", timeout=1)
    except (httpx.NetworkError, httpx.RemoteProtocolError):
        return True
    return False


def test_onnx_runtime_answers_like_torch(pretrained, minilm_onnx):
    engine = Engine(pretrained, runtime=OnnxRuntime(OnnxBert(minilm_onnx, pretrained, threads=1)))
    with Background(create_app(engine)) as running:
        vectors = httpx.post(running.url + "/embed", json={"inputs": TEXTS}).json()
        attention = httpx.post(running.url + "/attention", json={"inputs": TEXTS[0]}).json()
        info = httpx.get(running.url + "/info").json()
    assert info["runtime"] == "onnx"
    assert np.abs(np.array(vectors) - pretrained.embed(TEXTS).numpy()).max() <= FP32
    _, out = pretrained([TEXTS[0]], return_weights=True)
    expected = torch.stack(out.weights)[:, 0].numpy()
    assert np.abs(np.array(attention["weights"]) - expected).max() <= FP32


def test_limits_are_checked():
    with pytest.raises(ValueError, match=r"max_batch_tokens must be a positive int"):
        Limits(max_batch_tokens=0)
    with pytest.raises(ValueError, match=r"max_wait_ms must be a number in \[0, 10000\]"):
        Limits(max_wait_ms=-1)
    with pytest.raises(ValueError, match=r"payload_limit must be positive. Received: 0"):
        Limits(payload_limit=0)


def test_generated_load_texts_fit_the_service(engine):
    """The bench's texts (3 to 60 words) never need truncation, so both servers see them whole."""
    texts = sentences(64, min_words=3, max_words=60)
    assert max(len(t.ids) for t in engine.tokenize(texts, truncate=False)) <= 256


def test_engine_refuses_sequences_the_model_cannot_hold(engine):
    with pytest.raises(ValueError, match=r"ids\[1\] must hold 1 to 512 token ids.*Received: 0 ids"):
        engine.embed([[101, 102], []])
    with pytest.raises(ValueError, match=r"ids\[0\] must hold 1 to 512 token ids.*Received: 600"):
        engine.embed([[101] * 600])
