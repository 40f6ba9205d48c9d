"""One answer in the metrics, whatever transport asked for it: time to first token, queue
time and inter-token latency as its outputs arrive, then its end-to-end latency and the count
of answers by finish reason (the WebSocket's reasons: stop, length, cancelled, shutdown,
disconnected; an OpenAI answer ends stop, length or disconnected). An answer the server
failed mid-way ends in an error frame and `pagechat_errors_total`, not here."""

from __future__ import annotations

import time
from collections.abc import Iterable

from service.api.observability.metrics import Metrics
from service.engine.values import RequestOutput


class AnswerMeter:
    def __init__(self, metrics: Metrics, received: float) -> None:
        self.metrics = metrics
        self.received = received  # time.monotonic() when the request arrived
        self.first_token_at: float | None = None
        self._last_token_at: float | None = None

    def output(self, out: RequestOutput) -> None:
        """An output of the engine for this answer (any of its samples)."""
        if not out.new_token_ids:
            return
        metrics, now = self.metrics, time.monotonic()
        if self._last_token_at is None:
            self.first_token_at = now
            metrics.time_to_first_token.observe(now - self.received)
            if out.first_scheduled_time is not None:
                metrics.queue_time.observe(max(0.0, out.first_scheduled_time - self.received))
        else:
            metrics.inter_token_latency.observe(now - self._last_token_at)
        self._last_token_at = now

    def end(self, reasons: Iterable[str]) -> float:
        """The answer is over, each sample for its reason: count it; seconds it took."""
        for reason in reasons:
            self.metrics.turns.labels(reason).inc()
        total = time.monotonic() - self.received
        self.metrics.e2e_latency.observe(total)
        return total
