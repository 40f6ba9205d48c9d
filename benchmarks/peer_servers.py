"""The servers benchmarks/peers.py compares, as subprocesses on loopback, and their memory.

- `LlamaServer`: llama.cpp's llama-server (built by scripts/build-llama-server.sh) on a free
  port, ready once its /health answers 200 (it answers 503 while loading the model).
- `pagechat serve` is `benchmarks.serve.Server` (embedded Redis in a directory of its own).
- `RssPeaks`: the peak resident memory of each server's own process and, apart, of its child
  processes (pagechat's embedded redis-server), sampled with psutil on a thread; beside it the
  kernel's own high-water mark of the server's RSS (VmHWM: start-up included, unsampled).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
DEFAULT_BINARY = REPO / "build" / "llama.cpp" / "bin" / "llama-server"


def free_port() -> int:
    """A loopback port free right now (llama-server takes no port 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class LlamaServer:
    """llama-server on `model`, `slots` parallel sequences sharing `context` tokens of KV.

    NOTE: --no-repack. On the project's EPYC machines llama.cpp repacks Q4 weights for its
    AMX/AVX512 kernels by default, and that path crashed llama-server on one of them.
    """

    def __init__(
        self,
        binary: Path,
        model: Path,
        log: Path,
        *,
        slots: int,
        threads: int,
        context: int,
        extra: list[str],
    ) -> None:
        self.host, self.port = "127.0.0.1", free_port()
        self.command = [
            str(binary),
            *("-m", str(model), "--host", self.host, "--port", str(self.port)),
            *("-np", str(slots), "-t", str(threads), "-c", str(context), "--no-repack"),
            *extra,
        ]
        self.log = log
        # The build uses OpenMP; -t alone decides its threads (make exports OMP_NUM_THREADS=1).
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                self.command, stdout=out, stderr=subprocess.STDOUT, env=env
            )
        deadline = time.monotonic() + 300
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                tail = log.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"llama-server did not start:\n{tail}")
            time.sleep(0.2)

    def _healthy(self) -> bool:
        try:
            url = f"http://{self.host}:{self.port}/health"
            with urllib.request.urlopen(url, timeout=2) as response:
                return int(response.status) == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


@dataclass(slots=True)
class Peak:
    """Peak RSS seen of one server: its own process, and its children's summed apart."""

    rss_mb: float = 0.0  # sampled while watched
    hwm_mb: float = 0.0  # the kernel's peak over the process's life (Linux; 0 elsewhere)
    children_rss_mb: float = 0.0
    children: set[str] = field(default_factory=set)  # the children's process names
    samples: int = 0


def high_water_mark_mb(pid: int) -> float:
    """VmHWM of /proc/<pid>/status: the most RSS the process ever had; 0 where unreadable."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return 0.0


class RssPeaks:
    """Samples the RSS of each watched process and of its children every `interval_s` on a
    thread, keeping the peaks: a server's memory from when it is watched (once it listens) to
    its stop."""

    def __init__(self, interval_s: float = 0.2) -> None:
        self.interval_s = interval_s
        self.peaks: dict[str, Peak] = {}
        self._processes: dict[str, psutil.Process] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-peaks", daemon=True)

    def watch(self, label: str, pid: int) -> None:
        with self._lock:
            self._processes[label] = psutil.Process(pid)
            self.peaks[label] = Peak()
        self.sample()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def sample(self) -> None:
        with self._lock:
            for label, process in self._processes.items():
                with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                    peak = self.peaks[label]
                    peak.rss_mb = max(peak.rss_mb, process.memory_info().rss / 2**20)
                    peak.hwm_mb = max(peak.hwm_mb, high_water_mark_mb(process.pid))
                    children = 0.0
                    for child in process.children(recursive=True):
                        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                            children += child.memory_info().rss / 2**20
                            peak.children.add(child.name())
                    peak.children_rss_mb = max(peak.children_rss_mb, children)
                    peak.samples += 1

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()
