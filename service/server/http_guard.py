"""Connections that never finish their request's headers: timed out, and capped.

uvicorn's HTTP protocol (h11) waits for a request's headers as long as the client likes, and a
connection counts nowhere until its request reaches the app, so a few thousand sockets that
each send half a request line ("slowloris") hold as many file descriptors until the process
runs out. `guarded_h11` makes uvicorn's protocol class with two bounds:
- each request's headers (the first on a connection, or the next on a kept-alive one) must be
  complete within `header_timeout_s` of its first byte (of the connection, for the first);
  past it the client gets a 408 and the connection is closed;
- at most `max_pending` connections may be waiting for their headers at once; a new one past
  that closes the one that has waited longest, so a client that sends its request at once (a
  health check, a chat page) still gets through while sockets are being held open.
WebSocket handshakes are requests like any other here: their headers are bounded the same way.
One line is logged per connection dropped, at INFO: a client's doing, not the server's.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)

_TIMEOUT_BODY = b"the request's headers took too long\n"
_TIMEOUT_REPLY = (
    b"HTTP/1.1 408 Request Timeout\r\nContent-Type: text/plain; charset=utf-8\r\n"
    b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(_TIMEOUT_BODY), _TIMEOUT_BODY)
)


def guarded_h11(header_timeout_s: float, max_pending: int) -> type[H11Protocol]:
    """uvicorn's h11 protocol with the bounds above (pass it as `uvicorn.Config(http=...)`)."""
    if header_timeout_s <= 0 or max_pending < 1:
        raise ValueError("header_timeout_s must be > 0 and max_pending >= 1")
    # This server's connections awaiting headers, the longest waiting first.
    pending: dict[GuardedH11Protocol, None] = {}

    class GuardedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            if len(pending) >= max_pending:
                oldest = next(iter(pending))
                log.info(
                    "%s: closed: %d connections were waiting for their headers, it longest",
                    _peer(oldest), len(pending),
                )  # fmt: skip
                oldest._headers_done()
                oldest.transport.abort()
            self._await_headers()

        def data_received(self, data: bytes) -> None:
            if self.conn.their_state is h11.IDLE and self._header_timer is None:
                self._await_headers()  # the first bytes of a kept-alive connection's next request
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:
                self._headers_done()

        def connection_lost(self, exc: Exception | None) -> None:
            self._headers_done()
            super().connection_lost(exc)

        def _await_headers(self) -> None:
            pending[self] = None
            self._header_timer = self.loop.call_later(header_timeout_s, self._headers_too_slow)

        def _headers_done(self) -> None:
            pending.pop(self, None)
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            pending.pop(self, None)
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return
            log.info(
                "%s: no request headers within %g s: 408, closed", _peer(self), header_timeout_s
            )
            self.transport.write(_TIMEOUT_REPLY)
            self.transport.close()

    GuardedH11Protocol.pending = pending  # type: ignore[attr-defined]  # for tests
    return GuardedH11Protocol


def _peer(protocol: H11Protocol) -> str:
    client = protocol.client
    return f"{client[0]}:{client[1]}" if client else "a client"
