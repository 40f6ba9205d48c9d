"""Connections that never finish their headers (service/server/http_guard.py), against a real
server: a half-sent request or WebSocket handshake gets a 408 and is closed after
`--header-timeout-s`, and sockets held open past `--max-connections` push out the longest
waiting one, so a client that sends its request at once is still answered."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from benchmarks.reconnect_flood import closed_counts
from service.server.http_guard import PUSHED_OUT
from tests.api.server import ServerProcess, running_server

pytestmark = [pytest.mark.server, pytest.mark.real_model, pytest.mark.timeout(300)]

HEADER_TIMEOUT_S = 2
MAX_CONNECTIONS = 8
# 40 clients holding ~53 sockets each: under the cap per address (64), past the one on all
# connections waiting (--max-connections, 512) and into the file descriptors kept back.
SOURCES = [f"127.0.0.{n}" for n in range(2, 42)]
HALF_HANDSHAKE = b"GET /v1/chat HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_server(
        tmp_path_factory.mktemp("guard"),
        *("--header-timeout-s", str(HEADER_TIMEOUT_S)),
        *("--max-connections", str(MAX_CONNECTIONS)),
    ) as server:
        yield server


def half_open(server: ServerProcess, data: bytes = HALF_HANDSHAKE) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.sendall(data)
    return sock


def read_to_close(sock: socket.socket) -> bytes:
    reply = b""
    while chunk := sock.recv(65536):
        reply += chunk
    return reply


def closed_by_server(sock: socket.socket) -> bool:
    """The server dropped it (aborted: a reset, or closed: end of stream) with no reply."""
    try:
        return sock.recv(65536) == b""
    except ConnectionResetError:
        return True


@pytest.mark.parametrize(
    "data",
    [HALF_HANDSHAKE, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Le", b""],
    ids=["websocket-handshake", "post-headers", "nothing"],
)
def test_headers_that_never_finish_get_a_408_and_the_connection_closed(
    server: ServerProcess, data: bytes
) -> None:
    with half_open(server, data) as sock:
        started = time.monotonic()
        reply = read_to_close(sock)
    assert reply.startswith(b"HTTP/1.1 408 "), reply
    # Not before the timeout (the test's bound is loose: it is the server's deadline, not a
    # speed, that is checked).
    assert time.monotonic() - started >= HEADER_TIMEOUT_S - 0.5
    assert "no request headers within 2 s" in server.log()


def test_held_sockets_past_the_cap_push_out_the_oldest_and_health_still_answers(
    server: ServerProcess,
) -> None:
    held = [half_open(server) for _ in range(3 * MAX_CONNECTIONS)]
    try:
        # Each new one closed the longest waiting: all but the last MAX_CONNECTIONS are gone.
        for sock in held[: 2 * MAX_CONNECTIONS]:
            sock.settimeout(HEADER_TIMEOUT_S / 2)  # closed already, not timed out later
            assert closed_by_server(sock)
        assert server.get("/health")[0] == 200
    finally:
        for sock in held:
            sock.close()
    # Counted in a line per interval, not one line each (service/server/connection_log.py).
    assert wait_for_closed(server, PUSHED_OUT, 2 * MAX_CONNECTIONS) >= 2 * MAX_CONNECTIONS


def wait_for_closed(server: ServerProcess, kind: str, count: int, timeout: float = 60.0) -> int:
    """How many connections of `kind` the server's log says it closed, once it says `count` or
    `timeout` has passed (the counts of an interval are written at its end)."""
    deadline = time.monotonic() + timeout
    while (seen := closed_counts(server.log())[kind]) < count and time.monotonic() < deadline:
        time.sleep(0.5)
    return seen


def test_a_kept_alive_connections_next_request_is_bounded_too(server: ServerProcess) -> None:
    with half_open(server, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n") as sock:
        first = sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200 "), first
        sock.sendall(b"GET /health HTTP/1.1\r\nHo")  # the next request, never finished
        reply = read_to_close(sock)
    assert b"HTTP/1.1 408 " in reply, reply


def test_2100_half_open_handshakes_against_2048_files_leave_every_probe_answered() -> None:
    """The must-show of the slowloris fix, as benchmarks/held_sockets.py runs it: the bundled
    model's server under `prlimit --nofile=2048`, 2,100 sockets each holding half a
    WebSocket handshake; meanwhile /health, a WebSocket handshake and a chat completion each
    answer twice, every held socket is closed by the server, and the log stays short (one
    line per rate-limit window, not one per failed accept)."""
    import resource

    from benchmarks import held_sockets

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2300:
        pytest.fail(f"this process may hold {hard} files; the test needs 2,300")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2300), hard))
    try:
        held = held_sockets.run(
            sockets=2100, nofile=2048, probes=2, hold_s=12.0, server_args=[], sources=SOURCES
        )
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert held.all_answered, held.probes
    assert held.closed == 2100
    assert held.log.count("\n") < 2100 + 200, held.log[-2000:]  # a line per closed socket at most
    assert held.log.count("Too many open files") <= 5
