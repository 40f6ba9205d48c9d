"""OpenAI's Responses API (POST /v1/responses, GET and DELETE /v1/responses/{id}): a request
turned into the chat completion it asks for, answered by the same engine path, and written
back as a Response object or as its semantic stream events.

NOTE (one path): a Responses request is translated, field by field, into a chat completion
request (input items -> messages, `instructions` -> a system message first, function tools
and `tool_choice` -> their chat forms, `text.format` -> `response_format`,
`max_output_tokens` -> `max_completion_tokens`), which the chat path checks, renders through
the model's template and samples exactly as POST /v1/chat/completions would. Only the
answer's shape differs (`ResponseAnswer`): output items (a message with output_text, one
function_call item per call) and `response.*` events.

NOTE (chaining): with `store` (the default, as OpenAI's), the conversation a response ends
(its messages, instructions excluded, then its output) is kept in Redis under its id for the
sessions' TTL, tenant by tenant; `previous_response_id` continues it. The next prompt is the
stored conversation plus the new input, rendered by the same template: its blocks are still
in the prefix cache (or its tiers) and only the new input is computed, as a WebSocket resume.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from service.api.openai.answer import Answer, _failure, _finish
from service.api.openai.errors import OpenAIError, invalid, unsupported
from service.api.openai.reasoning import ReasoningStream, split
from service.api.openai.tools import CallStream, read_calls
from service.api.openai.unknown_fields import decode
from service.engine.values import EngineDeadError, FinishReason, RequestError

_json = msgspec.json.Encoder()


class ResponseText(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    format: dict[str, Any] | None = None  # {"type": "text" | "json_object" | "json_schema"}
    verbosity: str | None = None  # ignored


class ResponsesRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The fields of OpenAI's `responses.create`; each honoured, ignored (hints that change
    nothing an answer holds) or refused with a 400 naming it (docs/protocol.md lists each)."""

    model: str | None = None
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    stream: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: ResponseText | None = None
    metadata: dict[str, str] | None = None
    # Ignored: they change nothing an answer holds.
    user: str | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    truncation: str | None = None  # "disabled" (the default) or "auto": both refuse overflow
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    stream_options: dict[str, Any] | None = None
    top_logprobs: int | None = None
    # vLLM's and this server's sampling extensions, passed to the chat request as they are.
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool | None = None
    cache_salt: str | None = None
    # Refused whenever given (not null / false).
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: int | None = None


class StoredResponse(msgspec.Struct, kw_only=True):
    """What `store` keeps of a response: the conversation it ends, as chat messages (for
    `previous_response_id`), and the Response object itself (for GET)."""

    messages: list[dict[str, Any]]
    response: dict[str, Any]


def decode_responses_request(body: bytes, ignore_unknown: bool = False) -> ResponsesRequest:
    """The request, or OpenAIError naming what is wrong; `ignore_unknown`: a top-level field
    no request has is dropped, not refused (--unknown-request-fields ignore)."""
    try:
        req = decode(body, ResponsesRequest, "responses request", ignore_unknown)
    except msgspec.ValidationError as exc:
        raise invalid(f"not a valid responses request: {exc}", _path_of(exc)) from None
    except msgspec.DecodeError as exc:
        raise invalid(f"not a valid responses request: {exc}", None, "bad_request") from None
    for name in ("background", "conversation", "prompt", "max_tool_calls"):
        if getattr(req, name) not in (None, False):
            raise unsupported(name)
    if req.truncation not in (None, "disabled", "auto"):
        raise invalid("truncation must be disabled or auto", "truncation")
    if req.input is None and req.previous_response_id is None:
        raise invalid("input is required", "input")
    return req


def input_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's `input` as chat messages: text and message items as messages, each
    run of function_call items as one assistant message with its tool_calls, each
    function_call_output as a tool message; reasoning items dropped (nothing was thought)."""
    if req.input is None:
        return []
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(req.input):
        param = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise invalid(f"{param}.role {role!r} is not user, system, developer or "
                              "assistant", f"{param}.role")  # fmt: skip
            messages.append({"role": role, "content": _item_text(item.get("content"), param)})
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", param),
                "type": "function",
                "function": {
                    "name": _string(item, "name", param),
                    "arguments": _string(item, "arguments", param),
                },
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                output = _item_text(output, f"{param}.output")
            messages.append(
                {"role": "tool", "tool_call_id": _string(item, "call_id", param), "content": output}
            )
        elif kind == "reasoning":
            continue
        else:
            raise unsupported(f"{param}.type", f"{kind!r} items are not supported")
    return messages


def chat_body(
    req: ResponsesRequest, history: list[dict[str, Any]], messages: list[dict[str, Any]]
) -> bytes:
    """The chat completion request this Responses request asks for, as JSON (the chat path
    decodes and checks it as any other)."""
    if req.instructions:
        messages = [{"role": "system", "content": req.instructions}, *messages]
    body: dict[str, Any] = {"messages": [*history, *messages]}
    if req.tools:
        body["tools"] = [_chat_tool(tool, i) for i, tool in enumerate(req.tools)]
    if req.tool_choice is not None:
        body["tool_choice"] = _chat_tool_choice(req.tool_choice)
    if req.text is not None and req.text.format is not None:
        body["response_format"] = _response_format(req.text.format)
    fields = {
        "model": req.model,
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "parallel_tool_calls": req.parallel_tool_calls,
        "seed": req.seed,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "ignore_eos": req.ignore_eos,
        "cache_salt": req.cache_salt,
    }
    body |= {name: value for name, value in fields.items() if value is not None}
    return _json.encode(body)


# A chat field's name -> the Responses field it came from, for the errors the chat path raises.
_PARAMS = {
    "messages": "input",
    "response_format": "text.format",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
}


def as_responses_error(exc: OpenAIError) -> OpenAIError:
    """An error of the chat path, its param and message naming the Responses field."""
    param = exc.param
    if param is None:
        return exc
    for chat, ours in _PARAMS.items():
        if param == chat or param.startswith((f"{chat}[", f"{chat}.")):
            renamed = ours + param[len(chat) :]
            message = exc.message.replace(param, renamed, 1)
            return OpenAIError(exc.status, message, exc.code, renamed, exc.kind, exc.headers)
    return exc


class ResponseAnswer(Answer):
    """One Responses answer: the chat answer's generation and accounting, written as a
    Response object (`whole`) or as its `response.*` events (`events`)."""

    def __init__(
        self,
        *args: Any,
        responses_req: ResponsesRequest,
        messages: list[dict[str, Any]],
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.id = f"resp_{uuid.uuid4().hex}"
        self.responses_req = responses_req
        self.messages = messages  # the conversation this response continues, as chat messages
        self._sequence = 0
        self.final: dict[str, Any] | None = None  # the completed Response, once there is one

    # ------------------------------------------------------------------ the Response object

    def response(
        self, status: str, output: list[dict[str, Any]], reason: str | None = None
    ) -> dict[str, Any]:
        req = self.responses_req
        text_format = (req.text.format if req.text else None) or {"type": "text"}
        incomplete = {"reason": "max_output_tokens"} if reason == "length" else None
        body: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": req.store is not False,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": {"format": text_format},
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": req.tools or [],
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "truncation": req.truncation or "disabled",
            "usage": None,
            "user": req.user,
            "metadata": req.metadata or {},
        }
        if status != "in_progress":
            usage = self.usage()
            body["usage"] = {
                "input_tokens": usage["prompt_tokens"],
                "input_tokens_details": {
                    "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]
                },
                "output_tokens": usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage["total_tokens"],
            }
        return body

    def conversation(self, output: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The messages this response ends: those it continued, then its output (what a
        response chained to it continues)."""
        text = "".join(
            part["text"] for item in output if item["type"] == "message" for part in item["content"]
        )
        calls = [
            {"id": item["call_id"], "type": "function",
             "function": {"name": item["name"], "arguments": item["arguments"]}}
            for item in output
            if item["type"] == "function_call"
        ]  # fmt: skip
        reply: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            reply["tool_calls"] = calls
        return [*self.messages, reply]

    # ------------------------------------------------------------------ whole

    async def whole_response(self) -> dict[str, Any] | OpenAIError:
        """The finished Response object, or the error that ended it."""
        text, reason = "", "stop"
        try:
            async with contextlib.aclosing(self._outputs()) as outputs:  # type: ignore[type-var]
                async for out in outputs:
                    self._count(out)
                    text += out.new_text
                    if out.finish_reason is FinishReason.ERROR:
                        return as_responses_error(self._broken(out))
                    if out.finished:
                        reason = _finish(out.finish_reason)
        except (RequestError, EngineDeadError) as exc:
            return as_responses_error(_failure(exc, True))
        output = []
        if self.thinking is not None:
            parts = split(text, self.thinking)
            text = parts.content
            if parts.reasoning is not None:
                output.append(_reasoning_item(f"rs_{uuid.uuid4().hex}", parts.reasoning))
        calls: list[dict[str, Any]] = []
        if self.tools is not None:
            found = read_calls(text, self.tools)
            text, calls = found.content or "", found.calls
        if text or not calls:
            output.append(_message_item(f"msg_{uuid.uuid4().hex}", text, "completed"))
        output += [_call_item(call, "completed") for call in calls]
        status = "incomplete" if reason == "length" else "completed"
        self.final = self.response(status, output, reason)
        return self.final

    # ------------------------------------------------------------------ streamed

    async def response_events(
        self, before_final: Callable[[], Awaitable[None]] | None = None
    ) -> AsyncIterator[bytes]:
        """The semantic events OpenAI streams: response.created and .in_progress; per output
        item .output_item.added, its content part or call arguments, their deltas and
        .done events, .output_item.done; then response.completed (or .incomplete) with the
        whole Response (`before_final` awaited first: the store, so that a client chaining at
        once finds it). An error after the stream began is an `error` event, then
        response.failed."""
        started = self.response("in_progress", [])
        yield self._event("response.created", {"response": started})
        yield self._event("response.in_progress", {"response": started})
        output: list[dict[str, Any]] = []
        message_id = f"msg_{uuid.uuid4().hex}"
        text: str | None = None  # the message's text once its item is open
        reason = "stop"
        stream = CallStream(self.tools) if self.tools is not None else None
        thinking = ReasoningStream(self.thinking) if self.thinking is not None else None
        reasoning = _Reasoning()
        try:
            async with contextlib.aclosing(self._outputs()) as outputs:  # type: ignore[type-var]
                async for out in outputs:
                    self._count(out)
                    if out.finish_reason is FinishReason.ERROR:
                        error = as_responses_error(self._broken(out))
                        yield self._error_events(error, output)
                        return
                    new = out.new_text
                    if thinking is not None:
                        thought, new = thinking.feed(new, out.finished)
                        for event in self._reasoning_events(reasoning, thought, output):
                            yield event
                        if new or out.finished:
                            for event in self._close_reasoning(reasoning, output):
                                yield event
                    new = stream.push(new) if stream else new
                    if out.finished:
                        reason = _finish(out.finish_reason)
                    if new:
                        if text is None:
                            text = ""
                            yield self._open_message(message_id, len(output))
                        text += new
                        yield self._event("response.output_text.delta", {
                            "item_id": message_id, "output_index": len(output),
                            "content_index": 0, "delta": new, "logprobs": [],
                        })  # fmt: skip
        except (RequestError, EngineDeadError) as exc:
            yield self._error_events(as_responses_error(_failure(exc, True)), output)
            return
        calls: list[dict[str, Any]] = []
        if stream is not None:
            rest, calls = stream.finish()
            if rest:
                if text is None:
                    text = ""
                    yield self._open_message(message_id, len(output))
                text += rest
                yield self._event("response.output_text.delta", {
                    "item_id": message_id, "output_index": len(output), "content_index": 0,
                    "delta": rest, "logprobs": [],
                })  # fmt: skip
        if text is None and not calls:  # an empty answer is still one message
            text = ""
            yield self._open_message(message_id, len(output))
        if text is not None:
            for event in self._close_message(message_id, text, output):
                yield event
        for call in calls:
            for event in self._call_events(call, output):
                yield event
        status = "incomplete" if reason == "length" else "completed"
        self.final = self.response(status, output, reason)
        if before_final is not None:
            await before_final()
        yield self._event(f"response.{status}", {"response": self.final})

    def _reasoning_events(
        self, reasoning: _Reasoning, thought: str, output: list[dict[str, Any]]
    ) -> list[bytes]:
        """A thinking model's reasoning as a reasoning item, its text streamed."""
        if not thought or reasoning.closed:
            return []
        events = []
        if reasoning.text is None:
            reasoning.text = ""
            item = {**_reasoning_item(reasoning.id, ""), "content": []}
            events.append(
                self._event(
                    "response.output_item.added", {"output_index": len(output), "item": item}
                )
            )
        reasoning.text += thought
        events.append(self._event("response.reasoning_text.delta", {
            "item_id": reasoning.id, "output_index": len(output), "content_index": 0,
            "delta": thought,
        }))  # fmt: skip
        return events

    def _close_reasoning(self, reasoning: _Reasoning, output: list[dict[str, Any]]) -> list[bytes]:
        if reasoning.text is None or reasoning.closed:
            return []
        reasoning.closed = True
        index = len(output)
        item = _reasoning_item(reasoning.id, reasoning.text.strip())
        output.append(item)
        where = {"item_id": reasoning.id, "output_index": index, "content_index": 0}
        return [
            self._event(
                "response.reasoning_text.done", {**where, "text": item["content"][0]["text"]}
            ),
            self._event("response.output_item.done", {"output_index": index, "item": item}),
        ]

    def _open_message(self, item_id: str, index: int) -> bytes:
        item = {"type": "message", "id": item_id, "status": "in_progress", "role": "assistant",
                "content": []}  # fmt: skip
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return self._event(
            "response.output_item.added", {"output_index": index, "item": item}
        ) + self._event("response.content_part.added", {
            "item_id": item_id, "output_index": index, "content_index": 0, "part": part,
        })  # fmt: skip

    def _close_message(self, item_id: str, text: str, output: list[dict[str, Any]]) -> list[bytes]:
        index = len(output)
        item = _message_item(item_id, text, "completed")
        output.append(item)
        where = {"item_id": item_id, "output_index": index, "content_index": 0}
        return [
            self._event("response.output_text.done", {**where, "text": text, "logprobs": []}),
            self._event("response.content_part.done", {**where, "part": item["content"][0]}),
            self._event("response.output_item.done", {"output_index": index, "item": item}),
        ]

    def _call_events(self, call: dict[str, Any], output: list[dict[str, Any]]) -> list[bytes]:
        """A call read whole at the answer's end: its item, its arguments in one delta."""
        index = len(output)
        item = _call_item(call, "completed")
        output.append(item)
        added = {**item, "arguments": "", "status": "in_progress"}
        where = {"item_id": item["id"], "output_index": index}
        arguments = item["arguments"]
        return [
            self._event("response.output_item.added", {"output_index": index, "item": added}),
            self._event("response.function_call_arguments.delta", {**where, "delta": arguments}),
            self._event(
                "response.function_call_arguments.done",
                {**where, "name": item["name"], "arguments": arguments},
            ),
            self._event("response.output_item.done", {"output_index": index, "item": item}),
        ]

    def _error_events(self, error: OpenAIError, output: list[dict[str, Any]]) -> bytes:
        failed = self.response("failed", output)
        failed["error"] = {"code": error.code, "message": error.message}
        return self._event(
            "error", {"code": error.code, "message": error.message, "param": error.param}
        ) + self._event("response.failed", {"response": failed})

    def _event(self, kind: str, data: dict[str, Any]) -> bytes:
        payload = {"type": kind, **data, "sequence_number": self._sequence}
        self._sequence += 1
        return f"event: {kind}\ndata: ".encode() + _json.encode(payload) + b"\n\n"


@dataclass(slots=True)
class _Reasoning:
    """A streamed answer's reasoning item: open once its first text came, closed before the
    answer's other items."""

    id: str = field(default_factory=lambda: f"rs_{uuid.uuid4().hex}")
    text: str | None = None  # None: not opened
    closed: bool = False


def _reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": "completed",
            "content": [{"type": "reasoning_text", "text": text}]}  # fmt: skip


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [part]}  # fmt: skip


def _call_item(call: dict[str, Any], status: str) -> dict[str, Any]:
    """A chat tool call (`read_calls`' entry) as a function_call output item."""
    call_id = call.get("id") or f"call_{uuid.uuid4().hex}"
    return {
        "type": "function_call",
        "id": f"fc_{call_id.removeprefix('call_')}",
        "call_id": call_id,
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"],
        "status": status,
    }


def _chat_tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    param = f"tools[{i}]"
    if tool.get("type") != "function":
        raise unsupported(f"{param}.type", f"{tool.get('type')!r} tools are not supported "
                          "(only function)")  # fmt: skip
    unknown = set(tool) - {"type", "name", "description", "parameters", "strict"}
    if unknown:
        raise invalid(f"{param}: unknown fields {sorted(unknown)}", param)
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    if "name" not in function:
        raise invalid(f"{param}.name is required", f"{param}.name")
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    raise unsupported("tool_choice", f"{json.dumps(choice)} is not supported (auto, none, "
                      "required or a function by name)")  # fmt: skip


def _response_format(fmt: dict[str, Any]) -> dict[str, Any]:
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "description", "schema", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise invalid(f"text.format.type {kind!r} is not text, json_object or json_schema",
                  "text.format.type")  # fmt: skip


def _item_text(content: Any, param: str) -> str:
    """A message item's content (text, or a list of input_text / output_text parts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{param}.content must be text or a list of parts", f"{param}.content")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            texts.append(str(part.get("text", "")))
        elif kind != "refusal":
            raise unsupported(f"{param}.content[{j}]", f"{kind!r} content is not supported "
                              "(only text)")  # fmt: skip
    return "".join(texts)


def _string(item: dict[str, Any], key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise invalid(f"{param}.{key} must be a string", f"{param}.{key}")
    return value


def _path_of(exc: msgspec.ValidationError) -> str | None:
    """`$.tools[0]` in msgspec's message -> "tools[0]"."""
    message = str(exc)
    at = message.rfind("`$.")
    return message[at + 3 : message.index("`", at + 3)] if at >= 0 else None


def stored(answer: ResponseAnswer) -> bytes | None:
    """The record `store` keeps of a finished answer (None: nothing to keep)."""
    if answer.final is None or answer.responses_req.store is False:
        return None
    record = StoredResponse(
        messages=answer.conversation(answer.final["output"]), response=answer.final
    )
    return msgspec.msgpack.encode(record)


def read_stored(raw: bytes) -> StoredResponse:
    return msgspec.msgpack.decode(raw, type=StoredResponse)
