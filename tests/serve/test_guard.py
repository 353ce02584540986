"""What every request passes before a handler (issue 17, items 2 to 4): the Host check against
DNS rebinding, OPTIONS and CORS, the API key, JSON bodies only, and clients that send too much
or too slowly. Real uvicorn on 127.0.0.1; raw sockets where httpx would finish the request."""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import pytest
from rawhttp import connect, read_until_closed, request_head

from multihead.serve import Access, Background, Limits, create_app
from multihead.serve.guard import Guard
from multihead.serve.metrics import Metrics

TEXT = {"inputs": "hello world"}


@pytest.fixture(scope="module")
def guarded(engine):
    """``with guarded(limits, access) as running``: a fresh server with these settings."""

    def start(limits: Limits | None = None, access: Access | None = None) -> Background:
        app = create_app(engine, limits or Limits(), access)
        running = Background(app)
        running.app = app
        return running

    return start


def _status(raw: bytes) -> int:
    return int(raw.split(b" ", 2)[1]) if raw.startswith(b"HTTP/1.1 ") else 0


def test_host_must_name_this_machine_on_a_loopback_listener(server):
    """DNS rebinding: a page on evil.example whose name now resolves to 127.0.0.1 makes the
    browser send 'Host: evil.example'; a loopback listener refuses it."""
    port = server.port
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "127.0.0.2", f"[::1]:{port}",
                 "app.localhost"):  # fmt: skip
        answer = httpx.post(server.url + "/embed", json=TEXT, headers={"host": host})
        assert answer.status_code == 200, host
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.nip.io", "[2001:db8::1]"):
        answer = httpx.post(server.url + "/embed", json=TEXT, headers={"host": host})
        assert answer.status_code == 421, host
        assert answer.json()["error_type"] == "MisdirectedRequest"
        assert "--allowed-hosts" in answer.json()["error"]
        assert f"Received: Host: {host}" in answer.json()["error"]
    refused = httpx.get(server.url + "/health", headers={"host": "evil.example"})
    assert refused.status_code == 421  # even the open route: nothing is answered


def test_allowed_hosts_extend_the_loopback_names(guarded):
    with guarded(access=Access(allowed_hosts=("api.internal",))) as running:
        ok = httpx.get(running.url + "/info", headers={"host": "API.internal:8080"})
        refused = httpx.get(running.url + "/info", headers={"host": "other.internal"})
    assert ok.status_code == 200 and refused.status_code == 421
    with guarded(access=Access(loopback=False)) as running:  # listening on 0.0.0.0: no check
        assert httpx.get(running.url + "/info", headers={"host": "a.example"}).status_code == 200


def test_post_bodies_must_be_declared_json(server):
    """A web page can POST text/plain (or a form) to any address without a CORS preflight:
    such bodies are refused before they are read."""
    bodies = {
        "/embed": b'{"inputs": "x"}',
        "/v1/embeddings": b'{"input": "x"}',
        "/attention": b'{"inputs": "x"}',
    }
    kinds = ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; b=x", None]
    for path, body in bodies.items():
        for kind in kinds:
            headers = {} if kind is None else {"content-type": kind}
            answer = httpx.post(server.url + path, content=body, headers=headers)
            assert answer.status_code == 415, (path, kind)
            assert "Content-Type: application/json" in answer.text
        ok = {"content-type": "Application/JSON; charset=utf-8"}
        assert httpx.post(server.url + path, content=body, headers=ok).status_code == 200


def test_options_is_answered_without_cors_unless_configured(server, guarded):
    origin = {"origin": "https://evil.example", "access-control-request-method": "POST"}
    answer = httpx.options(server.url + "/embed", headers=origin)
    assert answer.status_code == 204 and answer.headers["allow"] == "POST, OPTIONS"
    assert not [h for h in answer.headers if h.startswith("access-control-")]
    posted = httpx.post(server.url + "/embed", json=TEXT, headers={"origin": "https://a.example"})
    assert posted.status_code == 200
    assert "access-control-allow-origin" not in posted.headers
    assert httpx.options(server.url + "/nothing").status_code == 404

    app_origin = "https://app.example"
    with guarded(access=Access(cors_origin=app_origin)) as running:
        preflight = httpx.options(
            running.url + "/embed",
            headers={"origin": app_origin, "access-control-request-method": "POST"},
        )
        other = httpx.options(running.url + "/embed", headers=origin)
        posted = httpx.post(running.url + "/embed", json=TEXT, headers={"origin": app_origin})
    assert preflight.status_code == 204
    assert preflight.headers["access-control-allow-origin"] == app_origin
    assert preflight.headers["access-control-allow-methods"] == "POST, OPTIONS"
    assert "content-type" in preflight.headers["access-control-allow-headers"]
    assert "access-control-allow-origin" not in other.headers
    assert posted.headers["access-control-allow-origin"] == app_origin
    assert posted.headers["vary"] == "Origin"


def test_api_key_is_required_on_every_route_but_health(guarded):
    key = "k3y-with-some-length"
    with guarded(access=Access(api_key=key)) as running:
        url = running.url
        assert httpx.get(url + "/health").status_code == 200
        for method, path in [("POST", "/embed"), ("POST", "/v1/embeddings"),
                             ("POST", "/attention"), ("GET", "/view"), ("GET", "/info"),
                             ("GET", "/metrics")]:  # fmt: skip
            answer = httpx.request(method, url + path, json=TEXT)
            assert answer.status_code == 401, path
            assert answer.headers["www-authenticate"].startswith("Bearer")
        cases = {
            None: "no Authorization header",
            f"Bearer {key}x": "a wrong key",
            f"Bearer {key[:-1]}": "a wrong key",
            f"Basic {key}": "Basic credentials",
            "Bearer": "a wrong key",
        }
        for header, received in cases.items():
            headers = {} if header is None else {"authorization": header}
            answer = httpx.post(url + "/embed", json=TEXT, headers=headers)
            assert answer.status_code == 401
            assert "Bearer <key>" in answer.json()["error"]
            assert answer.json()["error"].endswith(f"Received: {received}")
            assert key not in answer.text
        good = {"authorization": f"Bearer {key}"}
        assert httpx.post(url + "/embed", json=TEXT, headers=good).status_code == 200
        assert httpx.get(url + "/metrics", headers=good).status_code == 200
        openai = httpx.post(url + "/v1/embeddings", json={"input": "x"})
        assert openai.json()["error"]["type"] == "Unauthorized"  # OpenAI's error shape


def test_access_is_checked():
    with pytest.raises(ValueError, match=r"api_key must be a non-empty string.*Received: a str"):
        Access(api_key="")
    with pytest.raises(ValueError, match=r"allowed_hosts must be host names without a port"):
        Access(allowed_hosts=("a.example:80",))
    with pytest.raises(ValueError, match=r"allowed_hosts.*Received: 'a.example'"):
        Access(allowed_hosts="a.example")
    with pytest.raises(ValueError, match=r"cors_origin must be.*Received: 'https://a.example/'"):
        Access(cors_origin="https://a.example/")


def test_declared_length_over_the_limit_is_refused_before_the_body(server):
    """Content-Length: 99999999999 gets its 413 at once; before, the server read 16 MB of the
    body first (and waited for it)."""
    head = request_head(
        "POST",
        "/embed",
        {"content-type": "application/json", "content-length": "99999999999"},
    )
    start = time.monotonic()
    raw, closed = read_until_closed(connect(server, head), timeout=5)
    assert _status(raw) == 413 and b"Content-Length: 99999999999" in raw
    assert closed and time.monotonic() - start < 4  # lingering is at most 2 s


def test_a_client_still_sending_a_refused_body_reads_the_413(server):
    """The 413 comes before the body is read; the connection then lingers instead of being
    reset, so a client that writes its whole 3 MB first still reads the answer."""
    body = b'{"inputs": "' + b"x" * 3_000_000 + b'"}'
    answer = httpx.post(server.url + "/embed", content=body,
                        headers={"content-type": "application/json"})  # fmt: skip
    assert answer.status_code == 413 and "larger than the limit" in answer.json()["error"]


def test_slow_bodies_get_408_and_slow_headers_are_closed(guarded):
    """300 connections with half a header and 300 with half a body stayed open past 25 s;
    with 0.5 s deadlines, every one of 20 + 20 is closed within a few seconds."""
    limits = Limits(header_timeout_s=0.5, body_timeout_s=0.5)
    with guarded(limits) as running:
        half_headers = [connect(running, b"POST /embed HTTP/1.1\r\nHost: 127.0.0.1\r\nCont")
                        for _ in range(20)]  # fmt: skip
        idle = [connect(running) for _ in range(5)]  # connected, nothing sent
        head = request_head(
            "POST", "/embed", {"content-type": "application/json", "content-length": "100"}
        )
        half_bodies = [connect(running, head + b'{"inputs": "') for _ in range(20)]
        start = time.monotonic()
        deadline = start + 8  # one deadline for all: each read gets what is left of it
        headers = [read_until_closed(s, deadline - time.monotonic()) for s in half_headers + idle]
        bodies = [read_until_closed(s, deadline - time.monotonic()) for s in half_bodies]
        took = time.monotonic() - start
        assert httpx.get(running.url + "/health").status_code == 200  # still serving
    assert all(closed and raw == b"" for raw, closed in headers)
    assert all(closed and _status(raw) == 408 for raw, closed in bodies)
    assert b"did not arrive within 0.5 s" in bodies[0][0]
    assert took < 8


def test_a_body_cut_short_by_a_disconnect_is_dropped(guarded):
    """Before, the first 25 of 40 declared bytes were parsed as the request, and since they
    happen to be valid JSON, the model embedded them and the metrics counted a 200."""
    with guarded() as running:
        head = request_head(
            "POST", "/embed", {"content-type": "application/json", "content-length": "40"}
        )
        sock = connect(running, head + b'{"inputs": "hello world"}')
        sock.shutdown(socket.SHUT_WR)
        raw, closed = read_until_closed(sock, timeout=5)
        deadline = time.monotonic() + 5
        while 'status="499"' not in (text := httpx.get(running.url + "/metrics").text):
            assert time.monotonic() < deadline, text
            time.sleep(0.02)
    assert raw == b"" and closed
    assert 'multihead_requests_total{endpoint="/embed",status="499"} 1.0' in text
    assert 'endpoint="/embed",status="200"' not in text
    assert 'endpoint="/embed",status="422"' not in text
    assert "multihead_tokens_total 0.0" in text


def test_metric_labels_stay_bounded(server):
    """Unknown paths share one endpoint label, so no request can grow the metrics: once the
    label set of a 404 exists, 50 more unknown paths add no line at all."""
    with httpx.Client(base_url=server.url) as client:
        client.get("/random/first")
        client.get("/metrics")  # a response is counted after it is sent: /metrics' own labels
        before = client.get("/metrics").text
        for i in range(50):
            client.get(f"/random/{i}", params={"q": i})
        after = client.get("/metrics").text
    assert 'multihead_requests_total{endpoint="other",status="404"}' in after
    assert after.count("\n") == before.count("\n")


def test_a_request_cancelled_at_the_end_of_shutdown_gets_503_not_500():
    """uvicorn cancels what is still running when its own shutdown deadline passes and then
    answers 500; the guard answers 503 with Retry-After first. (ASGI level: the app hangs.)"""

    async def hanging_app(scope, receive, send):
        await asyncio.Event().wait()

    async def main():
        sent, calls = [], 0

        async def send(message):
            sent.append(message)

        async def receive():
            nonlocal calls
            calls += 1
            if calls == 1:
                return {"type": "http.request", "body": b"", "more_body": False}
            await asyncio.Event().wait()  # the client stays

        guard = Guard(hanging_app, Limits(), Access(), Metrics())
        scope = {"type": "http", "method": "GET", "path": "/info", "headers": []}
        task = asyncio.ensure_future(guard(scope, receive, send))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return sent, guard.metrics.render()[0].decode()

    sent, metrics = asyncio.run(main())
    assert sent[0]["status"] == 503 and (b"retry-after", b"1") in sent[0]["headers"]
    assert b"shutting down" in sent[1]["body"]
    assert 'multihead_requests_total{endpoint="/info",status="503"} 1.0' in metrics
