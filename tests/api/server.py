"""A real `pagechat serve` in a subprocess on a loopback port, and HTTP helpers for tests.

A subprocess, not a thread: the server's event loop and engine thread get a GIL of their
own (as in production), event-loop lag measures the server alone, and a restart is a real
process restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import msgspec
import redis
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from service.sessions.models import Message, PageMap

REPO = Path(__file__).resolve().parents[2]
REDIS_URL = "redis://127.0.0.1:6379/0"
_RUNNING = re.compile(r"Uvicorn running on http://127\.0\.0\.1:(\d+)")


@dataclass
class ServerProcess:
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/chat"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def get(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(self.http + path, timeout=10) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as exc:
            with exc:  # an unclosed error response leaks its socket
                return exc.code, exc.read()

    def metrics(self) -> dict[str, Metric]:
        """/metrics as a scraper reads it (prometheus_client's parser): families by name."""
        status, body = self.get("/metrics")
        assert status == 200, body
        return {f.name: f for f in text_string_to_metric_families(body.decode())}

    def metric(self, sample: str, **labels: str) -> float:
        """The sum of the samples named `sample` (e.g. 'pagechat_turns_total') whose labels
        include `labels`; 0 when there are none yet."""
        return sum(
            s.value
            for family in self.metrics().values()
            for s in family.samples
            if s.name == sample and labels.items() <= s.labels.items()
        )

    def stats(self, lag_window_s: float = 60.0) -> dict[str, Any]:
        status, body = self.get(f"/v1/stats?lag_window_s={lag_window_s}")
        assert status == 200, body
        result: dict[str, Any] = json.loads(body)
        return result

    async def astats(self) -> dict[str, Any]:
        return await asyncio.to_thread(self.stats)

    async def astats_window(self, lag_window_s: float) -> dict[str, Any]:
        """Stats with event-loop lag over only the last `lag_window_s` seconds."""
        return await asyncio.to_thread(self.stats, lag_window_s)

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM (graceful shutdown) and wait; the exit code (0: drained and balanced)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"the server did not stop in {timeout}s:\n{self.log()}") from None


def start_server(
    log_path: Path, *args: str, timeout: float = 180.0, launcher: Sequence[str] = ()
) -> ServerProcess:
    """`launcher`: a command put before the server's own, which runs it in its place
    (`prlimit --nofile=512`), so that the process is the server."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    command = [*launcher, sys.executable, "-m", "service.cli", "serve", "--port", "0", *args]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log_path.read_text(errors="replace")
        if match := _RUNNING.search(text):
            return ServerProcess(proc, int(match.group(1)), log_path)
        if proc.poll() is not None:
            raise AssertionError(f"the server exited with {proc.returncode}:\n{text}")
        time.sleep(0.1)
    proc.kill()
    proc.wait()
    raise AssertionError(f"the server did not start in {timeout}s:\n{log_path.read_text()}")


def is_idle(stats: dict[str, Any]) -> bool:
    kv, queue = stats["kv"], stats["queue"]
    return (
        kv["device"]["in_use"] == 0
        and kv["cpu"]["in_use"] == 0
        and queue["waiting"] == queue["running"] == queue["swapped"] == 0
        and queue["inflight_turns"] == 0
    )


async def wait_balanced(server: ServerProcess, timeout: float = 10.0) -> dict[str, Any]:
    """Wait until no request holds a block and nothing is queued; fail with the stats if not."""
    deadline = time.monotonic() + timeout
    while True:
        stats = await server.astats()
        pools = [stats["kv"]["device"], stats["kv"]["cpu"]]
        for pool in pools:
            assert pool["free"] + pool["cached"] + pool["in_use"] == pool["total"], stats
        if is_idle(stats) and stats["sessions"]["open_connections"] == 0:
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"the server is not idle and balanced: {stats}")
        await asyncio.sleep(0.05)


@contextlib.contextmanager
def running_server(
    directory: Path, *args: str, prefix: str | None = None, launcher: Sequence[str] = ()
) -> Iterator[ServerProcess]:
    """A server on the Redis at 127.0.0.1:6379 under a fresh key prefix (or `prefix`, whose
    keys its owner deletes), stopped (and a fresh prefix's keys deleted) at the end; a stop
    that is not clean (exit code != 0: pools not balanced at shutdown) fails."""
    fresh = prefix is None
    key_prefix = unique_prefix() if prefix is None else prefix
    server = start_server(
        directory / "server.log",
        *("--redis-url", REDIS_URL, "--redis-prefix", key_prefix, *args),
        launcher=launcher,
    )
    try:
        yield server
    finally:
        code = server.stop()
        if fresh:
            delete_prefix(key_prefix)
    assert code == 0, f"unclean exit {code}:\n{server.log()}"


def unique_prefix() -> str:
    return f"pagechat-test-{uuid.uuid4().hex[:12]}:"


def delete_prefix(prefix: str) -> None:
    client = redis.Redis.from_url(REDIS_URL)
    try:
        keys = list(client.scan_iter(match=prefix + "*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


def stored_session(prefix: str, session_id: str) -> tuple[list[Message], PageMap | None]:
    """A session's messages and page map as they are in Redis, read straight from it."""
    client = redis.Redis.from_url(REDIS_URL)
    try:
        raw_messages = cast(
            list[bytes], client.lrange(f"{prefix}session:{session_id}:messages", 0, -1)
        )
        raw_map = cast(bytes | None, client.get(f"{prefix}session:{session_id}:pagemap"))
    finally:
        client.close()
    messages = [msgspec.msgpack.decode(m, type=Message) for m in raw_messages]
    page_map = None if raw_map is None else msgspec.msgpack.decode(raw_map, type=PageMap)
    return messages, page_map
