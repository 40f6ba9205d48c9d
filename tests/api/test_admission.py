"""service/api/admission.py: open connections and answers in flight under their limits, the
refusals each transport words its own way, and the drain."""

from __future__ import annotations

import asyncio

from service.api.admission import Admission
from service.api.limits import Limits
from service.api.observability.metrics import Metrics
from service.api.refusal import RefusalReason
from tests.fake_engine import FakeEngine


class Connection:
    session_id: str | None = None

    async def shutdown(self) -> None:
        pass


def admission(**limits: int) -> tuple[Admission, Metrics]:
    engine = FakeEngine()
    metrics = Metrics(engine.stats, lambda: engine.model_id)
    return Admission(Limits(**limits), metrics), metrics


def gauge(metrics: Metrics, name: str) -> float:
    value = metrics.registry.get_sample_value(name)
    assert value is not None
    return value


def test_connections_past_the_limit_are_refused_and_a_release_makes_room() -> None:
    gate, metrics = admission(max_connections=2)
    first, second, third = Connection(), Connection(), Connection()
    assert gate.admit(first) is None and gate.admit(second) is None
    refusal = gate.admit(third)
    assert refusal is not None and refusal.reason is RefusalReason.TOO_MANY_CONNECTIONS
    assert gauge(metrics, "pagechat_open_connections") == 2
    gate.release(first)
    gate.release(first)  # twice is harmless
    assert gate.admit(third) is None
    assert gauge(metrics, "pagechat_open_connections") == 2


def test_a_session_answers_one_turn_at_a_time() -> None:
    gate, _ = admission()
    assert gate.begin_turn("s1") is None
    busy = gate.begin_turn("s1")
    assert busy is not None and busy.reason is RefusalReason.BUSY
    assert gate.begin_turn("s2") is None
    gate.end_turn("s1")
    assert gate.begin_turn("s1") is None


def test_turns_and_http_answers_share_the_inflight_limit() -> None:
    gate, metrics = admission(max_inflight_turns=2)
    assert gate.begin_turn("s1") is None and gate.begin_answer() is None
    for refusal in (gate.begin_turn("s2"), gate.begin_answer()):
        assert refusal is not None and refusal.reason is RefusalReason.OVERLOADED
    assert gate.answers_in_flight == 2
    assert gauge(metrics, "pagechat_inflight_turns") == 2
    gate.end_answer()
    assert gate.begin_turn("s2") is None
    assert gauge(metrics, "pagechat_inflight_turns") == 2


async def test_the_drain_refuses_everything_and_waits_for_the_answers_in_flight() -> None:
    gate, _ = admission()
    assert gate.begin_turn("s1") is None and gate.begin_answer() is None
    drained = asyncio.create_task(gate.drain(timeout_s=60))
    await asyncio.sleep(0)
    for refusal in (gate.admit(Connection()), gate.begin_turn("s2"), gate.begin_answer()):
        assert refusal is not None and refusal.reason is RefusalReason.SHUTTING_DOWN
    gate.end_turn("s1")
    await asyncio.sleep(0)
    assert not drained.done()  # the HTTP answer still runs
    gate.end_answer()
    assert await drained is True


async def test_a_drain_that_runs_out_of_time_says_so() -> None:
    gate, _ = admission()
    assert gate.begin_answer() is None
    assert await gate.drain(timeout_s=0) is False
    assert gate.draining
