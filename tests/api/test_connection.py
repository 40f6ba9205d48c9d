"""The WebSocket session's state machine refuses transitions it does not allow."""

from __future__ import annotations

from typing import Any

import pytest

from service.api.connection import ChatConnection, InvalidTransition, State


class _Socket:
    def __init__(self, subprotocols: list[str]) -> None:
        self.scope: dict[str, Any] = {"subprotocols": subprotocols}


def connection(subprotocols: list[str] | None = None) -> ChatConnection:
    return ChatConnection(_Socket(subprotocols or []), service=None)  # type: ignore[arg-type]


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
