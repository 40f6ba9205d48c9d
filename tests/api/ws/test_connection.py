"""ChatConnection (service/api/ws/connection.py): the state machine refuses transitions it does
not allow; and in-process, through Starlette's TestClient, with a fake engine behind the
engine interface and the real Redis on 127.0.0.1:6379, what a client sees frame by frame."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest
from starlette.testclient import TestClient, WebSocketTestSession

from service.api.limits import Limits
from service.api.ws.connection import ChatConnection, InvalidTransition, State
from service.server.app import create_app
from service.server.config import ServerConfig
from service.server.hub import Hub
from tests.api.server import REDIS_URL, delete_prefix, stored_session, unique_prefix
from tests.fake_engine import ANSWER, FakeEngine


class _Socket:
    def __init__(self, subprotocols: list[str]) -> None:
        self.scope: dict[str, Any] = {"subprotocols": subprotocols}


def connection(subprotocols: list[str] | None = None) -> ChatConnection:
    return ChatConnection(_Socket(subprotocols or []), parts=None)  # type: ignore[arg-type]


def test_a_session_goes_accepted_ready_streaming_ready_closed() -> None:
    conn = connection()
    for state in (State.ACCEPTED, State.READY, State.STREAMING, State.READY, State.CLOSED):
        conn._move(state)
        assert conn.state is state


@pytest.mark.parametrize(
    ("path", "bad"),
    [
        ([], State.READY),  # a session before the handshake
        ([State.ACCEPTED], State.STREAMING),  # an answer without a session
        ([State.ACCEPTED, State.READY], State.ACCEPTED),
        ([State.CLOSED], State.ACCEPTED),  # nothing leaves CLOSED
    ],
)
def test_invalid_transitions_raise(path: list[State], bad: State) -> None:
    conn = connection()
    for state in path:
        conn._move(state)
    with pytest.raises(InvalidTransition):
        conn._move(bad)


def test_the_msgpack_subprotocol_selects_binary_frames() -> None:
    assert connection(["pagechat.msgpack"])._codec.binary
    assert not connection(["something-else"])._codec.binary


# ---------------------------------------------------------------------- in-process


@dataclass
class App:
    client: TestClient
    hub: Hub
    engine: FakeEngine
    prefix: str

    def connect(self, *subprotocols: str) -> Any:
        return self.client.websocket_connect("/v1/chat", subprotocols=list(subprotocols))


@pytest.fixture
def app() -> Iterator[App]:
    prefix = unique_prefix()
    config = ServerConfig(
        redis_url=REDIS_URL,
        redis_prefix=prefix,
        replica_id="in-process",
        limits=Limits(max_connections=2, drain_timeout_s=0),
    )
    engine = FakeEngine()
    hub = Hub(config, engine=engine)
    try:
        with TestClient(create_app(hub)) as client:
            yield App(client, hub, engine, prefix)
    finally:
        delete_prefix(prefix)
    assert hub.balanced_at_exit  # no request of the fake engine left running


def answer(ws: WebSocketTestSession) -> tuple[str, dict[str, Any]]:
    """The deltas' text and the `done` frame of one answer."""
    text = ""
    while (frame := ws.receive_json())["type"] == "delta":
        text += frame["text"]
    assert frame["type"] == "done", frame
    return text, frame


def wait_for(condition: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_session_opens_answers_and_its_turn_is_stored(app: App) -> None:
    with app.connect() as ws:
        ws.send_json({"type": "open", "system": "Be brief."})
        opened = ws.receive_json()
        assert opened["type"] == "session" and not opened["resumed"] and opened["secret"]
        ws.send_json({"type": "user", "content": "Hi"})
        text, done = answer(ws)
    assert text == ANSWER
    assert (done["turn"], done["finish_reason"]) == (0, "stop")
    assert done["usage"]["completion_tokens"] == len(app.engine.answer_ids)
    messages, page_map = stored_session(app.prefix, opened["session_id"])
    assert [(m.role, m.content) for m in messages] == [("user", "Hi"), ("assistant", ANSWER)]
    assert page_map is not None and page_map.model_id == app.engine.model_id
    (request, *_) = app.engine.requests
    assert request.request_id == f"{opened['session_id']}/0"


def test_msgpack_clients_get_the_same_frames_as_binary(app: App) -> None:
    with app.connect("pagechat.msgpack") as ws:
        ws.send_bytes(msgspec.msgpack.encode({"type": "open"}))
        assert msgspec.msgpack.decode(ws.receive_bytes())["type"] == "session"
        ws.send_bytes(msgspec.msgpack.encode({"type": "user", "content": "Hi"}))
        frames = []
        while not frames or frames[-1]["type"] != "done":
            frames.append(msgspec.msgpack.decode(ws.receive_bytes()))
    assert "".join(f.get("text", "") for f in frames) == ANSWER


def test_frames_out_of_turn_are_refused_and_the_connection_goes_on(app: App) -> None:
    with app.connect() as ws:
        ws.send_json({"type": "user", "content": "Hi"})
        assert ws.receive_json()["code"] == "no_session"
        ws.send_json({"type": "open"})
        assert ws.receive_json()["type"] == "session"
        ws.send_json({"type": "open"})
        refused = ws.receive_json()
        assert (refused["code"], refused["fatal"]) == ("session_already_open", False)
        ws.send_json({"type": "user", "content": "Hi", "params": {"max_tokens": 0}})
        assert ws.receive_json()["code"] == "invalid_params"
        ws.send_json({"type": "user", "content": "Hi", "params": {"max_tokens": 99_999}})
        assert ws.receive_json()["code"] == "max_tokens_too_large"
        ws.send_json({"type": "user", "content": "Hi"})
        assert answer(ws)[0] == ANSWER


def test_a_user_frames_penalties_reach_the_engine_and_bad_ones_are_refused(app: App) -> None:
    penalties = {
        "presence_penalty": 0.5, "frequency_penalty": 0.25, "repetition_penalty": 1.3,
        "min_p": 0.05, "min_tokens": 2,
    }  # fmt: skip
    with app.connect() as ws:
        ws.send_json({"type": "open"})
        assert ws.receive_json()["type"] == "session"
        for bad in ({"repetition_penalty": 0}, {"presence_penalty": 3}, {"min_p": 2}):
            ws.send_json({"type": "user", "content": "Hi", "params": bad})
            assert ws.receive_json()["code"] == "invalid_params"
        ws.send_json({"type": "user", "content": "Hi", "params": penalties})
        assert answer(ws)[0] == ANSWER
    (request, *_) = app.engine.requests  # the turn's (a stored turn's tail prefill follows)
    assert {name: getattr(request.params, name) for name in penalties} == penalties


def test_a_message_while_answering_is_busy_and_cancel_ends_the_answer(app: App) -> None:
    app.engine.hold.clear()  # every answer waits after its first token
    with app.connect() as ws:
        ws.send_json({"type": "open"})
        session_id = ws.receive_json()["session_id"]
        ws.send_json({"type": "user", "content": "Hi"})
        first = ws.receive_json()
        assert first["type"] == "delta"
        ws.send_json({"type": "user", "content": "And?"})
        busy = ws.receive_json()
        assert (busy["code"], busy["fatal"]) == ("busy", False)
        ws.send_json({"type": "cancel"})
        rest, done = answer(ws)
    text = first["text"] + rest
    assert done["finish_reason"] == "cancelled" and text != ANSWER
    assert app.engine.aborted == [f"{session_id}/0"]  # its engine request, aborted
    messages, _ = stored_session(app.prefix, session_id)
    assert (messages[-1].content, messages[-1].finish_reason) == (text, "cancelled")


def test_a_client_gone_mid_answer_has_its_request_aborted_and_the_answer_stored(
    app: App,
) -> None:
    app.engine.hold.clear()
    with app.connect() as ws:
        ws.send_json({"type": "open"})
        session_id = ws.receive_json()["session_id"]
        ws.send_json({"type": "user", "content": "Hi"})
        first = ws.receive_json()["text"]
        # The client goes. (Leaving the block would also cancel the app, which no real
        # server does to a connection whose client left: wait inside it.)
        ws.close(1000)
        wait_for(lambda: not app.hub.admission.connections)
    messages, _ = stored_session(app.prefix, session_id)
    assert (messages[-1].content, messages[-1].finish_reason) == (first, "disconnected")
    assert app.engine.aborted == [f"{session_id}/0"]


def test_a_full_server_refuses_the_next_connection_and_closes_it_with_1013(app: App) -> None:
    with app.connect() as first, app.connect() as second:
        for ws in (first, second):
            ws.send_json({"type": "open"})
            assert ws.receive_json()["type"] == "session"
        with app.connect() as third:
            refused = third.receive_json()
            assert (refused["code"], refused["fatal"]) == ("too_many_connections", True)
            assert third.receive() == {"type": "websocket.close", "code": 1013, "reason": ""}
