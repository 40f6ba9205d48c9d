"""The soak's own Redis: pagechat's embedded one (`python -m service.sessions.redis_server`)
as a child process, so that its persistence and memory are those of a default server. A
process boundary, as with `pagechat serve`: the load tests import nothing from service/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

STOP_TIMEOUT_S = 30.0
REPO = Path(__file__).resolve().parents[1]


class RedisChild:
    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir.resolve()
        self._proc: subprocess.Popen[str] | None = None
        self.url = ""  # unix://...: set once it answers

    def start(self) -> None:
        """Start it and wait until it answers (it prints its URL then)."""
        command = [sys.executable, "-m", "service.sessions.redis_server", str(self.data_dir)]
        self._proc = subprocess.Popen(
            command, cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True
        )
        assert self._proc.stdout is not None
        self.url = self._proc.stdout.readline().strip()
        if not self.url:
            self.stop()
            raise RuntimeError(f"the soak's Redis did not start; see {self.data_dir}")

    @property
    def socket_path(self) -> str:
        return self.url.removeprefix("unix://")

    def stop(self) -> None:
        """SIGTERM (Redis writes its files, then exits); SIGKILL after STOP_TIMEOUT_S."""
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if self._proc.stdout is not None:
            self._proc.stdout.close()
        self._proc = None
