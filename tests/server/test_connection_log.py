"""Closed connections logged as counts (service/server/connection_log.py): the first at once, then
one line per interval while they go on, none while quiet."""

from __future__ import annotations

import asyncio
import logging

import pytest

from service.server.connection_log import ConnectionLog

EVERY_S = 0.05


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "test.closed"]


async def test_a_flood_of_closes_is_one_line_at_once_then_one_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="test.closed")
    closed = ConnectionLog(logging.getLogger("test.closed"), every_s=EVERY_S)
    closed.closed("reset as accepted", "10.0.0.1")
    assert lines(caplog) == ["connections closed: 1 reset as accepted; from 10.0.0.1 (1)"]
    for n in range(3000):
        closed.closed("reset as accepted", f"10.0.1.{n % 7}")
        closed.closed("pushed out", "10.0.0.1")
    assert len(lines(caplog)) == 1  # the rest wait for the interval's end
    await asyncio.sleep(EVERY_S * 3)  # the timer fires before this sleep ends
    second = lines(caplog)[1]
    assert second.startswith(f"connections closed in the last {EVERY_S:g} s: ")
    assert "3,000 reset as accepted; 3,000 pushed out" in second
    assert "from 10.0.0.1 (3,000), " in second and "and 5 more" in second
    await asyncio.sleep(EVERY_S * 5)
    assert len(lines(caplog)) == 2  # quiet intervals write nothing
    closed.close()


async def test_close_writes_what_is_counted(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="test.closed")
    closed = ConnectionLog(logging.getLogger("test.closed"), every_s=60.0)
    for _ in range(3):
        closed.closed("pushed out", "10.0.0.3")
    closed.close()
    assert lines(caplog) == [
        "connections closed: 1 pushed out; from 10.0.0.3 (1)",
        "connections closed since the last line: 2 pushed out; from 10.0.0.3 (2)",
    ]
