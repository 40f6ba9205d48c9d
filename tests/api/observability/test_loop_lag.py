"""The event-loop lag probe sees a blocked loop, and summarises a window of samples."""

from __future__ import annotations

import asyncio
import time

from service.api.observability.loop_lag import LoopLagMonitor


async def test_a_blocked_loop_shows_up_as_lag() -> None:
    seen: list[float] = []
    monitor = LoopLagMonitor(interval_s=0.01, observe=seen.append)
    monitor.start()
    try:
        await asyncio.sleep(0.05)
        time.sleep(0.2)  # block the loop, as a synchronous call in a handler would
        await asyncio.sleep(0.05)
    finally:
        await monitor.stop()
    summary = monitor.summary()
    assert summary.samples == len(seen) >= 3
    assert summary.max_ms >= 150
    assert summary.p50_ms < 150  # most wake-ups were on time


def test_percentiles_are_nearest_rank_over_the_window() -> None:
    monitor = LoopLagMonitor(interval_s=0.05)
    for ms in range(1, 101):
        monitor.record(ms / 1e3)
    summary = monitor.summary(window_s=60)
    assert (summary.samples, summary.p50_ms, summary.p99_ms, summary.max_ms) == (
        100,
        50.0,
        99.0,
        100.0,
    )
    assert monitor.summary(window_s=0).samples == 0
