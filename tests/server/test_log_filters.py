"""The log filters `pagechat serve` installs (service/server/serve.py): pure logic."""

from __future__ import annotations

import logging

import pytest

from service.server import serve
from service.server.serve import AcceptErrorFilter


def accept_error() -> logging.LogRecord:
    try:
        raise OSError(24, "Too many open files")
    except OSError as exc:
        error = exc
    return logging.LogRecord(
        "asyncio", logging.ERROR, __file__, 1,
        "socket.accept() out of system resource\nsocket: <socket>", (), (OSError, error, None),
    )  # fmt: skip


def test_failed_accepts_are_one_line_per_period_saying_how_many_it_stands_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [100.0]
    monkeypatch.setattr(serve.time, "monotonic", lambda: now[0])
    keep = AcceptErrorFilter(every_s=10.0)
    first = accept_error()
    assert keep.filter(first)
    assert first.exc_info is None and "Too many open files" in first.getMessage()
    assert "0 more like it" in first.getMessage()
    assert not any(keep.filter(accept_error()) for _ in range(500))
    now[0] += 10.0
    later = accept_error()
    assert keep.filter(later) and "500 more like it" in later.getMessage()
    other = logging.LogRecord("asyncio", logging.ERROR, __file__, 1, "Task was destroyed", (), None)
    assert keep.filter(other) and other.getMessage() == "Task was destroyed"
