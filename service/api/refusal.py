"""Why the service turns a client away, in no transport's words.

Admission (`Admission.admit`, `Admission.begin_turn`) and the gate (`Gate.authenticate`)
say only which rule refused and why; each transport decides what its client sees: the
WebSocket an error frame and maybe a close (`service.api.ws.connection`), HTTP a status and
OpenAI's error shape (`service.api.openai.errors.refusal_error`).
"""

from __future__ import annotations

import enum


class RefusalReason(enum.StrEnum):
    # The values are the metrics' `code` labels, the same on every transport.
    SHUTTING_DOWN = "shutting_down"  # draining: no new connection or answer
    TOO_MANY_CONNECTIONS = "too_many_connections"  # --max-connections reached
    BUSY = "busy"  # the session is answering on another connection
    OVERLOADED = "overloaded"  # --max-inflight-turns reached
    UNAUTHORIZED = "unauthorized"  # keys are on and no valid one came
    TOO_MANY_ATTEMPTS = "too_many_attempts"  # failed too often lately: `retry_after_s`


class Refusal(Exception):
    """A request the service will not take now; returned by the service, raised by the gate."""

    def __init__(
        self, reason: RefusalReason, message: str, *, retry_after_s: float | None = None
    ) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.retry_after_s = retry_after_s  # when a retry will be heard, if the rule knows
