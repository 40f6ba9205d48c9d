"""The failed-attempt limiter (service/api/access/limiter.py): free failures, then doubling waits up
to a cap, forgotten after a window or on success, and a bounded table of subjects."""

from __future__ import annotations

from service.api.access.limiter import AttemptLimiter


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_failures_after_the_free_ones_refuse_for_doubling_waits_up_to_the_cap() -> None:
    clock = Clock()
    limiter = AttemptLimiter(free=5, base_s=1.0, cap_s=8.0, window_s=60.0, clock=clock)
    for _ in range(5):
        limiter.fail("10.0.0.1")
        assert limiter.retry_after("10.0.0.1") is None
    waits = []
    for _ in range(6):
        limiter.fail("10.0.0.1")
        wait = limiter.retry_after("10.0.0.1")
        assert wait is not None
        waits.append(wait)
        clock.now += wait  # the client waits as told, then fails again
        assert limiter.retry_after("10.0.0.1") is None
    assert waits == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    assert limiter.retry_after("10.0.0.2") is None  # others are not slowed


def test_failures_are_forgotten_after_the_window_or_on_success() -> None:
    clock = Clock()
    limiter = AttemptLimiter(free=1, base_s=1.0, cap_s=8.0, window_s=60.0, clock=clock)
    limiter.fail("s")
    clock.now += 61
    limiter.fail("s")  # the first is forgotten: this one is free again
    assert limiter.retry_after("s") is None
    limiter.fail("s")
    assert limiter.retry_after("s") == 1.0
    limiter.forget("s")
    assert limiter.retry_after("s") is None


def test_the_limiter_keeps_at_most_max_subjects_dropping_the_stalest() -> None:
    limiter = AttemptLimiter(free=0, max_subjects=100, clock=Clock())
    for i in range(1000):
        limiter.fail(f"10.0.{i // 256}.{i % 256}")
    assert len(limiter) == 100
    assert limiter.retry_after("10.0.0.0") is None  # dropped
    assert limiter.retry_after("10.0.3.231") is not None  # the latest is kept
    limiter.fail("x" * 100_000)  # a subject is cut short, not kept whole
    assert limiter.retry_after("x" * 200) is not None
