"""One answer: prompt from the stored token ids, stream from the engine, store what was said.

NOTE (what is stored): the turn's token ids exactly as the model saw them: the prompt, every
token delivered to the client, then the template's end-of-turn tokens. A cancelled,
interrupted or disconnected answer is stored as far as it got, so history is never lost and
the next turn still starts from a prefix the cache may hold.
NOTE (cancellation): the turn itself is never cancelled; `cancel` cancels its pump task, whose
`aclosing` aborts the engine request before the engine's next step. The turn then stores the
partial answer and reports it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import redis.exceptions

from protocol.frames import (
    Delta,
    Done,
    ErrorCode,
    FinishReason,
    FrameError,
    ServerFrame,
    Timing,
    Usage,
)
from service.api.access.gate import cache_salt_for
from service.api.limits import Limits
from service.api.observability.meter import AnswerMeter
from service.api.observability.metrics import Metrics
from service.api.sampling import (
    AskedSampling,
    Room,
    SamplingError,
    SamplingErrorKind,
    sampling_params,
)
from service.api.ws.sender import ClientGone
from service.engine.params import SamplingParams
from service.engine.serving import ServingEngine
from service.engine.values import EngineDeadError, RequestError, RequestOutput
from service.engine.values import FinishReason as EngineFinishReason
from service.sessions.conversation_cache import ConversationCache
from service.sessions.models import Message, PageMap, Role, SessionMeta
from service.sessions.store import (
    LEASE_S,
    LeaseLost,
    SessionBusy,
    SessionNotFound,
    SessionStore,
    TurnLease,
)

log = logging.getLogger(__name__)

Send = Callable[[ServerFrame], Awaitable[None]]


class Turn:
    def __init__(
        self,
        engine: ServingEngine,
        conversations: ConversationCache,
        metrics: Metrics,
        store: SessionStore,
        tenant: str,
        session_id: str,
        content: str,
        asked: AskedSampling,
        *,
        limits: Limits,
        received: float,
        send: Send,
    ) -> None:
        self.engine = engine
        self.conversations = conversations  # cache scopes, page maps, tail prefills
        self.meter = AnswerMeter(metrics, received)
        self.store = store  # the tenant's sessions
        self.tenant = tenant
        self.session_id = session_id
        self.content = content
        self.asked = asked  # checked by the connection, all but the room
        self.limits = limits
        # The engine's parameters, once the prompt is known (`sampling_params` with the room).
        self.params: SamplingParams | None = None
        self.received = received  # time.monotonic() when the user frame arrived
        self._send = send
        self._pump: asyncio.Task[None] | None = None
        self._cancel_reason: FinishReason | None = None
        # Filled by the pump as outputs arrive.
        self.answer: list[int] = []
        self.text = ""
        self._last: RequestOutput | None = None

    def cancel(self, reason: FinishReason) -> None:
        """Stop the answer (the first reason given wins); safe to call at any point."""
        if self._cancel_reason is None:
            self._cancel_reason = reason
        if self._pump is not None:
            self._pump.cancel()

    async def run(self) -> None:
        """Answer, store and report; FrameError when the turn is refused before it starts."""
        store = self.store
        try:
            lease = await store.begin_turn(self.session_id)
        except SessionNotFound:
            raise FrameError(ErrorCode.UNKNOWN_SESSION, "the session expired") from None
        except SessionBusy:
            raise FrameError(
                ErrorCode.BUSY, "this session is answering on another connection or replica"
            ) from None
        except redis.exceptions.RedisError as exc:
            raise FrameError(ErrorCode.STORAGE_UNAVAILABLE, f"session store: {exc}") from None
        keeper = asyncio.create_task(self._keep(lease), name=f"lease {self.session_id}")
        try:
            done = await self._run(lease)
        finally:
            keeper.cancel()
            try:
                await store.end_turn(lease)
            except redis.exceptions.RedisError as exc:  # retried once Redis is back (store.py)
                log.warning("could not release the turn lease of %s: %s", self.session_id, exc)
        # Only now: a client may send its next message the moment it reads `done`.
        if done is not None:
            await self._send(done)

    async def _keep(self, lease: TurnLease) -> None:
        """Renew the turn lease while the answer runs, well within its length."""
        while True:
            await asyncio.sleep(LEASE_S / 3)
            try:
                await self.store.renew_turn(lease)
            except LeaseLost:
                log.warning(
                    "the turn lease of %s was lost; the answer will not be stored", self.session_id
                )
                return
            except redis.exceptions.RedisError as exc:
                log.warning("could not renew the turn lease of %s: %s", self.session_id, exc)

    async def _run(self, lease: TurnLease) -> Done | None:
        """Answer and store; the `done` frame to send (None: the client is gone)."""
        conversations = self.conversations
        try:
            meta, page_map = await self.store.load(self.session_id)
            prompt = await self._prompt(meta, page_map)
        except SessionNotFound:
            raise FrameError(ErrorCode.UNKNOWN_SESSION, "the session expired") from None
        except redis.exceptions.RedisError as exc:
            raise FrameError(ErrorCode.STORAGE_UNAVAILABLE, f"session store: {exc}") from None
        try:  # NOTE (room) in service/api/sampling.py: the rule of every transport
            self.params = params = sampling_params(
                self.asked,
                self.limits,
                default_max_tokens=self.limits.default_max_tokens,
                room=Room(len(prompt), self.engine.limits.max_model_len),
                tokenizer=self.engine.tokenizer,
            )
        except SamplingError as exc:
            raise sampling_frame_error(exc) from None
        if self._cancel_reason is not None:
            # Cancelled before it began: nothing was generated, so nothing is stored.
            reason = self._cancel_reason
        else:
            await conversations.wait_for_tail(self.session_id)
            scope = conversations.scope(cache_salt_for(self.tenant), self.session_id, meta.system)
            stream = self.engine.generate(
                prompt,
                params,
                request_id=f"{self.session_id}/{meta.turns}",
                cache_scope=scope,
            )
            self._pump = asyncio.create_task(self._stream(stream), name=f"pump {self.session_id}")
            await asyncio.wait([self._pump])
            reason, failure = self._outcome(self._pump)
            if failure is None or self.answer:  # whatever ended it, what was said is kept
                ids = prompt + self.answer + conversations.chat_format.close_turn(self.answer)
                try:
                    await self._store(lease, ids, reason)
                except (redis.exceptions.RedisError, LeaseLost) as exc:
                    log.error("could not store turn %s of %s: %s", meta.turns, self.session_id, exc)
                    raise FrameError(
                        ErrorCode.STORAGE_UNAVAILABLE, f"the answer could not be stored: {exc}"
                    ) from None
                if failure is None:
                    conversations.prefill_tail(self.session_id, ids, scope)
            if failure is not None:
                raise failure
        total = self.meter.end([reason.value])
        if reason is FinishReason.DISCONNECTED:
            return None
        return Done(
            turn=meta.turns,
            finish_reason=reason,
            usage=self._usage(len(prompt)),
            timing=self._timing(total),
        )

    async def _prompt(self, meta: SessionMeta, page_map: PageMap | None) -> list[int]:
        fmt = self.conversations.chat_format
        if page_map is not None and page_map.model_id == self.engine.model_id:
            return fmt.next_prompt(page_map.token_ids, self.content)
        if meta.turns == 0:
            return fmt.first_prompt(meta.system, self.content)
        # Stored for another model: its token ids mean nothing here; the text still does.
        messages = await self.store.messages(self.session_id)
        return fmt.render(meta.system, messages, self.content)

    async def _stream(self, stream: AsyncIterator[RequestOutput]) -> None:
        want_logprobs = self.params is not None and self.params.logprobs is not None
        async with contextlib.aclosing(stream):  # type: ignore[type-var]
            async for out in stream:
                self.meter.output(out)
                self._last = out
                self.answer += out.new_token_ids
                self.text += out.new_text
                await self._send(
                    Delta(
                        text=out.new_text,
                        token_ids=out.new_token_ids,
                        logprobs=out.logprobs if want_logprobs else None,
                    )
                )
                if out.finish_reason is EngineFinishReason.ERROR:
                    raise GrammarBrokeOff(out.num_output_tokens, out.error or "")

    def _outcome(self, pump: asyncio.Task[None]) -> tuple[FinishReason, Exception | None]:
        """Why the answer ended, and the error to report after storing it (None: no error)."""
        if pump.cancelled():
            return self._cancel_reason or FinishReason.CANCELLED, None
        exc = pump.exception()
        if isinstance(exc, ClientGone):
            return FinishReason.DISCONNECTED, None
        failure: Exception
        if isinstance(exc, GrammarBrokeOff):
            failure = FrameError(ErrorCode.INVALID_PARAMS, str(exc))
        elif isinstance(exc, RequestError):
            failure = FrameError(ErrorCode.CONTEXT_LENGTH, str(exc))
        elif isinstance(exc, EngineDeadError):
            failure = FrameError(ErrorCode.INTERNAL, str(exc))
        elif isinstance(exc, Exception):
            failure = exc  # a bug: reported as internal by the connection, after the store
        elif exc is None:
            return wire_reason(self._last.finish_reason if self._last else None), None
        else:
            raise exc  # KeyboardInterrupt and the like are not the turn's to handle
        return FinishReason.ERROR, failure

    async def _store(self, lease: TurnLease, ids: list[int], reason: FinishReason) -> None:
        page_map = self.conversations.page_map(ids)
        now = page_map.updated
        messages = [
            Message(role=Role.USER, content=self.content, created=now),
            Message(role=Role.ASSISTANT, content=self.text, created=now, finish_reason=reason),
        ]
        await self.store.append_turn(lease, messages, page_map)

    def _usage(self, prompt_tokens: int) -> Usage:
        last = self._last
        cached = last.num_cached_tokens if last else 0
        swapped = last.num_swapped_in_tokens if last else 0
        loaded = last.num_loaded_tokens if last else 0
        return Usage(
            prompt_tokens=prompt_tokens,
            cached_tokens=cached,
            swapped_in_tokens=swapped,
            loaded_tokens=loaded,
            # Unknown (0) when the answer ended before the engine reported anything.
            recomputed_tokens=prompt_tokens - cached - swapped - loaded if last else 0,
            completion_tokens=len(self.answer),
        )

    def _timing(self, total: float) -> Timing:
        last = self._last
        scheduled = last.first_scheduled_time if last else None
        first = self.meter.first_token_at
        return Timing(
            queue_s=None if scheduled is None else max(0.0, scheduled - self.received),
            ttft_s=None if first is None else first - self.received,
            total_s=total,
        )


def sampling_frame_error(exc: SamplingError) -> FrameError:
    """The one builder's refusal (service/api/sampling.py) as this protocol's error."""
    code = {
        SamplingErrorKind.OVER_LIMIT: ErrorCode.MAX_TOKENS_TOO_LARGE,
        SamplingErrorKind.CONTEXT: ErrorCode.CONTEXT_LENGTH,
    }.get(exc.kind, ErrorCode.INVALID_PARAMS)
    return FrameError(code, str(exc))


class GrammarBrokeOff(Exception):
    """The answer's grammar broke off mid-answer (the engine's finish reason ERROR): its text
    does not match, so the turn is stored as `error` and reported as `invalid_params`."""

    def __init__(self, tokens: int, why: str) -> None:
        super().__init__(
            f"params.response_format: the answer broke off after {tokens} token"
            f"{'' if tokens == 1 else 's'}, where the "
            f"grammar engine could not follow it further: {why}"
        )


def wire_reason(reason: EngineFinishReason | None) -> FinishReason:
    """The engine's finish reason in the protocol's words: `length` is length, `stop` stop.
    (The engine's `abort` never reaches here: a turn aborts only by leaving its stream, and
    then its own reason stands: cancelled, shutdown or disconnected.)"""
    return FinishReason.LENGTH if reason is EngineFinishReason.LENGTH else FinishReason.STOP
