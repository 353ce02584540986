"""Requests whose clients leave, and shutdown with a queue (issue 17, item 5): jobs of departed
clients never reach the model, and past the drain deadline the queue is answered 503 with
Retry-After, never 500."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from rawhttp import connect, read_until_closed, request_head

from multihead.serve import Limits


def _post(url: str, text: str) -> httpx.Response:
    return httpx.post(url + "/embed", json={"inputs": text}, timeout=60)


def _embed_request(text: str) -> bytes:
    body = json.dumps({"inputs": text}).encode()
    head = request_head(
        "POST", "/embed", {"content-type": "application/json", "content-length": str(len(body))}
    )
    return head + body


def test_requests_of_clients_that_left_never_reach_the_model(gated, wait_until):
    with gated(Limits(max_wait_ms=0)) as (engine, app, running):
        pool = ThreadPoolExecutor(2)
        first = pool.submit(_post, running.url, "holds the model")
        wait_until(lambda: engine.calls == [1])
        leaving = [connect(running, _embed_request(f"text {i}")) for i in range(3)]
        wait_until(lambda: app.state.batcher.queued == 3)
        for sock in leaving:
            sock.close()
        wait_until(lambda: app.state.batcher.queued == 0)  # dropped, not computed
        staying = pool.submit(_post, running.url, "arrives after")
        wait_until(lambda: app.state.batcher.queued == 1)
        engine.gate.set()
        assert first.result().status_code == 200 and staying.result().status_code == 200
        pool.shutdown()
        metrics = httpx.get(running.url + "/metrics").text
    assert engine.calls == [1, 1]  # before: [1, 3, 1], the departed three computed anyway
    assert 'multihead_requests_total{endpoint="/embed",status="499"} 3.0' in metrics


def test_past_the_drain_deadline_the_queue_gets_503_and_the_model_batch_finishes(gated, wait_until):
    """SIGTERM with one request in the model and three queued, a 0.5 s drain deadline: the
    three get 503 with Retry-After at the deadline, the first its embedding when the model
    is done, nobody a 500; a request still sending its body is answered too."""
    with gated(Limits(max_wait_ms=0, drain_timeout_s=0.5)) as (engine, app, running):
        pool = ThreadPoolExecutor(5)
        first = pool.submit(_post, running.url, "in the model")
        wait_until(lambda: engine.calls == [1])
        queued = [pool.submit(_post, running.url, f"queued {i}") for i in range(3)]
        wait_until(lambda: app.state.batcher.queued == 3)
        start = time.monotonic()
        stopper = pool.submit(running.stop)
        answers = [f.result(timeout=30) for f in queued]
        waited = time.monotonic() - start
        assert not first.done() and not running.stopped  # the model still holds the first
        engine.gate.set()
        assert first.result(timeout=30).status_code == 200
        stopper.result(timeout=30)
        pool.shutdown()
    assert running.stopped and 0.4 < waited < 10
    assert [a.status_code for a in answers] == [503] * 3
    assert all(a.headers["retry-after"] == "1" for a in answers)
    assert all(a.json()["error_type"] == "Unavailable" for a in answers)
    assert "drain_timeout_s" in answers[0].json()["error"]
    assert engine.calls == [1]  # the expired requests never reached the model


def test_a_slow_body_does_not_hold_the_shutdown(gated, wait_until):
    """A client that sent half a body when the shutdown began gets its 408 at the body
    deadline, and the server stops then (uvicorn waits for every open connection)."""
    with gated(Limits(body_timeout_s=1.0)) as (_, _, running):
        head = request_head(
            "POST", "/embed", {"content-type": "application/json", "content-length": "50"}
        )
        sock = connect(running, head + b'{"inputs"')
        start = time.monotonic()
        running.stop()
        took = time.monotonic() - start
        raw, closed = read_until_closed(sock, timeout=5)
    assert raw.startswith(b"HTTP/1.1 408") and closed
    assert took < 10
