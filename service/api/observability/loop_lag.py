"""Event-loop lag: how late the loop wakes a task that asked to sleep.

A probe task sleeps `interval_s` and records the overshoot. A loop that is blocked (a
synchronous call, a long callback, the GIL held elsewhere) delays every socket on it by the
same amount, so this is the figure that says whether the server stays responsive.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable

import msgspec


class LagSummary(msgspec.Struct, kw_only=True):
    window_s: float
    samples: int
    p50_ms: float
    p99_ms: float
    max_ms: float


class LoopLagMonitor:
    def __init__(
        self,
        interval_s: float = 0.05,
        keep_s: float = 600.0,
        observe: Callable[[float], None] | None = None,
    ) -> None:
        self.interval_s = interval_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=int(keep_s / interval_s) + 1)
        self._observe = observe
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="loop-lag")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def record(self, lag_s: float) -> None:
        self._samples.append((time.monotonic(), lag_s))
        if self._observe is not None:
            self._observe(lag_s)

    def summary(self, window_s: float = 60.0) -> LagSummary:
        """Percentiles over the samples of the last `window_s` seconds."""
        since = time.monotonic() - window_s
        lags = sorted(lag for at, lag in self._samples if at >= since)
        return LagSummary(
            window_s=window_s,
            samples=len(lags),
            p50_ms=_percentile(lags, 0.50) * 1e3,
            p99_ms=_percentile(lags, 0.99) * 1e3,
            max_ms=(lags[-1] if lags else 0.0) * 1e3,
        )

    async def _run(self) -> None:
        while True:
            start = time.perf_counter()
            await asyncio.sleep(self.interval_s)
            self.record(max(0.0, time.perf_counter() - start - self.interval_s))


def _percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile; 0 for no samples."""
    if not sorted_values:
        return 0.0
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[rank - 1]
