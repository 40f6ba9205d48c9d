"""One answer in the metrics, whatever transport asked for it: time to first token, queue
time and inter-token latency as its outputs arrive, then its end-to-end latency, its lengths
(prompt, each sample's generation, the longest sample's), its prefill and decode time, and the
count of answers by finish reason (the WebSocket's reasons: stop, length, cancelled, shutdown,
disconnected; an OpenAI answer ends stop, length or disconnected), also under vLLM's
`request_success` with its three reasons (stop, length, abort: the rest). An answer the server
failed mid-way ends in an error frame and `pagechat_errors_total`, not here."""

from __future__ import annotations

import time
from collections.abc import Iterable

from service.api.observability.metrics import Metrics
from service.engine.values import RequestOutput

# vLLM's finished_reason values; an answer cut short any other way is its "abort".
_VLLM_REASONS = {"stop": "stop", "length": "length"}


class AnswerMeter:
    def __init__(self, metrics: Metrics, received: float) -> None:
        self.metrics = metrics
        self.received = received  # time.monotonic() when the request arrived
        self.first_token_at: float | None = None
        self._last_token_at: float | None = None
        self._scheduled_at: float | None = None
        self._prompt_tokens: int | None = None
        self._generated: dict[int, int] = {}  # tokens each sample generated

    def output(self, out: RequestOutput) -> None:
        """An output of the engine for this answer (any of its samples)."""
        if self._prompt_tokens is None:
            self._prompt_tokens = out.num_prompt_tokens
        if not out.new_token_ids:
            return
        self._generated[out.index] = self._generated.get(out.index, 0) + len(out.new_token_ids)
        metrics, now = self.metrics, time.monotonic()
        if self._last_token_at is None:
            self.first_token_at = now
            metrics.time_to_first_token.observe(now - self.received)
            if out.first_scheduled_time is not None:
                self._scheduled_at = out.first_scheduled_time
                metrics.queue_time.observe(max(0.0, out.first_scheduled_time - self.received))
        else:
            gap = now - self._last_token_at
            metrics.inter_token_latency.observe(gap)
            metrics.time_per_output_token.observe(gap)
        self._last_token_at = now

    def end(self, reasons: Iterable[str]) -> float:
        """The answer is over, each sample for its reason: count it; seconds it took."""
        metrics = self.metrics
        for reason in reasons:
            metrics.turns.labels(reason).inc()
            metrics.request_success.labels(_VLLM_REASONS.get(reason, "abort")).inc()
        now = time.monotonic()
        total = now - self.received
        metrics.e2e_latency.observe(total)
        if self._prompt_tokens is not None:
            metrics.request_prompt_tokens.observe(self._prompt_tokens)
        for tokens in self._generated.values():
            metrics.request_generation_tokens.observe(tokens)
        if self._generated:
            metrics.request_max_num_generation_tokens.observe(max(self._generated.values()))
        if self.first_token_at is not None and self._last_token_at is not None:
            if self._scheduled_at is not None:
                metrics.request_prefill_time.observe(
                    max(0.0, self.first_token_at - self._scheduled_at)
                )
            metrics.request_decode_time.observe(self._last_token_at - self.first_token_at)
        return total
