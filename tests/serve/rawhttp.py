"""Raw HTTP/1.1 over a socket, for what httpx will not do: send half a request, stall, leave."""

from __future__ import annotations

import socket
import time

from multihead.serve import Background


def connect(running: Background, data: bytes = b"") -> socket.socket:
    """A raw TCP connection to the server that has sent ``data`` (a request, or part of one)."""
    sock = socket.create_connection(("127.0.0.1", running.port), timeout=10)
    if data:
        sock.sendall(data)
    return sock


def read_until_closed(sock: socket.socket, timeout: float) -> tuple[bytes, bool]:
    """Everything the server sends within ``timeout`` s, and whether it closed the connection
    by then (False: still open when the time was up)."""
    deadline = time.monotonic() + max(timeout, 0.01)
    received = b""
    try:
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                return received, False
            except ConnectionResetError:
                return received, True
            if not chunk:
                return received, True
            received += chunk
        return received, False
    finally:
        sock.close()


def request_head(method: str, path: str, headers: dict[str, str]) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()
