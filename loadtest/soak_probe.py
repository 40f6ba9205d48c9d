"""What the soak samples every few seconds: the server's process, its Redis, its /v1/stats
and /metrics; written as CSV and drawn as one PNG of panels over time."""

from __future__ import annotations

import csv
import json
import math
import urllib.request
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import matplotlib
import psutil
import redis
from prometheus_client.parser import text_string_to_metric_families

from loadtest.run import http_base
from loadtest.soak_verdict import SESSION_KEY, KeyAccount, SessionMeta, account_keys

matplotlib.use("Agg")  # no display; must precede pyplot
import matplotlib.pyplot as plt

_NO_HTTP_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@dataclass(slots=True)
class Sample:
    t_s: float  # since the soak started
    phase: str  # "load" while Locust runs, then "idle"
    rss_mb: float  # nan when the server's process is not known
    open_fds: float
    redis_keys: int
    redis_used_mb: float
    device_in_use: int
    cpu_in_use: int
    loop_lag_p99_ms: float  # over the sampling interval
    turns: int  # answers the server finished (any reason)
    tokens: int  # tokens generated


class Probe:
    """Reads the server (HTTP and its process) and Redis; one `Sample` per call."""

    def __init__(
        self, url: str, pid: int | None, client: redis.Redis, prefix: str, interval_s: float
    ) -> None:
        self.base = http_base(url)
        self.process = psutil.Process(pid) if pid is not None else None
        self.redis = client
        self.prefix = prefix
        self.interval_s = interval_s

    def get(self, path: str) -> bytes:
        with _NO_HTTP_PROXY.open(self.base + path, timeout=30) as response:
            body: bytes = response.read()
            return body

    def stats(self, lag_window_s: float = 60.0) -> dict[str, Any]:
        stats: dict[str, Any] = json.loads(self.get(f"/v1/stats?lag_window_s={lag_window_s}"))
        return stats

    def turns(self) -> int:
        text = self.get("/metrics").decode()
        return sum(
            int(s.value)
            for family in text_string_to_metric_families(text)
            if family.name == "pagechat_turns"
            for s in family.samples
            if s.name == "pagechat_turns_total"
        )

    def keys(self) -> list[str]:
        return [k.decode() for k in self.redis.scan_iter(match=self.prefix + "*", count=1000)]

    def sample(self, t_s: float, phase: str) -> Sample:
        stats = self.stats(self.interval_s)
        rss, fds = math.nan, math.nan
        if self.process is not None:
            with self.process.oneshot():
                rss, fds = self.process.memory_info().rss / 2**20, self.process.num_fds()
        return Sample(
            t_s=round(t_s, 2),
            phase=phase,
            rss_mb=rss,
            open_fds=fds,
            redis_keys=len(self.keys()),
            redis_used_mb=int(self.redis.info("memory")["used_memory"]) / 2**20,
            device_in_use=stats["kv"]["device"]["in_use"],
            cpu_in_use=stats["kv"]["cpu"]["in_use"],
            loop_lag_p99_ms=stats["event_loop_lag"]["p99_ms"],
            turns=self.turns(),
            tokens=stats["engine"]["tokens_generated"],
        )

    def account(self) -> KeyAccount:
        ttls, metas = {}, {}
        for key in self.keys():
            ttl = int(self.redis.ttl(key))
            if ttl != -2:  # -2: gone since the scan
                ttls[key] = ttl
            if (match := SESSION_KEY.fullmatch(key.removeprefix(self.prefix))) and not match.group(
                2
            ):
                turns, system = self.redis.hmget(key, ["turns", "system"])
                if turns is not None:
                    metas[match.group(1)] = SessionMeta(int(turns), system is not None)
        return account_keys(self.prefix, ttls, metas)


def is_idle(stats: dict[str, Any]) -> bool:
    kv, queue = stats["kv"], stats["queue"]
    busy = (
        kv["device"]["in_use"],
        kv["cpu"]["in_use"],
        queue["waiting"],
        queue["running"],
        queue["swapped"],
        queue["inflight_turns"],
        stats["sessions"]["open_connections"],
    )
    return not any(busy)


def write_csv(samples: list[Sample], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([x.name for x in fields(Sample)])
        writer.writerows([getattr(s, x.name) for x in fields(Sample)] for s in samples)


def plot(samples: list[Sample], path: Path, title: str) -> None:
    t = [s.t_s / 60.0 for s in samples]
    fig, axes = plt.subplots(5, 1, figsize=(9, 11), sharex=True)
    rss, fds, keys, blocks, lag = axes
    rss.plot(t, [s.rss_mb for s in samples], color="tab:blue")
    rss.set_ylabel("server RSS (MB)")
    load = [s.t_s / 60.0 for s in samples if s.phase == "load"]
    if (q := len(load) // 4) >= 2:  # the quarters the RSS check compares
        for first, last in ((q, 2 * q - 1), (len(load) - q, len(load) - 1)):
            rss.axvspan(load[first], load[last], color="tab:blue", alpha=0.1)
    fds.plot(t, [s.open_fds for s in samples], color="tab:purple")
    fds.set_ylabel("open file\ndescriptors")
    keys.plot(t, [s.redis_keys for s in samples], color="tab:green", label="keys")
    keys.set_ylabel("Redis keys\n(prefix)")
    memory = keys.twinx()
    memory.plot(t, [s.redis_used_mb for s in samples], color="tab:olive", ls="--")
    memory.set_ylabel("Redis used\nmemory (MB, dashed)")
    blocks.plot(t, [s.device_in_use for s in samples], label="device")
    blocks.plot(t, [s.cpu_in_use for s in samples], label="CPU")
    blocks.set_ylabel("KV blocks\nin use")
    blocks.legend(loc="upper left")
    lag.plot(t, [s.loop_lag_p99_ms for s in samples], color="tab:red")
    lag.set_ylabel("event-loop lag\np99 (ms)")
    lag.set_xlabel("minutes (dotted: Locust stopped; shaded: the quarters the RSS check compares)")
    for ax in axes:
        ax.axvline(max(load, default=0.0), color="grey", ls=":")
        ax.grid(alpha=0.3)
    axes[0].set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
