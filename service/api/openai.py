"""OpenAI-compatible HTTP: POST /v1/chat/completions (JSON, or an SSE stream) and GET /v1/models.

Stateless: each request carries its whole conversation, rendered with the model's chat
template (message contents as plain text, never special tokens). The prefix cache still
serves whatever an earlier request computed: a shared system prompt, or the conversation so
far when a client resends it with one more message.

Errors come in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: 400 for a
request that cannot be served as sent, 404 for another model's name, 413 for a body over the
limit, 429 when the server is answering as many requests as it takes, 503 while it shuts
down. An answer that fails after its stream began ends with one such error as an SSE event.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from service.api.frames import ErrorCode, FrameError
from service.engine.async_engine import EngineDeadError
from service.engine.engine import RequestError, RequestOutput
from service.engine.params import SamplingParams
from service.engine.sequence import FinishReason

if TYPE_CHECKING:
    from service.api.service import ChatService

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
# What an admission refusal of ChatService.begin_turn becomes here.
STATUS_OF = {ErrorCode.SHUTTING_DOWN: 503, ErrorCode.OVERLOADED: 429}

_json = msgspec.json.Encoder()


# ---------------------------------------------------------------------- request


class TextPart(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: str
    text: str = ""


class ChatMessageIn(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None


class StreamOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    include_usage: bool = False


class ChatCompletionRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The subset of OpenAI's request this server honours; any other field is refused."""

    messages: list[ChatMessageIn]
    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None  # accepted, unused
    # Accepted only at their neutral values, so a client that sends the defaults still works.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: bool = False


class OpenAIError(Exception):
    def __init__(
        self, status: int, message: str, code: str, param: str | None = None, kind: str = ""
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> Response:
        return Response(_json.encode(self.body()), self.status, media_type="application/json")


def _invalid(message: str, param: str | None = None, code: str = "invalid_value") -> OpenAIError:
    return OpenAIError(400, message, code, param)


# ---------------------------------------------------------------------- the endpoint


class ChatCompletions:
    """The handler of /v1/chat/completions, and of /v1/models."""

    def __init__(self, service: ChatService) -> None:
        self.service = service

    async def models(self, request: Request) -> Response:
        body = {
            "object": "list",
            "data": [
                {
                    "id": self.service.model_id,
                    "object": "model",
                    "created": 0,
                    "owned_by": "pagechat",
                }
            ],
        }
        return Response(_json.encode(body), media_type="application/json")

    async def create(self, request: Request) -> Response:
        received = time.monotonic()
        try:
            req = await self._parse(request)
            prompt = self._prompt(req)
            params = self._params(req, len(prompt))
        except OpenAIError as exc:
            return self._error(exc)
        key = f"http:{uuid.uuid4().hex}"  # an in-flight answer, as a session's turn is
        refused = self.service.begin_turn(key)
        if refused is not None:
            return self._error(_refusal(refused))
        completion = _Completion(self.service, req, prompt, params, key, received)
        if req.stream:
            return EventStream(completion.events(), on_close=completion.close)
        answer = asyncio.create_task(completion.whole())
        gone = asyncio.create_task(_until_disconnected(request.receive))
        try:
            await asyncio.wait([answer, gone], return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not answer.done():  # the client left (or we were cancelled): stop generating
                answer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await answer
            completion.close()
        if answer.cancelled():
            return Response(status_code=499)  # nobody is there to read it
        return answer.result()

    def _error(self, exc: OpenAIError) -> Response:
        self.service.metrics.errors.labels(exc.code).inc()
        return exc.response()

    async def _parse(self, request: Request) -> ChatCompletionRequest:
        limits = self.service.config.limits
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > limits.ws_max_size:
                raise OpenAIError(
                    413, f"the body exceeds {limits.ws_max_size} bytes", "request_too_large"
                )
        try:
            req = msgspec.json.decode(body, type=ChatCompletionRequest)
        except msgspec.DecodeError as exc:
            raise _invalid(
                f"not a valid chat completion request: {exc}", code="bad_request"
            ) from None
        if req.model is not None and req.model != self.service.model_id:
            raise OpenAIError(
                404,
                f"the model {req.model!r} does not exist here; this server serves "
                f"{self.service.model_id!r} (GET /v1/models)",
                "model_not_found",
                "model",
            )
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(req, name) != 0.0:
                raise _invalid(f"{name} is not supported (only 0)", name, "unsupported_value")
        if req.logprobs:
            raise _invalid("logprobs are not supported here", "logprobs", "unsupported_value")
        return req

    def _prompt(self, req: ChatCompletionRequest) -> list[int]:
        limits = self.service.config.limits
        if not req.messages:
            raise _invalid("messages must hold at least one message", "messages")
        rendered = []
        for i, message in enumerate(req.messages):
            param = f"messages[{i}]"
            role = ROLES.get(message.role)
            if role is None:
                raise _invalid(
                    f"{param}.role {message.role!r} is not one of {sorted(ROLES)}", param
                )
            content = _text(message.content, param)
            cap = limits.max_system_chars if role == "system" else limits.max_message_chars
            if len(content) > cap:
                raise _invalid(f"{param}.content has {len(content)} characters; at most {cap}")
            rendered.append({"role": role, "content": content})
        if rendered[-1]["role"] != "user":
            raise _invalid("the last message must be the user's", "messages")
        prompt = self.service.engine.engine.tokenizer.apply_chat_template(rendered)
        max_len = self.service.engine.engine.max_model_len
        if len(prompt) >= max_len:
            raise _invalid(
                f"the messages take {len(prompt)} tokens; the model's context holds {max_len} "
                "including the answer",
                "messages",
                "context_length_exceeded",
            )
        return prompt

    def _params(self, req: ChatCompletionRequest, prompt_tokens: int) -> SamplingParams:
        limits = self.service.config.limits
        max_tokens = req.max_completion_tokens or req.max_tokens or limits.default_max_tokens
        if max_tokens > limits.max_tokens:
            raise _invalid(
                f"max_tokens is {max_tokens}; the limit is {limits.max_tokens}", "max_tokens"
            )
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stop) > 4:
            raise _invalid("stop takes at most 4 strings", "stop")
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=req.temperature,
                top_p=req.top_p,
                n=req.n,
                seed=req.seed,
                stop=tuple(stop),
            )
        except ValueError as exc:
            raise _invalid(str(exc)) from None


async def _until_disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _text(content: str | list[TextPart] | None, param: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    for part in content:
        if part.type != "text":
            raise _invalid(f"{param}: only text content parts are supported", param)
    return "".join(part.text for part in content)


def _refusal(error: FrameError) -> OpenAIError:
    status = STATUS_OF.get(error.code, 503)
    return OpenAIError(status, error.message, error.code.value)


def _finish(reason: FinishReason | None) -> str:
    return "length" if reason is FinishReason.LENGTH else "stop"


# ---------------------------------------------------------------------- one completion


class _Completion:
    """One request's answer, streamed as chunks or gathered whole."""

    def __init__(
        self,
        service: ChatService,
        req: ChatCompletionRequest,
        prompt: list[int],
        params: SamplingParams,
        key: str,
        received: float,  # time.monotonic() when the request arrived
    ) -> None:
        self.service, self.req, self.prompt, self.params, self.key = (
            service,
            req,
            prompt,
            params,
            key,
        )
        self.received = received
        self._last_token_at: float | None = None
        self._reasons: list[str] = []
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = service.model_id
        self.last: RequestOutput | None = None
        self.completion_tokens = 0
        self._closed = False

    def close(self) -> None:
        """Release the in-flight slot and count the answer (once, however it ended)."""
        if self._closed:
            return
        self._closed = True
        self.service.end_turn(self.key)
        metrics = self.service.metrics
        metrics.e2e_latency.observe(time.monotonic() - self.received)
        finished = len(self._reasons)
        for reason in self._reasons:
            metrics.turns.labels(reason).inc()
        if finished < self.params.n:  # the client left, or the engine failed, first
            metrics.turns.labels("disconnected").inc(self.params.n - finished)

    def _outputs(self) -> AsyncIterator[RequestOutput]:
        return self.service.engine.generate(self.prompt, self.params, request_id=f"{self.key}/0")

    def usage(self) -> dict[str, Any]:
        cached = self.last.num_cached_tokens + self.last.num_swapped_in_tokens if self.last else 0
        return {
            "prompt_tokens": len(self.prompt),
            "completion_tokens": self.completion_tokens,
            "total_tokens": len(self.prompt) + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    async def whole(self) -> Response:
        texts = [""] * self.params.n
        reasons: list[str | None] = [None] * self.params.n
        try:
            async with contextlib.aclosing(self._outputs()) as outputs:  # type: ignore[type-var]
                async for out in outputs:
                    self._count(out)
                    texts[out.index] += out.new_text
                    if out.finished:
                        reasons[out.index] = _finish(out.finish_reason)
        except (RequestError, EngineDeadError) as exc:
            return _failure(exc).response()
        body = {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": reasons[i] or "stop",
                }
                for i, text in enumerate(texts)
            ],
            "usage": self.usage(),
        }
        return Response(_json.encode(body), media_type="application/json")

    async def events(self) -> AsyncIterator[bytes]:
        """SSE events: a role delta per choice, content deltas, finish reasons, [DONE]."""
        for i in range(self.params.n):
            yield self._chunk([{"index": i, "delta": {"role": "assistant"}, "finish_reason": None}])
        try:
            async with contextlib.aclosing(self._outputs()) as outputs:  # type: ignore[type-var]
                async for out in outputs:
                    self._count(out)
                    delta = {"content": out.new_text} if out.new_text else {}
                    reason = _finish(out.finish_reason) if out.finished else None
                    if delta or reason:
                        choice = {"index": out.index, "delta": delta, "finish_reason": reason}
                        yield self._chunk([choice])
        except (RequestError, EngineDeadError) as exc:
            yield _event(_failure(exc).body())
            return
        options = self.req.stream_options
        if options is not None and options.include_usage:
            yield self._chunk([], usage=self.usage())
        yield b"data: [DONE]\n\n"

    def _count(self, out: RequestOutput) -> None:
        self.last = out
        self.completion_tokens += len(out.new_token_ids)
        if out.finished:
            self._reasons.append(_finish(out.finish_reason))
        if not out.new_token_ids:
            return
        metrics, now = self.service.metrics, time.monotonic()
        if self._last_token_at is None:
            metrics.time_to_first_token.observe(now - self.received)
            if out.first_scheduled_time is not None:
                metrics.queue_time.observe(max(0.0, out.first_scheduled_time - self.received))
        else:
            metrics.inter_token_latency.observe(now - self._last_token_at)
        self._last_token_at = now

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        chunk = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }
        return _event(chunk)


def _event(data: dict[str, Any]) -> bytes:
    return b"data: " + _json.encode(data) + b"\n\n"


def _failure(exc: Exception) -> OpenAIError:
    if isinstance(exc, RequestError):  # the engine refused the prompt (its context)
        return _invalid(str(exc), "messages", "context_length_exceeded")
    return OpenAIError(503, str(exc), "engine_unavailable")


# ---------------------------------------------------------------------- streaming response


class EventStream(Response):
    """A text/event-stream that stops generating the moment its client goes away.

    Starlette's StreamingResponse leaves its iterator suspended when the client disconnects
    (closed only when collected), which would keep the engine request running. Here the
    pump is cancelled on `http.disconnect`, and the iterator is closed in every case, which
    aborts the engine request before its next step.
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        self.events = events
        self.on_close = on_close
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def pump() -> None:
            async with contextlib.aclosing(self.events) as events:  # type: ignore[type-var]
                await send(
                    {"type": "http.response.start", "status": 200, "headers": self.raw_headers}
                )
                async for data in events:
                    await send({"type": "http.response.body", "body": data, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            streaming.cancel()

        streaming = asyncio.create_task(pump())
        watcher = asyncio.create_task(watch())
        try:
            await asyncio.wait([streaming])
        finally:
            watcher.cancel()
            if not streaming.done():  # we were cancelled ourselves
                streaming.cancel()
            self.on_close()
        if not streaming.cancelled() and streaming.exception() is not None:
            exc = streaming.exception()
            if not isinstance(exc, OSError):  # a client gone mid-send is no error of ours
                raise exc  # type: ignore[misc]
