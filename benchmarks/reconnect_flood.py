"""A reconnect flood against a real server at its open-file limit: does everyone else still get
answers, and how much does it log?

Starts `pagechat serve` (embedded Redis, the bundled model) under `prlimit --nofile=LIMIT`.
A flood process then keeps `--sockets` connections from one address (`--sources`, 127.0.0.2:
all of 127.0.0.0/8 is loopback on Linux, so the server sees another client; several spread
the sockets over as many clients) each holding half a WebSocket handshake, and opens a new one
for every socket the server ends. Meanwhile, from 127.0.0.1: GET /health once a second
(`--probes` times, each with a 10 s deadline), then a WebSocket chat turn and a chat
completion, twice each. Reported: each probe's seconds (and once before the flood), the
flood's connects and ends, the server's log lines and the most files it held.

    .venv/bin/python -m benchmarks.reconnect_flood [--sockets 2100] [--nofile 2048] [--seconds 40]
    .venv/bin/python -m benchmarks.reconnect_flood --flood-only --port 8000 --sockets 2100
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import errno
import itertools
import json
import os
import re
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks.held_sockets import HALF_HANDSHAKE, start
from clients.chat_client import ChatClient

_REOPEN = (errno.ECONNREFUSED, errno.ECONNRESET, errno.ETIMEDOUT, errno.EPIPE)


@dataclass
class FloodCounts:
    """What the flood did: connects begun; connections that got as far as sending their half
    handshake; sockets the server ended (reset as accepted, closed, pushed out, a 408); other
    failed connects (refused, timed out); the sockets open when it stopped."""

    opened: int = 0
    held: int = 0
    ended_by_server: int = 0
    connect_failed: int = 0
    open_at_end: int = 0
    seconds: float = 0.0


def flood(
    port: int, sockets: int, sources: list[str], seconds: float, stop: threading.Event
) -> FloodCounts:
    """Keep `sockets` connections to 127.0.0.1:`port`, from `sources` in turn, each sending
    half a WebSocket handshake; reopen each one the server ends, at once, for `seconds` or
    till `stop` is set."""
    counts = FloodCounts()
    selector = selectors.DefaultSelector()
    turn = itertools.cycle(sources)

    def open_one() -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.bind((next(turn), 0))
        counts.opened += 1
        code = sock.connect_ex(("127.0.0.1", port))
        if code not in (0, errno.EINPROGRESS):
            counts.connect_failed += 1
            sock.close()
            return
        selector.register(sock, selectors.EVENT_WRITE, "connecting")

    def reopen(sock: socket.socket, code: int) -> None:
        if code in (0, errno.ECONNRESET, errno.EPIPE):
            counts.ended_by_server += 1
        else:
            counts.connect_failed += 1
        selector.unregister(sock)
        sock.close()
        open_one()

    for _ in range(sockets):
        open_one()
    start_time = time.monotonic()
    end = start_time + seconds
    while (now := time.monotonic()) < end and not stop.is_set():
        # Connects that failed at once are retried here, so the flood keeps its size.
        for _ in range(sockets - len(selector.get_map())):
            open_one()
        for key, _events in selector.select(timeout=min(0.1, end - now)):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            if key.data == "connecting":
                code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if code != 0:
                    reopen(sock, code)
                    continue
                try:
                    sock.send(HALF_HANDSHAKE)
                except OSError as exc:
                    reopen(sock, exc.errno or 0)
                    continue
                counts.held += 1
                selector.modify(sock, selectors.EVENT_READ, "held")
                continue
            try:
                data = sock.recv(65536)
            except BlockingIOError:
                continue
            except OSError as exc:
                if exc.errno not in _REOPEN:
                    raise
                data = b""
            if not data or data.startswith(b"HTTP/"):  # closed, reset or a 408: a new one
                reopen(sock, 0)
    counts.seconds = time.monotonic() - start_time
    counts.open_at_end = len(selector.get_map())
    for key in list(selector.get_map().values()):
        key.fileobj.close()  # type: ignore[union-attr]
    return counts


# ---------------------------------------------------------------------- probes


def probe_health(port: int) -> float | None:
    """Seconds /health took from 127.0.0.1, None if it did not answer 200 within 10 s."""
    start_time = time.monotonic()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as reply:
            reply.read()
            ok = reply.status == 200
    except OSError:
        return None
    return time.monotonic() - start_time if ok else None


def probe_completion(port: int) -> float | None:
    body = json.dumps(
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
    ).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions", body, {"Content-Type": "application/json"}
    )
    start_time = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            answer = json.loads(reply.read())
    except OSError:
        return None
    return time.monotonic() - start_time if answer["choices"][0]["message"]["content"] else None


async def _chat_turn(port: int) -> str:
    async with await ChatClient.connect(f"ws://127.0.0.1:{port}/v1/chat") as chat:
        await chat.open()
        answer = await chat.ask("Hi", max_tokens=4, temperature=0.0)
        return answer.finish_reason


def probe_chat_turn(port: int) -> float | None:
    """Seconds a whole WebSocket turn took (open, one question, its `done`), None if it
    failed or took over 30 s."""
    start_time = time.monotonic()
    try:
        asyncio.run(asyncio.wait_for(_chat_turn(port), 30))
    except Exception:  # any failure is the figure
        return None
    return time.monotonic() - start_time


@dataclass
class FloodRun:
    """One run: each probe's seconds (None: failed), before and during the flood; the
    flood's counts; the most files the server held at a probe; its log."""

    health: list[float | None] = field(default_factory=list)
    chat_turn: list[float | None] = field(default_factory=list)
    completion: list[float | None] = field(default_factory=list)
    before: dict[str, float | None] = field(default_factory=dict)
    flood: FloodCounts = field(default_factory=FloodCounts)
    open_files: int = 0
    flood_outlasted_probes: bool = False  # False: some probes ran after it (more --seconds)
    log: str = ""

    @property
    def all_answered(self) -> bool:
        return all(t is not None for t in [*self.health, *self.chat_turn, *self.completion])


def start_flood(
    port: int, sockets: int, sources: list[str], seconds: float
) -> subprocess.Popen[str]:
    """The flood in a process of its own (its own GIL and open-file limit); its counts come
    as one JSON line on stdout when it ends."""
    command = [
        sys.executable, "-m", "benchmarks.reconnect_flood", "--flood-only", "--port", str(port),
        "--sockets", str(sockets), "--sources", ",".join(sources), "--seconds", str(seconds),
    ]  # fmt: skip
    return subprocess.Popen(command, stdout=subprocess.PIPE, text=True)


def flood_result(proc: subprocess.Popen[str], *, stop: bool = False) -> FloodCounts:
    """The flood's counts once it ends (`stop`: end it now)."""
    if stop:
        proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"the flood failed ({proc.returncode}): {out}")
    return FloodCounts(**json.loads(out.strip().splitlines()[-1]))


def probe_during(
    port: int, flooder: subprocess.Popen[str], probes: int, pid: int | None = None
) -> FloodRun:
    """Probe from 127.0.0.1 while `flooder` runs: /health once a second `probes` times, then a
    WebSocket chat turn and a completion, twice each; then wait for the flood's counts.
    `pid`: the server's, whose open files are counted at each /health probe."""
    run = FloodRun()
    for _ in range(probes):
        began = time.monotonic()
        if pid is not None:
            run.open_files = max(run.open_files, open_files(pid))
        run.health.append(probe_health(port))
        time.sleep(max(0.0, 1.0 - (time.monotonic() - began)))
    for _ in range(2):
        run.chat_turn.append(probe_chat_turn(port))
        run.completion.append(probe_completion(port))
    run.flood_outlasted_probes = flooder.poll() is None
    run.flood = flood_result(flooder)
    return run


_CLOSED_LINE = re.compile(
    r"connections closed(?: in the last [\d.]+ s| since the last line)?: (.*); from "
)
_CLOSED_KIND = re.compile(r"([\d,]+) ([^;]+)")


def closed_counts(log: str) -> collections.Counter[str]:
    """How many connections the server's log says it closed, by kind ("reset as accepted
    (...)", "pushed out ...", "with no request headers ... (408)"), summed over its lines
    (service/server/connection_log.py)."""
    counts: collections.Counter[str] = collections.Counter()
    for line in _CLOSED_LINE.finditer(log):
        for count, kind in _CLOSED_KIND.findall(line.group(1)):
            counts[kind.strip()] += int(count.replace(",", ""))
    return counts


def open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def run(
    sockets: int,
    nofile: int,
    seconds: float,
    probes: int,
    sources: list[str],
    server_args: list[str],
) -> FloodRun:
    with tempfile.TemporaryDirectory() as tmp:
        proc, port, log = start(Path(tmp), nofile, server_args)
        try:
            before = {
                "health": probe_health(port),
                "chat_turn": probe_chat_turn(port),
                "completion": probe_completion(port),
            }
            flooder = start_flood(port, sockets, sources, seconds)
            try:
                time.sleep(2.0)  # the flood at full size first
                result = probe_during(port, flooder, probes, pid=proc.pid)
            finally:
                if flooder.poll() is None:
                    flooder.send_signal(signal.SIGTERM)
                    flooder.wait(30)
            result.before = before
        finally:
            proc.terminate()
            proc.wait(60)
        result.log = log.read_text(errors="replace")
    return result


def _seconds(times: list[float | None]) -> str:
    ok = [t for t in times if t is not None]
    slowest = f", slowest {max(ok):.2f} s" if ok else ""
    return f"{len(ok)} / {len(times)} answered{slowest}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sockets", type=int, default=2100)
    parser.add_argument("--nofile", type=int, default=2048)
    parser.add_argument("--seconds", type=float, default=40.0, help="how long the flood lasts")
    parser.add_argument("--probes", type=int, default=15, help="/health probes, one a second")
    parser.add_argument(
        "--sources", default="127.0.0.2", help="the flood's source addresses, comma-separated"
    )
    parser.add_argument("--log", type=Path, help="write the server's log here")
    parser.add_argument("--flood-only", action="store_true", help="only flood --port")
    parser.add_argument("--port", type=int, help="with --flood-only: the server's port")
    parser.add_argument("server_args", nargs="*", help="more `pagechat serve` options")
    opts = parser.parse_args(argv)
    sources = opts.sources.split(",")
    if opts.flood_only:
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        print(json.dumps(asdict(flood(opts.port, opts.sockets, sources, opts.seconds, stop))))
        return 0
    result = run(opts.sockets, opts.nofile, opts.seconds, opts.probes, sources, opts.server_args)
    f = result.flood
    clients = sources[0] if len(sources) == 1 else f"{len(sources)} addresses ({sources[0]}...)"
    print(f"{opts.sockets} reconnecting half-open sockets from {clients} for {f.seconds:.0f} s,"
          f" server nofile {opts.nofile}")  # fmt: skip
    print(f"  flood: {f.opened:,} connects ({f.opened / f.seconds:,.0f}/s), {f.held:,} held half a"
          f" handshake, {f.ended_by_server:,} ended by the server, {f.connect_failed:,} failed"
          f" otherwise")  # fmt: skip
    b = result.before
    print(f"  before the flood: /health {b['health']}, chat turn {b['chat_turn']}, completion"
          f" {b['completion']} s")  # fmt: skip
    print(f"  /health: {_seconds(result.health)}; within 1 s: "
          f"{sum(t is not None and t <= 1.0 for t in result.health)}")  # fmt: skip
    print(f"  chat turn: {_seconds(result.chat_turn)}; completion: {_seconds(result.completion)}")
    if not result.flood_outlasted_probes:
        print("  (the flood ended before the last probe: give it more --seconds)")
    text = result.log
    if opts.log is not None:
        opts.log.write_text(text)
    print(f"  log: {text.count(chr(10))} lines, {len(text.encode()) / 1024:.0f} KiB; 'Too many"
          f" open files': {text.count('Too many open files')}; the server's open files, most"
          f" seen: {result.open_files}")  # fmt: skip
    for kind, count in closed_counts(text).most_common():
        print(f"  closed by the server, as its log counts them: {count:,} {kind}")
    return 0 if result.all_answered else 1


if __name__ == "__main__":
    sys.exit(main())
