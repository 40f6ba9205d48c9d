"""Sockets held open with half a request (slowloris) against a real server with a small
open-file limit: does it still answer, and how much does it log?

Starts `pagechat serve` (embedded Redis, the bundled model) under `prlimit --nofile=LIMIT`,
opens `--sockets` connections (from `--sources` in turn, 127.0.0.2 by default: one client past
its cap of waiting connections sees the rest reset) that each send half a WebSocket handshake
and then nothing, and
while they are held asks, `--probes` times: GET /health, a WebSocket handshake, and a
one-token POST /v1/chat/completions, each with a 10 s deadline. Reported: how many of each
answered, the slowest, how many of the held sockets the server closed, and the log's size.

    .venv/bin/python -m benchmarks.held_sockets [--sockets 2100] [--nofile 2048]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import websockets

HALF_HANDSHAKE = b"GET /v1/chat HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
RUNNING = re.compile(rb"Uvicorn running on http://127\.0\.0\.1:(\d+)")


def start(
    directory: Path, nofile: int, extra: list[str]
) -> tuple[subprocess.Popen[bytes], int, Path]:
    log = directory / "server.log"
    command = [
        "prlimit", f"--nofile={nofile}", sys.executable, "-m", "service.cli", "serve",
        "--port", "0", "--data-dir", str(directory / "data"), *extra,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with log.open("wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if match := RUNNING.search(log.read_bytes()):
            return proc, int(match.group(1)), log
        if proc.poll() is not None:
            raise SystemExit(log.read_text())
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server did not start")


def probe_health(port: int) -> float | None:
    start = time.monotonic()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
            r.read()
        return time.monotonic() - start
    except OSError:
        return None


def probe_chat(port: int) -> float | None:
    body = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions", body, {"Content-Type": "application/json"}
    )
    start = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            r.read()
        return time.monotonic() - start
    except OSError:
        return None


async def _ws(port: int) -> None:
    async with websockets.connect(f"ws://127.0.0.1:{port}/v1/chat", open_timeout=10):
        pass


def probe_ws(port: int) -> float | None:
    start = time.monotonic()
    try:
        asyncio.run(asyncio.wait_for(_ws(port), 10))
        return time.monotonic() - start
    except (OSError, TimeoutError, websockets.exceptions.WebSocketException):
        return None


def answered_or_closed(sock: socket.socket) -> bool:
    """Whether the server replied on (a 408) or closed a held socket; False: still open."""
    try:
        sock.recv(65536)
    except BlockingIOError:
        return False
    except ConnectionResetError:
        pass
    return True


@dataclass
class Held:
    """What one run saw: each probe's seconds (None: no answer in time), how many held
    sockets the server closed, and its log."""

    probes: dict[str, list[float | None]]
    closed: int
    log: str

    @property
    def all_answered(self) -> bool:
        return all(t is not None for times in self.probes.values() for t in times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sockets", type=int, default=2100)
    parser.add_argument("--nofile", type=int, default=2048)
    parser.add_argument("--probes", type=int, default=5)
    parser.add_argument("--hold-s", type=float, default=30.0, help="how long the sockets are held")
    parser.add_argument(
        "--sources", default="127.0.0.2", help="the held sockets' addresses, comma-separated"
    )
    parser.add_argument("server_args", nargs="*", help="more `pagechat serve` options")
    opts = parser.parse_args(argv)
    sources = opts.sources.split(",")
    held = run(opts.sockets, opts.nofile, opts.probes, opts.hold_s, opts.server_args, sources)
    print(f"{opts.sockets} half-open sockets held {opts.hold_s:g} s, server nofile {opts.nofile}")
    for name, times in held.probes.items():
        ok = [t for t in times if t is not None]
        slowest = f"{max(ok):.2f} s" if ok else "-"
        print(f"  {name}: {len(ok)} / {len(times)} answered, slowest {slowest}")
    closed = f"{held.closed} / {opts.sockets}"
    print(f"  held sockets the server closed (reset, 408 or pushed out): {closed}")
    text = held.log
    print(f"  log: {text.count(chr(10))} lines, {len(text.encode()) / 1024:.0f} KiB; 'Too many "
          f"open files': {text.count('Too many open files')}")  # fmt: skip
    return 0 if held.all_answered else 1


def run(
    sockets: int,
    nofile: int,
    probes: int,
    hold_s: float,
    server_args: list[str],
    sources: Sequence[str] = ("127.0.0.2",),
) -> Held:
    """`sources`: the held sockets' client addresses, in turn (the probes come from
    127.0.0.1; all of 127.0.0.0/8 is loopback on Linux)."""
    turn = itertools.cycle(sources)
    with tempfile.TemporaryDirectory() as tmp:
        proc, port, log = start(Path(tmp), nofile, server_args)
        try:
            held = []
            reset = 0  # reset as they connected (one client address's cap: listener.py)
            for _ in range(sockets):
                try:
                    sock = socket.create_connection(
                        ("127.0.0.1", port), timeout=10, source_address=(next(turn), 0)
                    )
                except ConnectionResetError:
                    reset += 1
                    continue
                held.append(sock)
                with contextlib.suppress(ConnectionResetError, BrokenPipeError):
                    sock.sendall(HALF_HANDSHAKE)  # if reset, answered_or_closed counts it
                sock.setblocking(False)
            results: dict[str, list[float | None]] = {"health": [], "websocket": [], "chat": []}
            end = time.monotonic() + hold_s
            for _ in range(probes):
                results["health"].append(probe_health(port))
                results["websocket"].append(probe_ws(port))
                results["chat"].append(probe_chat(port))
            while time.monotonic() < end:
                time.sleep(0.5)
            closed = reset + sum(answered_or_closed(sock) for sock in held)
            for sock in held:
                sock.close()
        finally:
            proc.terminate()
            proc.wait(60)
        text = log.read_text(errors="replace")
    return Held(results, closed, text)


if __name__ == "__main__":
    sys.exit(main())
