"""What every request passes before a handler sees it: the Host check, OPTIONS and CORS, the API
key, the JSON content type, the body's size and read deadline; then the handler runs, and is
cancelled if its client goes away. Every answer, refusals included, is counted in the metrics.

Order of the checks (the first that fails answers): 421 Host not allowed, OPTIONS answered,
401 no or wrong API key, 415 a POST body that is not JSON, 413 a declared length over the
limit (answered before any of the body is read), 408 a body not received within its deadline,
413 a body over the limit; a body cut short by a disconnect is dropped without an answer.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._flags import option
from .metrics import Metrics

__all__ = ["METHODS", "ROUTES", "Access", "Guard", "error_body", "is_loopback_host"]

# every route and its method; POST routes take a JSON body
METHODS = {
    "/embed": "POST",
    "/v1/embeddings": "POST",
    "/attention": "POST",
    "/view": "GET",
    "/health": "GET",
    "/info": "GET",
    "/metrics": "GET",
}
ROUTES = tuple(METHODS)
_OPEN = ("/health",)  # answered without the API key: load balancers probe it
_CLIENT_GONE = 499  # nginx's status for a client that closed the connection before the answer


def error_body(path: str, status: int, message: str, kind: str) -> dict[str, Any]:
    """TEI's error shape, or OpenAI's under ``/v1/`` (what the clients of each parse)."""
    if path.startswith("/v1/"):
        return {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return {"error": message, "error_type": kind}


def is_loopback_host(host: str) -> bool:
    """Whether a host name or address (no port) can only mean this machine."""
    host = host.lower().rstrip(".")
    if host == "localhost" or host.endswith(".localhost"):  # RFC 6761: never leaves the host
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Access:
    """Who may call the service.

    api_key: when set, every route but ``/health`` needs ``Authorization: Bearer <key>``.
    allowed_hosts: Host names accepted besides the loopback ones (``"*"``: any).
    cors_origin: the one browser origin (``https://app.example``, or ``"*"``) whose pages may
        read the answers; None sends no CORS header at all.
    loopback: the server listens on a loopback address, so only a Host naming this machine
        (or one of ``allowed_hosts``) is answered: a web page whose name was rebound to
        127.0.0.1 (DNS rebinding) sends its own name and is refused.
    """

    api_key: str | None = option(
        None,
        "require 'Authorization: Bearer KEY' on every route but /health "
        "(default: $MULTIHEAD_API_KEY; the environment keeps it out of the process list)",
        metavar="KEY",
    )
    allowed_hosts: tuple[str, ...] = option(
        (),
        "Host names answered besides localhost, 127.0.0.1 and [::1] when listening on a "
        "loopback address ('*': any)",
        metavar="NAME",
    )
    cors_origin: str | None = option(
        None,
        "the browser origin (https://app.example, or '*') allowed to read answers; default: "
        "no CORS headers",
        metavar="ORIGIN",
    )
    loopback: bool = True  # set from the address the server listens on, not a flag

    def __post_init__(self) -> None:
        key = self.api_key
        if key is not None and (not isinstance(key, str) or not key or key != key.strip()):
            raise ValueError(
                "api_key must be a non-empty string without surrounding spaces. Received: "
                f"a {type(key).__name__} of length {len(key) if isinstance(key, str) else '?'}"
            )
        if isinstance(self.allowed_hosts, str) or not all(
            isinstance(h, str) and h and _host_name(h) == h for h in self.allowed_hosts
        ):
            raise ValueError(
                "allowed_hosts must be host names without a port, such as ('api.example',). "
                f"Received: {self.allowed_hosts!r}"
            )
        _check_origin(self.cors_origin)

    def host_allowed(self, host: str) -> bool:
        if not self.loopback or "*" in self.allowed_hosts or is_loopback_host(host):
            return True
        return host.lower().rstrip(".") in {h.lower() for h in self.allowed_hosts}


def _check_origin(origin: object) -> None:
    """``Access.cors_origin``: None, "*", or scheme://host[:port] without a path."""
    if origin is None or origin == "*":
        return
    if (
        not isinstance(origin, str)
        or not origin.startswith(("http://", "https://"))
        or origin.count("/") != 2
    ):
        raise ValueError(
            "cors_origin must be '*' or an origin such as 'https://app.example' (scheme, "
            f"host, optional port; no path). Received: {origin!r}"
        )


def _header(scope: dict, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


def _host_name(host: str) -> str:
    """The name part of a Host header: ``[::1]:8080`` -> ``[::1]``, ``a.b:80`` -> ``a.b``."""
    if host.startswith("["):
        return host.split("]", 1)[0] + "]"
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class _Answer(Exception):
    """An answer given before the app runs: a refusal, or the OPTIONS reply (204)."""

    def __init__(self, status: int, message: str, kind: str, headers: dict[str, str]) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.headers = status, message, kind, headers


class Guard:
    """ASGI wrapper around the app; ``limits`` is the app's ``Limits``, ``access`` its
    ``Access``. Attributes of the wrapped app (``state``) stay reachable through it."""

    def __init__(self, app: Any, limits: Any, access: Access, metrics: Metrics) -> None:
        self.app, self.limits, self.access, self.metrics = app, limits, access, metrics

    def __getattr__(self, name: str) -> Any:
        return getattr(self.app, name)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":  # the lifespan
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        path = scope.get("path", "")
        status = {"code": 500, "started": False}  # 500 if the app fails before answering
        cors = self._cors_headers(scope)

        async def sending(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"], status["started"] = message["status"], True
                if cors:
                    message = {**message, "headers": [*message.get("headers", ()), *cors]}
            await send(message)

        try:
            try:
                self._check(scope)
                body = await self._read(scope, receive)
            except _Answer as err:
                await self._refuse(path, err, sending)
                return
            if body is None:  # the client left before its body was whole: nothing to answer
                status["code"] = _CLIENT_GONE
                return
            if await self._run(scope, body, receive, sending):
                status["code"] = _CLIENT_GONE
        except asyncio.CancelledError:
            # the server's last resort at shutdown: answer 503 rather than uvicorn's 500
            if not status["started"]:
                err = _Answer(503, "the server is shutting down; retry. Received: a request "
                               "still unanswered at the end of the shutdown", "Unavailable",
                               {"Retry-After": "1"})  # fmt: skip
                await self._refuse(path, err, sending)
            raise
        finally:
            endpoint = path if path in METHODS else "other"
            self.metrics.observe(endpoint, status["code"], time.perf_counter() - start)

    def _check(self, scope: dict) -> None:
        """Host, OPTIONS, API key and content type, in this order; raise _Answer."""
        path, method = scope.get("path", ""), scope.get("method", "GET")
        host = _header(scope, b"host")
        if host is not None and not self.access.host_allowed(_host_name(host)):
            raise _Answer(
                421,
                "this server listens on a loopback address and answers only requests for "
                "localhost, 127.0.0.1 or [::1]; to reach it under another name, start it with "
                f"--allowed-hosts NAME. Received: Host: {host[:100]}",
                "MisdirectedRequest",
                {},
            )
        if method == "OPTIONS":
            raise self._options(scope, path)
        if self.access.api_key is not None and path not in _OPEN:
            self._authorize(scope)
        if method == "POST" and METHODS.get(path) == "POST":
            kind = (_header(scope, b"content-type") or "").split(";", 1)[0].strip().lower()
            if kind != "application/json":
                raise _Answer(
                    415,
                    f"the request body must be JSON, sent with 'Content-Type: application/json'. "
                    f"Received: Content-Type: {kind or '(none)'}",
                    "UnsupportedMediaType",
                    {},
                )

    def _authorize(self, scope: dict) -> None:
        header = _header(scope, b"authorization") or ""
        scheme, _, token = header.partition(" ")
        # equal-length digests, compared in constant time: neither the key's characters nor
        # its length show in how long a refusal takes
        sent = hashlib.sha256(token.strip().encode()).digest()
        expected = hashlib.sha256(self.access.api_key.encode()).digest()
        if scheme.lower() != "bearer" or not hmac.compare_digest(sent, expected):
            received = "no Authorization header" if not header else f"{scheme[:20]} credentials"
            if header and scheme.lower() == "bearer":
                received = "a wrong key"
            raise _Answer(
                401,
                "this server needs an API key: send 'Authorization: Bearer <key>' (the key given "
                f"to --api-key or MULTIHEAD_API_KEY). Received: {received}",
                "Unauthorized",
                {"WWW-Authenticate": 'Bearer realm="multihead"'},
            )

    def _options(self, scope: dict, path: str) -> _Answer:
        """OPTIONS: 204 naming the route's methods (with the CORS preflight answer only for
        the configured origin); 404 for an unknown route."""
        if path not in METHODS:
            return _Answer(404, f"Not Found (OPTIONS {path}); routes: {list(ROUTES)}",
                            "NotFound", {})  # fmt: skip
        headers = {"Allow": f"{METHODS[path]}, OPTIONS"}
        if self._cors_headers(scope):
            headers |= {
                "Access-Control-Allow-Methods": f"{METHODS[path]}, OPTIONS",
                "Access-Control-Allow-Headers": "authorization, content-type",
                "Access-Control-Max-Age": "600",
            }
        return _Answer(204, "", "", headers)

    def _cors_headers(self, scope: dict) -> list[tuple[bytes, bytes]]:
        allowed, origin = self.access.cors_origin, _header(scope, b"origin")
        if allowed is None or origin is None or allowed not in ("*", origin):
            return []
        return [(b"access-control-allow-origin", allowed.encode()), (b"vary", b"Origin")]

    async def _read(self, scope: dict, receive: Callable) -> bytes | None:
        """The whole body; None when the client left before sending all of it. Refuses (413)
        a declared length over the limit before reading, and a body not whole within
        ``body_timeout_s`` (408)."""
        limit = self.limits.payload_limit
        declared = _header(scope, b"content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > limit:
            raise self._too_large(f"Content-Length: {declared.strip()[:30]}")
        deadline = time.monotonic() + self.limits.body_timeout_s
        chunks, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0))
            except asyncio.TimeoutError:  # TimeoutError only from Python 3.11
                raise _Answer(
                    408,
                    f"the request body did not arrive within {self.limits.body_timeout_s:g} s "
                    f"(body_timeout_s); send it at once. Received: {size} bytes",
                    "RequestTimeout",
                    {},
                ) from None
            if message["type"] != "http.request":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:  # a body without a declared length
                raise self._too_large(f"more than {limit} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _too_large(self, received: str) -> _Answer:
        return _Answer(
            413,
            f"the request body is larger than the limit of {self.limits.payload_limit} bytes "
            f"(payload_limit); send fewer or shorter texts. Received: {received}",
            "PayloadTooLarge",
            {},
        )

    async def _run(self, scope: dict, body: bytes, receive: Callable, send: Callable) -> bool:
        """Run the app on ``body``; cancel it if the client leaves first (its batcher job is
        then dropped). True when the client left before the answer."""
        gone = asyncio.ensure_future(receive())  # http.disconnect: client gone, or answer sent
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await asyncio.shield(gone)

        task = asyncio.ensure_future(self.app(scope, replay, send))
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                task.result()
                return False
            task.cancel()
            await asyncio.wait({task})  # its CancelledError stays in it; ours would propagate
            return True
        finally:
            for pending in (task, gone):
                pending.cancel()

    async def _refuse(self, path: str, err: _Answer, send: Callable) -> None:
        """Answer a refusal; a refused body is not read, so the connection closes after."""
        body = b"" if err.status == 204 else json.dumps(
            error_body(path, err.status, err.message, err.kind)
        ).encode()  # fmt: skip
        headers = [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
        if body:
            headers.append((b"content-type", b"application/json"))
        headers.append((b"content-length", str(len(body)).encode()))
        if err.status in (408, 413):
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": err.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
