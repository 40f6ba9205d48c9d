"""Admission: who gets in, and how much runs at once.

Two counts under two limits: open WebSockets (`max_connections`), and answers in flight
(`max_inflight_turns`), which are of two kinds: a session's turn, one at a time per session
(a second is `busy`), and an HTTP answer, which belongs to no session. Draining refuses both.
Each refusal is a `Refusal`, which every transport words its own way.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from service.api.limits import Limits
from service.api.observability.metrics import Metrics
from service.api.refusal import Refusal, RefusalReason


class Connection(Protocol):
    """What admission needs of an open connection (service.api.ws.connection.ChatConnection)."""

    @property
    def session_id(self) -> str | None: ...

    async def shutdown(self) -> None:
        """End the answer in flight (stored, reported), say why, close."""
        ...


class Admission:
    def __init__(self, limits: Limits, metrics: Metrics) -> None:
        self._limits = limits
        self._metrics = metrics
        self.connections: set[Connection] = set()
        self.answering_sessions: set[str] = set()  # sessions with a turn in flight
        self.http_answers = 0  # OpenAI answers in flight
        self.draining = False
        self._idle = asyncio.Event()  # no answer in flight
        self._idle.set()

    @property
    def answers_in_flight(self) -> int:
        return len(self.answering_sessions) + self.http_answers

    # ------------------------------------------------------------------ connections

    def admit(self, connection: Connection) -> Refusal | None:
        if self.draining:
            return _shutting_down()
        limit = self._limits.max_connections
        if len(self.connections) >= limit:
            return Refusal(
                RefusalReason.TOO_MANY_CONNECTIONS,
                f"the server has {limit} open connections; retry later",
            )
        self.connections.add(connection)
        self._metrics.open_connections.set(len(self.connections))
        return None

    def release(self, connection: Connection) -> None:
        self.connections.discard(connection)
        self._metrics.open_connections.set(len(self.connections))

    # ------------------------------------------------------------------ answers

    def begin_turn(self, session_id: str) -> Refusal | None:
        """A slot for `session_id`'s next answer; `end_turn` gives it back."""
        if self.draining:
            return _shutting_down()
        if session_id in self.answering_sessions:
            return Refusal(RefusalReason.BUSY, "this session is answering on another connection")
        if refusal := self._no_room():
            return refusal
        self.answering_sessions.add(session_id)
        self._changed()
        return None

    def end_turn(self, session_id: str) -> None:
        self.answering_sessions.discard(session_id)
        self._changed()

    def begin_answer(self) -> Refusal | None:
        """A slot for one HTTP answer; `end_answer` gives it back."""
        if refusal := self._no_room():
            return refusal
        self.http_answers += 1
        self._changed()
        return None

    def end_answer(self) -> None:
        self.http_answers -= 1
        self._changed()

    def _no_room(self) -> Refusal | None:
        if self.draining:
            return _shutting_down()
        limit = self._limits.max_inflight_turns
        if self.answers_in_flight >= limit:
            return Refusal(
                RefusalReason.OVERLOADED, f"the server is answering {limit} messages; retry later"
            )
        return None

    def _changed(self) -> None:
        self._metrics.inflight_turns.set(self.answers_in_flight)
        if self.answers_in_flight:
            self._idle.clear()
        else:
            self._idle.set()

    # ------------------------------------------------------------------ drain

    async def drain(self, timeout_s: float) -> bool:
        """Refuse from now on and wait up to `timeout_s` for the answers in flight; whether
        they all ended."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True


def _shutting_down() -> Refusal:
    return Refusal(RefusalReason.SHUTTING_DOWN, "the server is shutting down")
