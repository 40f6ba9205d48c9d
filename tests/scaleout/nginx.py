"""nginx (Debian's package) as a subprocess on a free loopback port, for scale-out tests.

The config is deploy/nginx_conf.py's, the one docker-compose.yml mounts, rendered for
replicas on loopback ports; every path nginx writes is under a temporary prefix.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.peer_servers import free_port
from deploy.nginx_conf import render


def nginx_binary() -> str | None:
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None
    )


@dataclass
class NginxProcess:
    proc: subprocess.Popen[bytes]
    port: int
    prefix: Path

    @property
    def ws(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/chat"

    def log(self) -> str:
        return (self.prefix / "nginx.log").read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: fast shutdown
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_nginx(prefix: Path, upstreams: Sequence[str], timeout: float = 20.0) -> NginxProcess:
    binary = nginx_binary()
    assert binary is not None, "nginx is not installed"
    port = free_port()
    (prefix / "temp").mkdir(parents=True, exist_ok=True)
    user = "root" if os.geteuid() == 0 else None  # workers as root may write under prefix
    conf = prefix / "nginx.conf"
    conf.write_text(render(upstreams, f"127.0.0.1:{port}", user=user))
    with (prefix / "nginx.log").open("wb") as log:
        proc = subprocess.Popen(
            [binary, "-p", str(prefix), "-c", str(conf)], stdout=log, stderr=subprocess.STDOUT
        )
    nginx = NginxProcess(proc, port, prefix)
    deadline = time.monotonic() + timeout
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"nginx exited with {proc.returncode}:\n{nginx.log()}")
        try:
            with opener.open(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                if response.status == 200:
                    return nginx
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.1)
    nginx.stop()
    raise AssertionError(f"nginx did not answer in {timeout}s:\n{nginx.log()}")
