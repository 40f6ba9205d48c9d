"""The OpenAI chat completion request: its fields, and how one becomes a prompt and one
`AskedSampling` (its `sampling`), or an `OpenAIError` in OpenAI's shape (`{"error":
{"message", "type", "param", "code"}}`) saying what is wrong with it.

NOTE (schema): as vLLM's server does, every field of OpenAI's request is accepted, and an
explicit null means the field's default. A field is honoured, or ignored (metadata and hints
that change nothing an answer holds), or refused with a 400 naming it when it asks for what
this server cannot do (tools, audio). A field OpenAI does not have is
refused too, so a misspelt option never silently does nothing, unless the server is told to
ignore such fields (NOTE (unknown fields) in unknown_fields.py). docs/protocol.md lists each.
"""

from __future__ import annotations

from typing import Any

import jinja2
import msgspec

from service.api.limits import Limits
from service.api.openai.errors import context_exceeded, invalid, unsupported
from service.api.openai.params import SamplingFields, decode_fields, structured_output
from service.api.openai.tools import (
    ToolCall,
    Tools,
    call_grammar,
    call_text,
    response_text,
    system_text,
    tools_of,
)
from service.api.sampling import AskedSampling
from service.engine.values import TEMPLATE_RESERVED
from service.sessions.prompt import ChatFormat, TemplateError

ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",  # a function's result: rendered as a user turn (service/api/openai/tools.py)
}
MAX_TOP_LOGPROBS = 20

_json = msgspec.json.Encoder()


class ContentPart(msgspec.Struct, kw_only=True):
    """A part of a message's content; other kinds than text (images, audio, files) carry
    fields of their own, and are refused by their `type`."""

    type: str
    text: str | None = None
    refusal: str | None = None  # an assistant's {"type": "refusal"} part


class ChatMessageIn(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None  # ignored
    # What the SDK's own assistant message carries (`message.model_dump()`): a refusal's
    # text and annotations (ignored), and tool calls, a function call and audio (refused
    # unless empty).
    refusal: str | None = None
    annotations: list[Any] | None = None
    tool_calls: list[Any] | None = None
    function_call: Any = None
    audio: Any = None
    tool_call_id: str | None = None  # a tool message's: ignored (results are read in order)


class ChatCompletionRequest(SamplingFields, kw_only=True, forbid_unknown_fields=True):
    messages: list[ChatMessageIn]
    # Honoured.
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = None
    # vLLM's, honoured: with a final assistant message, continue it (the default here) or
    # answer it with a new turn (add_generation_prompt: true).
    continue_final_message: bool | None = None
    add_generation_prompt: bool | None = None
    # Honoured: the functions the answer may call (service/api/openai/tools.py).
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # Ignored: they change nothing an answer holds.
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: Any = None
    safety_identifier: str | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    # Honoured: variables the model's template reads (Qwen3's enable_thinking), but for the
    # ones the server sets itself (TEMPLATE_RESERVED).
    chat_template_kwargs: dict[str, Any] | None = None
    # Accepted at their neutral values only (null, empty, ["text"]).
    functions: list[Any] | None = None
    function_call: Any = None
    modalities: list[str] | None = None
    # Refused whenever given.
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    moderation: Any = None

    def sampling(self) -> AskedSampling:
        """This request's sampling fields as the one value the builder checks
        (`service.api.sampling.sampling_params`): max_completion_tokens wins over max_tokens,
        top_logprobs counts only with logprobs, and forced tool calls are the answer's
        grammar (their arguments held to the functions' schemas)."""
        named = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        asked = self.shared_sampling(
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens,
            (self.top_logprobs or 0) if self.logprobs else None,
            {"max_tokens": named, "logprobs": "top_logprobs", "prompt": "messages"},
        )
        tools = request_tools(self)
        if tools.constrained:
            return msgspec.structs.replace(asked, structured=call_grammar(tools))
        return asked


def decode_request(
    body: bytes, served: tuple[str, ...], ignore_unknown: bool = False
) -> ChatCompletionRequest:
    """The request, or OpenAIError for a body that is not one this server can serve.
    `served`: the model names this server answers to; `ignore_unknown`: drop the fields no
    request has (NOTE (unknown fields) in service/api/openai/unknown_fields.py)."""
    what = "chat completion request"
    req = decode_fields(body, ChatCompletionRequest, what, served, ignore_unknown)
    _refuse_what_cannot_be_honoured(req)
    if req.top_logprobs is not None:
        if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
            raise invalid(f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}", "top_logprobs")
        if req.top_logprobs and not req.logprobs:
            raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
    return req


def _refuse_what_cannot_be_honoured(req: ChatCompletionRequest) -> None:
    check_template_kwargs(req.chat_template_kwargs)
    if req.continue_final_message and req.add_generation_prompt:
        raise invalid(
            "continue_final_message and add_generation_prompt cannot both be true",
            "continue_final_message",
        )
    if req.functions:
        raise unsupported("functions", "is not supported: send tools (OpenAI's current name)")
    if req.function_call not in (None, "none", "auto"):
        raise unsupported("function_call", "is not supported: send tool_choice")
    tools = request_tools(req)  # their shapes, and the choice among them
    if tools.constrained and structured_output(req) is not None:
        raise invalid(
            f"tool_choice {req.tool_choice!r} constrains the answer to tool calls; it takes no "
            "response_format or structured output besides",
            "tool_choice",
        )
    if req.modalities is not None and set(req.modalities) - {"text"}:
        raise unsupported("modalities", "may only be ['text']")
    for name in ("audio", "prediction", "web_search_options", "moderation"):
        if getattr(req, name) is not None:
            raise unsupported(name)


def render_prompt(
    req: ChatCompletionRequest, chat: ChatFormat, limits: Limits, max_model_len: int | None = None
) -> list[int]:
    """The conversation through the model's chat template, contents as plain text.

    A conversation that ends with an assistant message is continued: no new turn is opened,
    and the message's text is the start of the answer (only what follows it is returned);
    unless `add_generation_prompt: true` asks for a new turn after it (vLLM's fields)."""
    if not req.messages:
        raise invalid("messages must hold at least one message", "messages")
    rendered = []
    for i, message in enumerate(req.messages):
        param = f"messages[{i}]"
        role = ROLES.get(message.role)
        if role is None:
            raise invalid(
                f"{param}.role {message.role!r} is not one of {sorted(ROLES)}", f"{param}.role"
            )
        if message.function_call is not None:
            raise unsupported(f"{param}.function_call", "is not supported: send tool_calls")
        if message.audio is not None:
            raise unsupported(f"{param}.audio")
        if message.tool_calls and role != "assistant":
            raise invalid(f"{param}.tool_calls: only an assistant message has them", param)
        content = _text(message.content, param)
        cap = limits.max_system_chars if role == "system" else limits.max_message_chars
        if len(content) > cap:
            # Over the context by itself, it is refused as a prompt over the context is
            # (OpenAI's code for it); else as a message over the server's cap.
            tokens = len(chat.tokenizer.encode(content)) if max_model_len else 0
            if max_model_len and tokens >= max_model_len:
                raise context_exceeded(tokens, max_model_len)
            raise invalid(f"{param}.content has {len(content)} characters; at most {cap}", param)
        if message.tool_calls:
            calls = [
                _tool_call(raw, f"{param}.tool_calls[{j}]")
                for j, raw in enumerate(message.tool_calls)
            ]
            content = "\n".join(
                [content, *map(call_text, calls)] if content else map(call_text, calls)
            )
        if role == "tool":
            role, content = "user", response_text(content)
        rendered.append({"role": role, "content": content})
    tools = request_tools(req)
    if tools.active:
        rendered = _with_tools(rendered, tools)
    last = rendered[-1]["role"]
    if req.continue_final_message and last != "assistant":
        raise invalid(
            "continue_final_message needs the last message to be the assistant's",
            "continue_final_message",
        )
    kwargs = req.chat_template_kwargs
    try:
        if last == "assistant" and not req.add_generation_prompt:
            try:
                prompt = chat.continuation(rendered, kwargs)
            except TemplateError as exc:
                raise invalid(str(exc), "messages") from None
        else:
            add_generation_prompt = req.add_generation_prompt is not False
            prompt = chat.conversation(
                rendered, add_generation_prompt=add_generation_prompt, template_kwargs=kwargs
            )
    except jinja2.TemplateError as exc:  # the template failed on the request's variables
        raise invalid(f"the chat template failed: {exc}", "chat_template_kwargs") from None
    return prompt


MAX_TEMPLATE_KWARGS = 16


def check_template_kwargs(kwargs: dict[str, Any] | None) -> None:
    """A request's template variables: names, not the server's own, a few of them."""
    if not kwargs:
        return
    if len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise invalid(
            f"chat_template_kwargs takes at most {MAX_TEMPLATE_KWARGS} variables",
            "chat_template_kwargs",
        )
    for name in kwargs:
        if not name.isidentifier():
            raise invalid(f"chat_template_kwargs: {name!r} is not a variable name",
                          "chat_template_kwargs")  # fmt: skip
    if reserved := TEMPLATE_RESERVED.intersection(kwargs):
        raise invalid(
            f"chat_template_kwargs cannot set the server's own template variables: "
            f"{sorted(reserved)}",
            "chat_template_kwargs",
        )


def request_tools(req: ChatCompletionRequest) -> Tools:
    return tools_of(req.tools, req.tool_choice, req.parallel_tool_calls)


def _tool_call(raw: Any, param: str) -> ToolCall:
    try:
        return msgspec.convert(raw, ToolCall)
    except msgspec.ValidationError as exc:
        raise invalid(f"{param}: {exc}", param) from None


def _with_tools(rendered: list[dict[str, str]], tools: Tools) -> list[dict[str, str]]:
    """The tools' signatures and call format at the end of the system message (a system
    message of their own where there is none)."""
    text = system_text(tools)
    if rendered and rendered[0]["role"] == "system":
        first = rendered[0]
        return [{**first, "content": f"{first['content']}\n\n{text}"}, *rendered[1:]]
    return [{"role": "system", "content": text}, *rendered]


def _text(content: str | list[ContentPart] | None, param: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type == "text":
            texts.append(part.text or "")
        elif part.type != "refusal":  # a refusal part says nothing the model should read
            raise invalid(
                f"{param}.content[{j}]: only text content parts are supported, not {part.type!r}",
                f"{param}.content",
            )
    return "".join(texts)
