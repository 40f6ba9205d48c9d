"""The listening socket: the first gate a connection passes, before asyncio makes anything of it.

asyncio's accept loop (`loop.create_server(sock=...)`) calls the listening socket's `accept()`
up to `backlog` times each time it is readable and hands each connection to a task of its own,
which makes the protocol a turn of the loop later. Out of file descriptors (EMFILE) it logs the
error and stops accepting for a second while the backlog fills. So one client that reopens every
socket the server closes fills the process's descriptors and the backlog, and everyone else
waits seconds for an answer or gets none (issue 39). `GuardedListener.accept` decides first:

- once half the descriptors below the reserve are in use, a client address may have
  `max_pending_per_address` connections waiting for their headers (service/server/http_guard.py
  `Waiting`); one more is reset (RST: no TIME_WAIT left behind) as it is accepted, costing an
  accept(), a peek and a close() and no task, unless its request's headers are in already (a burst
  of clients that send their requests at once, or /health from behind the same NAT as a flood,
  still gets in). Peers in `trusted_proxies` and a Unix socket's are exempt: each stands for many
  clients;
- the last `fd_reserve` descriptors of the process's open-file limit are kept back
  (`OpenFiles` counts what is held): a connection accepted into them is kept only if the
  connection that has waited longest for its headers can be pushed out for it, else it is
  reset. A client that sends its request at once (/health, a chat turn) still gets in, and
  what the process opens on its own (Redis connections, files) still finds a descriptor;
- at most `ACCEPTS_PER_TURN` connections, kept or reset, per turn of the event loop: the rest
  wait in the backlog (the socket is level-triggered, so the next turn takes them), and the
  connections already open are served in between;
- one spare descriptor is held for EMFILE all the same (the process may open files of its own
  past the reserve): it is given up to accept the next connection, which is then judged as one
  in the reserve, instead of asyncio's second without accepting; with the spare gone, the one
  waiting longest is pushed out to make room for the next turn, and only with none waiting
  does asyncio get the error (and wait its second).
Each reset is counted in the `ConnectionLog`, not logged one by one.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import math
import os
import resource
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from service.server.connection_log import ConnectionLog
from service.server.http_guard import RESET, Waiting

ACCEPTS_PER_TURN = 64
CAPPED_FROM = 0.5  # AcceptPolicy.capped_from
HEADERS_PEEKED = 8192  # bytes looked at for a request's end of headers (h11's own cap: 16 KiB)
_OUT_OF_FILES = (errno.EMFILE, errno.ENFILE)


class OpenFiles:
    """The process's open file descriptors against its open-file limit (the soft one), counted
    cheaply enough for every accept(): the connections the listener kept and that are not yet
    closed, exactly (their sockets count themselves out as they close), plus all the rest (the
    model, Redis connections, logs, the spare) as of a listing of /proc/self/fd taken at most
    every `recount_s` (a listing takes ~5 ms per 2,000 descriptors)."""

    def __init__(
        self,
        reserve: int,
        limit: int | None = None,
        *,
        recount_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if reserve < 0:
            raise ValueError("reserve must be >= 0")
        if limit is None:
            soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            limit = soft if soft != resource.RLIM_INFINITY else 2**31
        self.limit, self.reserve, self.recount_s = limit, reserve, recount_s
        self.connections = 0
        self._others = 0
        self._counted_at = -math.inf
        self._clock = clock
        files = self

        class Connection(socket.socket):
            """An accepted socket that counts itself out when it closes."""

            def close(self) -> None:
                if self.fileno() != -1:
                    files.connections -= 1
                super().close()

        self.connection_class = Connection

    def held(self, fd: int) -> int:
        """The descriptors held, the connection just accepted on `fd` (not yet counted)
        included: at least `fd` + 1, as accept() returns the lowest free one (POSIX)."""
        now = self._clock()
        if now - self._counted_at >= self.recount_s:
            self._counted_at = now
            listed = _count_open()
            if listed is not None:  # less the listing's own descriptor and `fd`
                self._others = max(0, listed - 2 - self.connections)
        return max(self._others + self.connections + 1, fd + 1)

    def low(self, fd: int) -> bool:
        """Whether the process is down to its reserve, the connection on `fd` included."""
        return self.held(fd) > self.limit - self.reserve

    def in_use(self, fd: int) -> float:
        """The share of the descriptors below the reserve held, `fd`'s included."""
        return self.held(fd) / max(self.limit - self.reserve, 1)

    def kept(self, fd: int, family: int, kind: int, proto: int) -> socket.socket:
        """The socket of a connection kept, counted in until it closes."""
        self.connections += 1
        return self.connection_class(family, kind, proto, fileno=fd)


def _count_open() -> int | None:
    for listing in ("/proc/self/fd", "/dev/fd"):
        try:
            return len(os.listdir(listing))
        except OSError:
            continue
    return None


@dataclass(slots=True)
class AcceptPolicy:
    """What `GuardedListener.accept` keeps (see the module's docstring)."""

    waiting: Waiting
    closed_log: ConnectionLog
    files: OpenFiles
    max_pending_per_address: int
    trusted_proxies: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()
    # The cap applies once this share of the descriptors below the reserve is in use: a
    # burst of clients from one address (a load test, a NAT) that the process has the
    # descriptors for is served whole, while a flood is held to half of them
    capped_from: float = CAPPED_FROM

    def __post_init__(self) -> None:
        if self.max_pending_per_address < 1:
            raise ValueError("max_pending_per_address must be >= 1")

    def capped(self, address: str) -> bool:
        """Whether `address`'s waiting connections are capped: not a proxy's or a Unix
        socket's."""
        if not address:
            return False
        if not self.trusted_proxies:
            return True
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return True
        return not any(ip in network for network in self.trusted_proxies)

    def judge(self, fd: int, address: str, *, low: bool) -> str | None:
        """None: keep the connection just accepted on `fd` from `address` (counted as waiting);
        else why it is reset. `low`: accepted on the spare's descriptor."""
        if (
            self.waiting.of(address) >= self.max_pending_per_address
            and self.capped(address)
            and self.files.in_use(fd) >= self.capped_from
            and not headers_in(fd)
        ):
            return (
                f"reset as accepted (the address had {self.max_pending_per_address}"
                " connections waiting for their headers)"
            )
        if (low or self.files.low(fd)) and not self.waiting.push_out_oldest():
            return "reset as accepted (file descriptors low, none waiting for headers to push out)"
        self.waiting.accepted(fd, address)
        return None


def headers_in(fd: int) -> bool:
    """Whether the connection on `fd` has a request's headers in full in its receive buffer,
    read without taking them (MSG_PEEK): a client that sends its request at once."""
    probe = socket.socket(fileno=fd)
    try:
        head = probe.recv(HEADERS_PEEKED, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except OSError:  # nothing yet (EAGAIN), or reset
        head = b""
    finally:
        probe.detach()
    return b"\r\n\r\n" in head


class GuardedListener(socket.socket):
    """A listening socket whose accept() keeps only what `policy` admits (module docstring).
    Made like any socket; `policy` is set before the server starts accepting."""

    policy: AcceptPolicy
    _spare: int | None = None
    _seen = 0  # connections accepted (kept or reset) in this turn of the loop
    _turn_ends: asyncio.Handle | None = None
    _told_out_of_files = False  # in this turn

    def accept(self) -> tuple[socket.socket, Any]:
        if self._turn_ends is None:
            self._turn_ends = asyncio.get_running_loop().call_soon(self._next_turn)
        if self._spare is None:
            self._spare = _open_spare()
        while self._seen < ACCEPTS_PER_TURN:
            self._seen += 1
            fd, peer, spare_given = self._accept_one()
            address = peer[0] if isinstance(peer, tuple) else ""
            reason = self.policy.judge(fd, address, low=spare_given)
            if reason is None:
                return self.policy.files.kept(fd, self.family, self.type, self.proto), peer
            conn = socket.socket(self.family, self.type, self.proto, fileno=fd)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, RESET)
            conn.close()
            self.policy.closed_log.closed(reason, address)
        raise BlockingIOError  # the rest next turn: see the module's docstring

    def _accept_one(self) -> tuple[int, Any, bool]:
        """The next connection's descriptor and peer, and whether the spare was given up for
        it; BlockingIOError when none is waiting, or none can be taken in this turn."""
        try:
            fd, peer = self._accept()  # type: ignore[attr-defined]
            return fd, peer, False
        except OSError as exc:
            if exc.errno not in _OUT_OF_FILES:
                raise
            if self._spare is None:
                self._out_of_files()
        os.close(self._spare)
        self._spare = None
        fd, peer = self._accept()  # type: ignore[attr-defined]
        return fd, peer, True

    def _out_of_files(self) -> NoReturn:
        """EMFILE with the spare given up already. NOTE: asyncio's accept loop (3.11) goes on
        calling accept() after an EMFILE, logging each and setting a timer each to accept
        again a second later; so it is told once per turn, and not at all while a connection
        waiting for its headers can be pushed out to make room for the next turn."""
        if self.policy.waiting.push_out_oldest() or self._told_out_of_files:
            raise BlockingIOError
        self._told_out_of_files = True
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))  # it waits a second

    def _next_turn(self) -> None:
        self._seen = 0
        self._turn_ends = None
        self._told_out_of_files = False

    def close(self) -> None:
        if self._spare is not None:
            os.close(self._spare)
            self._spare = None
        super().close()


def _open_spare() -> int | None:
    try:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None


def bind(host: str, port: int, policy: AcceptPolicy) -> list[GuardedListener]:
    """Listening sockets for `host` and `port` as asyncio's create_server binds them (each
    address `host` resolves to; an IPv6 one IPv6 only), accepting through `policy`."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    listeners: list[GuardedListener] = []
    try:
        for family, kind, proto, _name, address in dict.fromkeys(infos):
            sock = GuardedListener(family, kind, proto)
            listeners.append(sock)
            sock.policy = policy
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
    except OSError:
        for sock in listeners:
            sock.close()
        raise
    return listeners
