"""uvicorn's HTTP/1.1 protocol (h11) with two things uvicorn lacks:

- a deadline on request headers: without it a client that opens a connection and sends half a
  header holds it forever. (The body's deadline is the ``Guard``'s job, which answers 408;
  here the connection can only be closed, since no request exists yet to answer.)
- a lingering close: an answer given before the request's body was read (413 on the declared
  length, 408) is followed by closing our side for writing and discarding what the client
  still sends, for at most ``LINGER_S``. Closing at once would make the kernel reset the
  connection, and a client still sending would see "connection reset" instead of the answer.
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["LINGER_S", "header_timeout_protocol"]

LINGER_S = 2.0  # nginx's lingering_timeout is 5 s; a client sends 2 MB over loopback in ms


def header_timeout_protocol(header_timeout_s: float) -> type[asyncio.Protocol]:
    """A uvicorn ``http=`` protocol class closing connections that do not send a whole request
    header within ``header_timeout_s`` of opening, or of their previous answer."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeoutProtocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _lingering = False

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self.transport = _Lingering(transport, self)  # what the request cycles close
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._lingering:  # the rest of a body already answered: dropped
                return
            super().data_received(data)
            if not self._awaiting_header():
                self._disarm()

        def body_unread(self) -> bool:
            return self.conn.their_state is h11.SEND_BODY

        def linger(self, transport: Any) -> None:
            self._lingering = True
            self._disarm()
            transport.write_eof()  # the answer is flushed first, then our FIN
            self.loop.call_later(LINGER_S, transport.close)

        def on_response_complete(self) -> None:
            super().on_response_complete()  # may start a pipelined request
            if self._awaiting_header() and not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _awaiting_header(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(header_timeout_s, self._expired)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _expired(self) -> None:
            self._header_timer = None
            if self._awaiting_header() and not self.transport.is_closing():
                self.transport.close()

    return HeaderTimeoutProtocol


class _Lingering:
    """The connection's transport, except that ``close`` while the client is still sending a
    body lingers (see the module docstring) instead of resetting the connection."""

    def __init__(self, transport: Any, protocol: Any) -> None:
        self._transport, self._protocol, self._closing = transport, protocol, False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self._closing or self._transport.is_closing()

    def close(self) -> None:
        if self._closing or self._transport.is_closing():
            return
        self._closing = True
        if self._protocol.body_unread() and self._transport.can_write_eof():
            self._protocol.linger(self._transport)
        else:
            self._transport.close()
