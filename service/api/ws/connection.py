"""One /v1/chat WebSocket: an explicit state machine around a session and its answers.

    CONNECTING --accept--> ACCEPTED --open/resume--> READY --user--> STREAMING --done--> READY
    any state --------------------------------------------------------------------> CLOSED

Invalid transitions raise. Frames are read by one loop; an answer runs in its own task, so
`cancel` (and a second `user`, refused with `busy`) are heard while it streams.
NOTE: whatever ends the connection (the client leaving, a fatal error, shutdown, a bug), the
`finally` of `serve` cancels the answer, which aborts its engine request and releases its
blocks, waits for the partial answer to be stored, and releases the connection's slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis.exceptions
from starlette.types import Message
from starlette.websockets import WebSocket, WebSocketState

from protocol.frames import (
    MSGPACK_SUBPROTOCOL,
    Cancel,
    ChatMessage,
    ClientFrame,
    Codec,
    ErrorCode,
    FinishReason,
    FrameError,
    Open,
    Resume,
    ServerFrame,
    SessionOpened,
    User,
    UserParams,
)
from service.api.access.gate import Gate, bearer, client_address
from service.api.admission import Admission
from service.api.limits import Limits
from service.api.nesting import nesting_message, too_deep
from service.api.observability.metrics import Metrics
from service.api.refusal import Refusal, RefusalReason
from service.api.sampling import AskedSampling, SamplingError, sampling_params, user_sampling
from service.api.ws.sender import ClientGone, FrameSender
from service.api.ws.turn import Turn, sampling_frame_error
from service.engine.params import SamplingParams
from service.engine.serving import ServingEngine
from service.engine.values import GrammarError
from service.sessions.conversation_cache import ConversationCache
from service.sessions.store import SessionNotFound, SessionStore, WrongSecret

log = logging.getLogger(__name__)

CLOSE_SERVICE_RESTART = 1012  # RFC 6455 registry: the server is restarting
CLOSE_TRY_AGAIN_LATER = 1013
CLOSE_POLICY_VIOLATION = 1008
# The close code that follows each fatal error (docs/protocol.md's error table).
_CLOSE_CODE = {
    ErrorCode.SHUTTING_DOWN: CLOSE_SERVICE_RESTART,
    ErrorCode.TOO_MANY_CONNECTIONS: CLOSE_TRY_AGAIN_LATER,
}
# What each refusal of the service is on this transport: the error code, and whether the
# connection closes after it (a server that is going away, or full, keeps nobody waiting).
_REFUSAL_FRAME = {
    RefusalReason.SHUTTING_DOWN: (ErrorCode.SHUTTING_DOWN, True),
    RefusalReason.TOO_MANY_CONNECTIONS: (ErrorCode.TOO_MANY_CONNECTIONS, True),
    RefusalReason.BUSY: (ErrorCode.BUSY, False),
    RefusalReason.OVERLOADED: (ErrorCode.OVERLOADED, False),
    RefusalReason.UNAUTHORIZED: (ErrorCode.UNAUTHORIZED, False),
    RefusalReason.TOO_MANY_ATTEMPTS: (ErrorCode.TOO_MANY_ATTEMPTS, False),
}


def refusal_frame(refusal: Refusal) -> FrameError:
    """A refusal of the service (or the gate) as this protocol's error."""
    code, fatal = _REFUSAL_FRAME[refusal.reason]
    return FrameError(code, refusal.message, fatal=fatal, retry_after_s=refusal.retry_after_s)


class State(enum.Enum):
    CONNECTING = "connecting"  # handshake not answered yet
    ACCEPTED = "accepted"  # no session yet
    READY = "ready"  # a session is open; no answer in flight
    STREAMING = "streaming"  # an answer is in flight
    CLOSED = "closed"


_NEXT: dict[State, frozenset[State]] = {
    State.CONNECTING: frozenset({State.ACCEPTED, State.CLOSED}),
    State.ACCEPTED: frozenset({State.READY, State.CLOSED}),
    State.READY: frozenset({State.STREAMING, State.CLOSED}),
    State.STREAMING: frozenset({State.READY, State.CLOSED}),
    State.CLOSED: frozenset(),
}


class InvalidTransition(RuntimeError):
    pass


@dataclass(slots=True, frozen=True)
class ChatParts:
    """What a /v1/chat connection works with; the server hands them over once started."""

    limits: Limits
    gate: Gate
    admission: Admission
    engine: ServingEngine
    conversations: ConversationCache
    metrics: Metrics
    stores: Callable[[str], SessionStore]  # a tenant's sessions


class ChatConnection:
    def __init__(self, websocket: WebSocket, parts: ChatParts) -> None:
        self.websocket = websocket
        self.parts = parts
        self.state = State.CONNECTING
        self.session_id: str | None = None
        # Set with the session: the tenant whose key opened it, and that tenant's sessions.
        self.tenant: str | None = None
        self.store: SessionStore | None = None
        binary = MSGPACK_SUBPROTOCOL in websocket.scope.get("subprotocols", [])
        self._codec = Codec(binary=binary)
        self._turn: Turn | None = None
        self._turn_task: asyncio.Task[None] | None = None
        self._sender: FrameSender | None = None  # after the handshake: every frame goes here

    def _move(self, to: State) -> None:
        if to not in _NEXT[self.state]:
            raise InvalidTransition(f"{self.state.value} -> {to.value}")
        self.state = to

    # ------------------------------------------------------------------ lifecycle

    async def serve(self) -> None:
        if not self.parts.gate.origin_allowed(self.websocket.headers):
            # A page of another site, in a visitor's browser: refused before the handshake
            # is answered, which the client sees as HTTP 403.
            log.info("refused a WebSocket from origin %r", self.websocket.headers.get("origin"))
            self._move(State.CLOSED)
            with contextlib.suppress(OSError):
                await self.websocket.close(CLOSE_POLICY_VIOLATION)
            return
        await self.websocket.accept(MSGPACK_SUBPROTOCOL if self._codec.binary else None)
        self._move(State.ACCEPTED)
        limits = self.parts.limits
        self._sender = FrameSender(
            self.websocket,
            self._codec,
            max_frames=limits.send_queue_frames,
            timeout_s=limits.send_timeout_s,
        )
        refusal = self.parts.admission.admit(self)
        try:
            if refusal is not None:
                error = refusal_frame(refusal)
                await self._send_error(error)
                await self._close(_CLOSE_CODE.get(error.code, CLOSE_TRY_AGAIN_LATER))
                return
            await self._read_frames()
        except ClientGone:
            pass
        finally:
            await self._end(FinishReason.DISCONNECTED)
            await self._sender.stop()

    async def shutdown(self) -> None:
        """Server shutdown: end the answer (stored, reported), say why, close."""
        await self._end(FinishReason.SHUTDOWN)
        if self.websocket.application_state is WebSocketState.CONNECTED:
            try:
                await self._send_error(
                    FrameError(ErrorCode.SHUTTING_DOWN, "the server is shutting down", fatal=True)
                )
                await self._close(CLOSE_SERVICE_RESTART)
            except ClientGone:
                pass

    async def _end(self, reason: FinishReason) -> None:
        """Cancel the answer and wait until it is stored; idempotent."""
        if self._turn is not None:
            self._turn.cancel(reason)
        if self._turn_task is not None:
            await asyncio.wait([self._turn_task])
        if self.state is not State.CLOSED:
            self._move(State.CLOSED)
        self.parts.admission.release(self)

    async def _read_frames(self) -> None:
        limits = self.parts.limits
        while True:
            message = await self._receive()
            if message is None or message["type"] == "websocket.disconnect":
                return
            try:
                frame = self._codec.decode(
                    message.get("text"), message.get("bytes"), limits.max_frame_bytes
                )
                if too_deep(frame):  # NOTE (nesting) in service/api/nesting.py
                    raise FrameError(ErrorCode.BAD_FRAME, f"invalid frame: {nesting_message()}")
                await self._dispatch(frame, time.monotonic())
            except (FrameError, Refusal) as exc:  # a refused frame ends it only if fatal
                error = refusal_frame(exc) if isinstance(exc, Refusal) else exc
                await self._send_error(error)
                if error.fatal:
                    await self._close(_CLOSE_CODE.get(error.code, CLOSE_POLICY_VIOLATION))
                    return

    async def _receive(self) -> Message | None:
        """The next message from the client; None once the sender has dropped it (too slow
        to read, or its socket failed), so that the connection ends."""
        receive = asyncio.ensure_future(self.websocket.receive())
        gone = asyncio.ensure_future(self.sender.wait_gone())
        try:
            await asyncio.wait({receive, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not receive.done():
                receive.cancel()
        if receive.done() and not receive.cancelled():
            return receive.result()
        return None

    # ------------------------------------------------------------------ frames

    async def _dispatch(self, frame: ClientFrame, received: float) -> None:
        if self.state is State.CLOSED:
            raise FrameError(ErrorCode.SHUTTING_DOWN, "this connection is closing")
        if isinstance(frame, User):
            await self._start_turn(frame, received)
        elif isinstance(frame, Cancel):
            if self._turn is not None:  # a cancel racing the end of an answer is harmless
                self._turn.cancel(FinishReason.CANCELLED)
        elif self.state is not State.ACCEPTED:
            raise FrameError(ErrorCode.SESSION_ALREADY_OPEN, "this connection has a session")
        elif isinstance(frame, Open):
            await self._open(frame)
        elif isinstance(frame, Resume):
            await self._resume(frame)

    async def _open(self, frame: Open) -> None:
        parts = self.parts
        key = frame.api_key or bearer(self.websocket.headers)
        principal = parts.gate.authenticate(key, client_address(self.websocket))
        limit = parts.limits.max_system_chars
        if frame.system is not None and len(frame.system) > limit:
            raise FrameError(
                ErrorCode.MESSAGE_TOO_LONG,
                f"the system prompt is over {limit} characters",
                limit=limit,
            )
        store = parts.stores(principal.tenant)
        try:
            new = await store.create(model_id=parts.engine.model_id, system=frame.system)
        except redis.exceptions.RedisError as exc:
            raise FrameError(ErrorCode.STORAGE_UNAVAILABLE, f"session store: {exc}") from None
        self.session_id = new.meta.session_id
        self.tenant, self.store = principal.tenant, store
        self._move(State.READY)
        parts.metrics.sessions_opened.labels("created").inc()
        await self.send(
            SessionOpened(
                session_id=new.meta.session_id,
                secret=new.secret,
                resumed=False,
                system=frame.system,
                messages=[],
                history_tokens=0,
            )
        )

    async def _resume(self, frame: Resume) -> None:
        gate, address = self.parts.gate, client_address(self.websocket)
        principal = gate.authenticate(frame.api_key or bearer(self.websocket.headers), address)
        attempt = gate.resume_attempt(address, principal.tenant, frame.session_id)
        store = self.parts.stores(principal.tenant)
        try:
            meta = await store.authenticate(frame.session_id, frame.secret)
            _, page_map = await store.load(frame.session_id)
            messages = await store.messages(frame.session_id)
        except SessionNotFound:
            attempt.failed()
            raise FrameError(ErrorCode.UNKNOWN_SESSION, "unknown or expired session") from None
        except WrongSecret:
            attempt.failed()
            raise FrameError(ErrorCode.WRONG_SECRET, "wrong secret for this session") from None
        except redis.exceptions.RedisError as exc:
            raise FrameError(ErrorCode.STORAGE_UNAVAILABLE, f"session store: {exc}") from None
        attempt.succeeded()
        self.session_id = meta.session_id
        self.tenant, self.store = principal.tenant, store
        self._move(State.READY)
        self.parts.metrics.sessions_opened.labels("resumed").inc()
        await self.send(
            SessionOpened(
                session_id=meta.session_id,
                resumed=True,
                system=meta.system,
                messages=[
                    ChatMessage(role=m.role.value, content=m.content, finish_reason=m.finish_reason)
                    for m in messages
                ],
                history_tokens=len(page_map.token_ids) if page_map else 0,
            )
        )

    async def _start_turn(self, frame: User, received: float) -> None:
        if self.state is State.ACCEPTED:
            raise FrameError(ErrorCode.NO_SESSION, "send open or resume first")
        if self.state is State.STREAMING:
            raise FrameError(ErrorCode.BUSY, "an answer is streaming; wait for done or cancel")
        limits = self.parts.limits
        if len(frame.content) > limits.max_message_chars:
            raise FrameError(
                ErrorCode.MESSAGE_TOO_LONG,
                f"the message has {len(frame.content)} characters; the limit is "
                f"{limits.max_message_chars}",
                limit=limits.max_message_chars,
            )
        asked, params = self._params(frame.params)
        if params.structured is not None:
            try:
                await self.parts.engine.check_structured(params.structured)
            except GrammarError as exc:
                raise FrameError(
                    ErrorCode.INVALID_PARAMS,
                    f"response_format: cannot constrain the answer to it: {exc}",
                ) from None
        assert self.session_id is not None
        refusal = self.parts.admission.begin_turn(self.session_id)
        if refusal is not None:
            raise refusal_frame(refusal)
        self._move(State.STREAMING)
        assert self.store is not None and self.tenant is not None  # set with the session
        parts = self.parts
        turn = Turn(
            parts.engine,
            parts.conversations,
            parts.metrics,
            self.store,
            self.tenant,
            self.session_id,
            frame.content,
            asked,
            limits=parts.limits,
            received=received,
            send=self.send,
        )
        self._turn = turn
        self._turn_task = asyncio.create_task(self._answer(turn), name=f"turn {self.session_id}")

    def _params(self, asked: UserParams) -> tuple[AskedSampling, SamplingParams]:
        """The frame's params as the one value, and built without the room (which the turn
        checks once it has the prompt), so that what no prompt makes right is refused now."""
        limits = self.parts.limits
        try:
            sampling = user_sampling(asked)
            params = sampling_params(
                sampling,
                limits,
                default_max_tokens=limits.default_max_tokens,
                tokenizer=self.parts.engine.tokenizer,
            )
        except SamplingError as exc:
            raise sampling_frame_error(exc) from None
        return sampling, params

    async def _answer(self, turn: Turn) -> None:
        try:
            await turn.run()
        except FrameError as exc:
            await self._send_error_quietly(exc)
        except ClientGone:
            pass
        except Exception:
            log.exception("turn of session %s failed", turn.session_id)
            await self._send_error_quietly(FrameError(ErrorCode.INTERNAL, "internal error"))
        finally:
            self.parts.admission.end_turn(turn.session_id)
            self._turn = None
            if self.state is State.STREAMING:
                self._move(State.READY)

    # ------------------------------------------------------------------ sending

    @property
    def sender(self) -> FrameSender:
        if self._sender is None:
            raise RuntimeError("the connection is not accepted")
        return self._sender

    async def send(self, frame: ServerFrame) -> None:
        """Queue one frame for the client; ClientGone once it is gone or too slow to read."""
        await self.sender.send(frame)

    async def _send_error(self, exc: FrameError) -> None:
        self.parts.metrics.errors.labels(exc.code.value).inc()
        await self.send(exc.frame())

    async def _send_error_quietly(self, exc: FrameError) -> None:
        with contextlib.suppress(ClientGone):
            await self._send_error(exc)

    async def _close(self, code: int) -> None:
        """Send what is queued, then the close frame."""
        await self.sender.close(code)
