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
`Waiting` keeps those connections, with how many each client address has, for the listening
socket (service/server/listener.py), which caps them per address as they are accepted. What is
closed is logged as counts per interval (service/server/connection_log.py): a client's doing,
not the server's, and a flood of it must not flood the log.
"""

from __future__ import annotations

import asyncio
import collections
import socket
import struct
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from service.server.connection_log import ConnectionLog

_TIMEOUT_BODY = b"the request's headers took too long\n"
_TIMEOUT_REPLY = (
    b"HTTP/1.1 408 Request Timeout\r\nContent-Type: text/plain; charset=utf-8\r\n"
    b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(_TIMEOUT_BODY), _TIMEOUT_BODY)
)
PUSHED_OUT = "pushed out for a newer one (the longest waiting for its headers)"
RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends RST, leaving no TIME_WAIT


class Waiting:
    """One server's connections waiting for their request's headers: their protocols, the
    longest waiting first, and how many each client address has.

    NOTE (counted from accept): the listening socket counts a connection under its address as
    it accepts it, by its file descriptor, before asyncio has made its protocol; the protocol
    takes the entry over and removes it once its headers are complete or it ends. An entry
    whose connection ended without a protocol (asyncio failed to make its transport) is
    dropped when accept() hands out its descriptor again.
    """

    def __init__(self) -> None:
        self.protocols: dict[GuardedH11Protocol, None] = {}
        self._by_fd: dict[int, str] = {}
        self._per_address: collections.Counter[str] = collections.Counter()

    def of(self, address: str) -> int:
        """How many of `address`'s connections are waiting."""
        return self._per_address[address]

    def accepted(self, fd: int, address: str) -> None:
        self.ended(fd)  # a stale entry: see NOTE
        self._by_fd[fd] = address
        self._per_address[address] += 1

    def begins(self, protocol: GuardedH11Protocol) -> None:
        self.protocols[protocol] = None
        if protocol.fd not in self._by_fd:  # not counted at accept (a kept-alive connection)
            self.accepted(protocol.fd, protocol.address)

    def done(self, protocol: GuardedH11Protocol) -> None:
        """`protocol`'s headers are complete, or its connection ended."""
        if self.protocols.pop(protocol, False) is None:  # it was waiting
            self.ended(protocol.fd)

    def ended(self, fd: int) -> None:
        address = self._by_fd.pop(fd, None)
        if address is not None:
            self._per_address[address] -= 1
            if not self._per_address[address]:
                del self._per_address[address]

    def push_out_oldest(self) -> bool:
        """Close the connection that has waited longest; False if none is waiting."""
        if not self.protocols:
            return False
        oldest = next(iter(self.protocols))
        oldest.push_out()
        return True


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the bounds above; `guarded_h11` sets the class's limits."""

    header_timeout_s: float
    max_pending: int
    waiting: Waiting
    closed_log: ConnectionLog
    _header_timer: asyncio.TimerHandle | None = None
    fd = -1
    address = "a client"

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        self.fd = sock.fileno() if sock is not None else -1
        self.address = self.client[0] if self.client else "a client"
        if len(self.waiting.protocols) >= self.max_pending:
            self.waiting.push_out_oldest()
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

    def push_out(self) -> None:
        self.closed_log.closed(PUSHED_OUT, self.address)
        self._headers_done()
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, RESET)
        self.transport.abort()

    def _await_headers(self) -> None:
        self.waiting.begins(self)
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _headers_done(self) -> None:
        self.waiting.done(self)
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        self._headers_done()
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        self.closed_log.closed(
            f"with no request headers within {self.header_timeout_s:g} s (408)", self.address
        )
        self.transport.write(_TIMEOUT_REPLY)
        self.transport.close()


def guarded_h11(
    header_timeout_s: float, max_pending: int, waiting: Waiting, closed_log: ConnectionLog
) -> type[GuardedH11Protocol]:
    """uvicorn's h11 protocol with the bounds above (pass it as `uvicorn.Config(http=...)`),
    its waiting connections kept in `waiting` and what it closes counted in `closed_log`."""
    if header_timeout_s <= 0 or max_pending < 1:
        raise ValueError("header_timeout_s must be > 0 and max_pending >= 1")

    class Protocol(GuardedH11Protocol):
        pass

    Protocol.header_timeout_s, Protocol.max_pending = header_timeout_s, max_pending
    Protocol.waiting, Protocol.closed_log = waiting, closed_log
    return Protocol
