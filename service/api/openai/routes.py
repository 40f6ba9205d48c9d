"""OpenAI-compatible HTTP: POST /v1/chat/completions and /v1/completions (JSON, or an SSE
stream), POST /v1/responses and GET / DELETE /v1/responses/{id} (responses.py), GET /v1/models
and /v1/models/{name}; vLLM's POST /tokenize and /detokenize.

Chat and text completions are stateless: each request carries its whole conversation, rendered
with the model's chat template (message contents as plain text, never special tokens). The
prefix cache still serves whatever an earlier request computed: a shared system prompt, or the
conversation so far when a client resends it with one more message. A stored response is the
one state: its conversation, for `previous_response_id`.

Errors come in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: 400 for a
request that cannot be served as sent, 404 for another model's name, 413 for a body over the
limit, 429 when the server is answering as many requests as it takes, 503 while it shuts
down. An answer that fails after its stream began ends with one such error as an SSE event.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
import redis.exceptions
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import PlainTextResponse, Response

from service.api.access.gate import cache_salt_for
from service.api.access.guard import principal_of
from service.api.admission import Admission
from service.api.limits import Limits
from service.api.observability.metrics import Metrics
from service.api.openai.answer import Answer, AnyRequest
from service.api.openai.chat_request import (
    ChatCompletionRequest,
    decode_request,
    render_prompt,
    request_tools,
)
from service.api.openai.completion_request import (
    CompletionRequest,
    completion_prompt,
    decode_completion_request,
)
from service.api.openai.errors import OpenAIError, invalid, model_not_found, refusal_error
from service.api.openai.params import sampling_error, structured_output
from service.api.openai.responses import (
    ResponseAnswer,
    StoredResponse,
    as_responses_error,
    chat_body,
    decode_responses_request,
    input_messages,
    read_stored,
    stored,
)
from service.api.openai.sse import EventStream, until_disconnected
from service.api.openai.tokenize import detokenize_request, tokenize_request
from service.api.openai.tools import Tools, parameters_of
from service.api.sampling import Room, SamplingError, sampling_params
from service.engine.params import SamplingParams, StructuredOutput
from service.engine.serving import ServingEngine
from service.engine.values import CacheScope, GrammarError
from service.sessions.prompt import ChatFormat
from service.sessions.store import SessionStore

_json = msgspec.json.Encoder()
T = TypeVar("T")

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------- the endpoint


@dataclass(slots=True, frozen=True)
class OpenAIParts:
    """What the OpenAI endpoints work with; the server hands them over once started."""

    limits: Limits
    engine: ServingEngine
    chat_format: ChatFormat
    admission: Admission
    metrics: Metrics
    # The model names this server answers to (--served-model-name), the first the one it
    # reports.
    names: tuple[str, ...]
    # Each tenant's session store: where the Responses API keeps its stored responses.
    stores: Callable[[str], SessionStore]
    # --unknown-request-fields ignore: a body's fields no request has are dropped, not refused.
    ignore_unknown_fields: bool = False

    @property
    def max_model_len(self) -> int:
        return self.engine.limits.max_model_len

    @property
    def sizes(self) -> tuple[int, int]:
        """The context's length and the vocabulary's, which a request's fields must fit."""
        return self.max_model_len, self.engine.tokenizer.vocab_size

    def room(self, prompt: list[int]) -> Room:
        """What the context leaves for the answer to `prompt`."""
        return Room(len(prompt), self.max_model_len)


class OpenAIRoutes:
    """The handlers of OpenAI's API: /v1/chat/completions, /v1/completions and /v1/models;
    and of vLLM's /tokenize and /detokenize."""

    def __init__(self, parts: Callable[[], OpenAIParts]) -> None:
        self._parts = parts
        self._created = int(time.time())  # /v1/models' `created`: when this server started

    @property
    def parts(self) -> OpenAIParts:
        return self._parts()

    @property
    def names(self) -> tuple[str, ...]:
        return self.parts.names

    def _model(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": self._created, "owned_by": "pagechat"}

    async def models(self, request: Request) -> Response:
        body = {"object": "list", "data": [self._model(self.names[0])]}
        return Response(_json.encode(body), media_type="application/json")

    async def model(self, request: Request) -> Response:
        name = request.path_params["name"]
        if name not in self.names:
            return self._error(model_not_found(name, self.names), self.parts)
        return Response(_json.encode(self._model(name)), media_type="application/json")

    async def create(self, request: Request) -> Response:
        """POST /v1/chat/completions."""
        return await self._answer(request, self._chat)

    async def create_text(self, request: Request) -> Response:
        """POST /v1/completions."""
        return await self._answer(request, self._text)

    async def create_response(self, request: Request) -> Response:
        """POST /v1/responses: the chat answer its fields ask for, as a Response."""
        received = time.monotonic()
        parts = self.parts
        store = parts.stores(principal_of(request).tenant)
        try:
            body = await self._read(request, parts.limits)
            rreq = decode_responses_request(body, parts.ignore_unknown_fields)
            if rreq.model is not None and rreq.model not in parts.names:
                raise model_not_found(rreq.model, parts.names)
            history = await self._history(store, rreq.previous_response_id)
            messages = input_messages(rreq)
            req, prompt, params = self._chat(chat_body(rreq, history, messages), parts)
            await _check_structured(parts.engine, req, params)
        except OpenAIError as exc:
            return self._error(as_responses_error(exc), parts)
        except SamplingError as exc:
            return self._error(as_responses_error(sampling_error(exc)), parts)
        except ClientDisconnect:
            return self._left(request, parts)
        if (refused := _refused(parts)) is not None:
            return refused
        scope = http_cache_scope(principal_of(request).tenant, req.cache_salt)
        answer = ResponseAnswer(
            parts.engine, parts.metrics, parts.admission.end_answer, req, prompt, params,
            received, scope, rreq.model or parts.names[0],
            responses_req=rreq, messages=[*history, *messages],
        )  # fmt: skip
        if rreq.stream:
            events = answer.response_events(before_final=lambda: _store(answer, store))
            return EventStream(events, on_close=answer.close)
        result = await _unless_gone(request, answer.whole_response(), answer.close)
        if result is None:
            return Response(status_code=499)  # nobody is there to read it
        if isinstance(result, OpenAIError):
            return self._error(result, parts)
        await _store(answer, store)
        return Response(_json.encode(result), media_type="application/json")

    async def get_response(self, request: Request) -> Response:
        """GET /v1/responses/{id}: a stored response as it was returned."""
        parts = self.parts
        response_id = request.path_params["response_id"]
        store = parts.stores(principal_of(request).tenant)
        try:
            record = await self._stored(store, response_id, "response_id")
        except OpenAIError as exc:
            return self._error(exc, parts)
        return Response(_json.encode(record.response), media_type="application/json")

    async def delete_response(self, request: Request) -> Response:
        """DELETE /v1/responses/{id}: forget a stored response (chaining to it then fails)."""
        parts = self.parts
        response_id = request.path_params["response_id"]
        store = parts.stores(principal_of(request).tenant)
        try:
            deleted = await store.delete_response(response_id)
        except redis.exceptions.RedisError as exc:
            return self._error(_store_down(exc), parts)
        if not deleted:
            return self._error(_no_response(response_id, "response_id"), parts)
        body = {"id": response_id, "object": "response.deleted", "deleted": True}
        return Response(_json.encode(body), media_type="application/json")

    async def _history(self, store: SessionStore, response_id: str | None) -> list[dict[str, Any]]:
        """The conversation `previous_response_id` ends, as chat messages."""
        if response_id is None:
            return []
        record = await self._stored(store, response_id, "previous_response_id")
        return record.messages

    @staticmethod
    async def _stored(store: SessionStore, response_id: str, param: str) -> StoredResponse:
        try:
            raw = await store.load_response(response_id)
        except redis.exceptions.RedisError as exc:
            raise _store_down(exc) from None
        if raw is None:
            raise _no_response(response_id, param)
        return read_stored(raw)

    async def tokenize(self, request: Request) -> Response:
        """POST /tokenize (vLLM's): a prompt's or a conversation's token ids."""
        return await self._reply(
            request,
            lambda body, p: tokenize_request(
                body, p.names, p.chat_format, p.limits, p.max_model_len
            ),
        )

    async def detokenize(self, request: Request) -> Response:
        """POST /detokenize (vLLM's): token ids as text."""
        return await self._reply(
            request,
            lambda body, p: detokenize_request(body, p.names, p.engine.tokenizer, p.max_model_len),
        )

    async def _reply(
        self, request: Request, handle: Callable[[bytes, OpenAIParts], dict[str, Any]]
    ) -> Response:
        """A request answered at once, on the event loop, without the engine."""
        parts = self.parts
        try:
            result = handle(await self._read(request, parts.limits), parts)
        except OpenAIError as exc:
            return self._error(exc, parts)
        except ClientDisconnect:
            return self._left(request, parts)
        return Response(_json.encode(result), media_type="application/json")

    @staticmethod
    def _chat(
        body: bytes, parts: OpenAIParts
    ) -> tuple[ChatCompletionRequest, list[int], SamplingParams]:
        req = decode_request(body, parts.names, parts.ignore_unknown_fields)
        prompt = render_prompt(req, parts.chat_format, parts.limits, parts.sizes[0])
        # Two hops: the request as one value, then the one builder (service/api/sampling.py),
        # whose SamplingError `_answer` words as OpenAI's.
        params = sampling_params(
            req.sampling(), parts.limits, default_max_tokens=parts.limits.default_max_tokens,
            room=parts.room(prompt), tokenizer=parts.engine.tokenizer,
        )  # fmt: skip
        return req, prompt, params

    @staticmethod
    def _text(
        body: bytes, parts: OpenAIParts
    ) -> tuple[CompletionRequest, list[int], SamplingParams]:
        req = decode_completion_request(body, parts.names, parts.ignore_unknown_fields)
        prompt = completion_prompt(req, parts.engine.tokenizer, parts.limits)
        params = sampling_params(
            req.sampling(), parts.limits, default_max_tokens=parts.limits.default_completion_tokens,
            room=parts.room(prompt), tokenizer=parts.engine.tokenizer,
        )  # fmt: skip
        return req, prompt, params

    async def _answer(
        self,
        request: Request,
        parse: Callable[[bytes, OpenAIParts], tuple[AnyRequest, list[int], SamplingParams]],
    ) -> Response:
        received = time.monotonic()
        parts = self.parts
        limits = parts.limits
        try:
            req, prompt, params = parse(await self._read(request, limits), parts)
            await _check_structured(parts.engine, req, params)
        except OpenAIError as exc:
            return self._error(exc, parts)
        except SamplingError as exc:
            return self._error(sampling_error(exc), parts)
        except ClientDisconnect:
            return self._left(request, parts)
        if (refused := _refused(parts)) is not None:
            return refused
        scope = http_cache_scope(principal_of(request).tenant, req.cache_salt)
        model = req.model or parts.names[0]  # answers name the model as it was asked for
        release = parts.admission.end_answer
        completion = Answer(
            parts.engine, parts.metrics, release, req, prompt, params, received, scope, model
        )
        if req.stream:
            return EventStream(completion.events(), on_close=completion.close)
        answer = await _unless_gone(request, completion.whole(), completion.close)
        return Response(status_code=499) if answer is None else answer  # 499: nobody is there

    @staticmethod
    async def _read(request: Request, limits: Limits) -> bytes:
        """The body: OpenAIError for one over the limit (413) or not there in time (408)."""
        try:
            async with asyncio.timeout(limits.body_timeout_s):
                return await _body(request, limits.max_body_bytes)
        except TimeoutError:
            raise OpenAIError(
                408,
                f"the request's body did not arrive within {limits.body_timeout_s:g} s",
                "request_timeout",
                headers={"Connection": "close"},  # what is left of the body is never read
            ) from None

    @staticmethod
    def _left(request: Request, parts: OpenAIParts) -> Response:
        # The client's own doing: one line, not a server error with a traceback.
        log.info("%s %s: the client left before its body ended", request.method, request.url.path)
        parts.metrics.errors.labels("client_disconnected").inc()
        return Response(status_code=499)

    @staticmethod
    def _error(exc: OpenAIError, parts: OpenAIParts) -> Response:
        parts.metrics.errors.labels(exc.code).inc()
        return exc.response()


def _refused(parts: OpenAIParts) -> Response | None:
    """A slot for one more answer, or the refusal to send (counted)."""
    refusal = parts.admission.begin_answer()
    if refusal is None:
        return None
    parts.metrics.errors.labels(refusal.reason.value).inc()
    return refusal_error(refusal).response()


async def _unless_gone(
    request: Request, work: Coroutine[Any, Any, T], close: Callable[[], None]
) -> T | None:
    """`work`'s result, or None where the client left first: it is then cancelled, which
    aborts its engine request before the next step. `close` runs either way."""
    task = asyncio.create_task(work)
    gone = asyncio.create_task(until_disconnected(request.receive))
    try:
        await asyncio.wait([task, gone], return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():  # the client left (or we were cancelled): stop generating
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        close()
    return None if task.cancelled() else task.result()


async def _store(answer: ResponseAnswer, store: SessionStore) -> None:
    """Keep a finished response where `store` asks; where Redis fails, the response is
    still answered, its `store` false (nothing can be chained to it)."""
    record = stored(answer)
    if record is None or answer.final is None:
        return
    try:
        await store.save_response(answer.id, record)
    except redis.exceptions.RedisError as exc:
        log.warning("response %s not stored: %s", answer.id, exc)
        answer.final["store"] = False


def _no_response(response_id: str, param: str) -> OpenAIError:
    return OpenAIError(
        404,
        f"{param} {response_id!r}: no stored response has this id (never stored, deleted, or "
        "past the store's TTL)",
        "response_not_found",
        param,
    )


def _store_down(exc: Exception) -> OpenAIError:
    return OpenAIError(503, f"the response store is unavailable: {exc}", "store_unavailable")


async def _check_structured(engine: ServingEngine, req: AnyRequest, params: SamplingParams) -> None:
    """A 400 naming the field whose schema, regex or grammar cannot be matched: for forced
    tool calls, the function whose parameters cannot be (each is checked on its own first, so
    that no message shows the call grammar built around them)."""
    if params.structured is None:
        return
    asked = structured_output(req)
    if asked is None and isinstance(req, ChatCompletionRequest):
        await _check_tool_parameters(engine, request_tools(req))
    try:
        await engine.check_structured(params.structured)
    except GrammarError as exc:
        if asked is None:  # the call grammar around parameters that each compile
            log.info("a call grammar was refused: %s", exc)
            raise invalid(
                "tools: the answer cannot be constrained to calls of these functions together",
                "tools",
            ) from None
        param = asked[1]
        raise invalid(f"{param}: cannot constrain the answer to it: {exc}", param) from None


async def _check_tool_parameters(engine: ServingEngine, tools: Tools) -> None:
    for i, function in enumerate(tools.functions):
        if tools.named not in (None, function.name):
            continue
        schema = StructuredOutput(kind="json", spec=json.dumps(parameters_of(function)))
        try:
            await engine.check_structured(schema)
        except GrammarError as exc:
            param = f"tools[{i}].function.parameters"
            raise invalid(
                f"{param}: cannot constrain the calls' arguments to it: {exc}", param
            ) from None


async def http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own 404s and 405s, and any error no endpoint caught (a 500): in OpenAI's
    error shape under /v1/ and on /tokenize and /detokenize, so that a client of the API
    always gets JSON; as plain text elsewhere, as Starlette writes them."""
    if isinstance(exc, HTTPException):
        status, detail, headers = exc.status_code, exc.detail, exc.headers
    else:
        status, detail, headers = 500, "Internal Server Error", None
    path = request.url.path
    if not path.startswith("/v1/") and path not in ("/tokenize", "/detokenize"):
        return PlainTextResponse(detail, status, headers=headers)
    code = {404: "not_found", 405: "method_not_allowed"}.get(status, "internal_error")
    message = f"{request.method} {path}: {detail}"
    return OpenAIError(status, message, code).response(headers)


def http_cache_scope(tenant: str, cache_salt: str | None) -> CacheScope:
    """Requests carry whole conversations, so a resent conversation hits the cache only if
    requests share it: they do, within their tenant and their `cache_salt` (vLLM's field),
    which a client sets to keep its prompts from other clients of the same tenant."""
    return CacheScope(salt=cache_salt_for(tenant, cache_salt))


async def _body(request: Request, limit: int) -> bytes:
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise OpenAIError(413, f"the body exceeds {limit} bytes", "request_too_large")
    return body
