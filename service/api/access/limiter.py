"""Failed attempts (wrong keys, wrong session secrets, unknown sessions) counted per subject,
a client address or a session, with exponential backoff: guessing gets slow at once."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass

MAX_SUBJECT_CHARS = 160  # a subject longer than any real one is cut (it can never succeed)


@dataclass(slots=True)
class _Failures:
    count: int
    last: float  # when the latest failure was
    until: float  # refused until then


class AttemptLimiter:
    """Failed attempts per subject (a client address, or a session), with backoff.

    NOTE (policy): the first `free` failures cost nothing; the n-th after them refuses the
    subject for `base_s * 2**(n - 1)` seconds, at most `cap_s`. A refused attempt is not
    checked at all, so it neither counts nor lengthens the wait. A subject's failures are
    forgotten `window_s` after its latest one, or when it succeeds.
    NOTE (memory): at most `max_subjects` subjects; when full, the one whose latest failure
    is oldest is dropped (the table is kept in that order).
    """

    def __init__(
        self,
        *,
        free: int = 5,
        base_s: float = 1.0,
        cap_s: float = 300.0,
        window_s: float = 900.0,
        max_subjects: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if free < 0 or base_s <= 0 or cap_s < base_s or window_s < cap_s or max_subjects < 1:
            raise ValueError("need free >= 0, 0 < base_s <= cap_s <= window_s, max_subjects >= 1")
        self.free, self.base_s, self.cap_s, self.window_s = free, base_s, cap_s, window_s
        self.max_subjects = max_subjects
        self._clock = clock
        self._failures: collections.OrderedDict[str, _Failures] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._failures)

    def retry_after(self, subject: str) -> float | None:
        """Seconds until `subject` may try again, or None if it may now."""
        record = self._failures.get(subject[:MAX_SUBJECT_CHARS])
        if record is None:
            return None
        wait = record.until - self._clock()
        return wait if wait > 0 else None

    def fail(self, subject: str) -> None:
        subject = subject[:MAX_SUBJECT_CHARS]
        now = self._clock()
        record = self._failures.pop(subject, None)
        if record is None or now - record.last > self.window_s:
            record = _Failures(count=0, last=now, until=now)
        record.count += 1
        record.last = now
        over = record.count - self.free
        if over > 0:
            record.until = now + min(self.cap_s, self.base_s * 2 ** min(over - 1, 32))
        self._failures[subject] = record  # now the newest
        while len(self._failures) > self.max_subjects:
            self._failures.popitem(last=False)

    def forget(self, subject: str) -> None:
        self._failures.pop(subject[:MAX_SUBJECT_CHARS], None)
