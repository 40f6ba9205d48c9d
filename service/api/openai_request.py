"""The OpenAI chat completion request: its fields, and how one becomes a prompt and sampling
parameters, or an `OpenAIError` in OpenAI's shape (`{"error": {"message", "type", "param",
"code"}}`) saying what is wrong with it."""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.responses import Response

from service.api.config import Limits
from service.engine.params import SamplingParams
from service.engine.tokenizer import Tokenizer

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}

_json = msgspec.json.Encoder()


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
    # vLLM's: a secret string salting this request's prefix-cache blocks, so that only
    # requests with the same salt (and tenant) share them. Non-empty when given.
    cache_salt: str | None = None
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


def invalid(message: str, param: str | None = None, code: str = "invalid_value") -> OpenAIError:
    return OpenAIError(400, message, code, param)


def decode_request(body: bytes, model_id: str) -> ChatCompletionRequest:
    """The request, or OpenAIError for a body that is not one this server can serve."""
    try:
        req = msgspec.json.decode(body, type=ChatCompletionRequest)
    except msgspec.DecodeError as exc:
        raise invalid(f"not a valid chat completion request: {exc}", code="bad_request") from None
    if req.model is not None and req.model != model_id:
        raise OpenAIError(
            404,
            f"the model {req.model!r} does not exist here; this server serves "
            f"{model_id!r} (GET /v1/models)",
            "model_not_found",
            "model",
        )
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name) != 0.0:
            raise invalid(f"{name} is not supported (only 0)", name, "unsupported_value")
    if req.logprobs:
        raise invalid("logprobs are not supported here", "logprobs", "unsupported_value")
    if req.cache_salt is not None and not req.cache_salt:
        raise invalid("cache_salt must be a non-empty string", "cache_salt")
    return req


def render_prompt(
    req: ChatCompletionRequest, tokenizer: Tokenizer, limits: Limits, max_model_len: int
) -> list[int]:
    """The conversation through the model's chat template, contents as plain text."""
    if not req.messages:
        raise invalid("messages must hold at least one message", "messages")
    rendered = []
    for i, message in enumerate(req.messages):
        param = f"messages[{i}]"
        role = ROLES.get(message.role)
        if role is None:
            raise invalid(f"{param}.role {message.role!r} is not one of {sorted(ROLES)}", param)
        content = _text(message.content, param)
        cap = limits.max_system_chars if role == "system" else limits.max_message_chars
        if len(content) > cap:
            raise invalid(f"{param}.content has {len(content)} characters; at most {cap}")
        rendered.append({"role": role, "content": content})
    if rendered[-1]["role"] != "user":
        raise invalid("the last message must be the user's", "messages")
    prompt = tokenizer.apply_chat_template(rendered)
    if len(prompt) >= max_model_len:
        raise invalid(
            f"the messages take {len(prompt)} tokens; the model's context holds {max_model_len} "
            "including the answer",
            "messages",
            "context_length_exceeded",
        )
    return prompt


def sampling_params(req: ChatCompletionRequest, limits: Limits) -> SamplingParams:
    """OpenAI's sampling fields as the engine's parameters, within the server's limits."""
    asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if asked is not None and asked < 1:  # 0 is no answer at all, never "the default"
        raise invalid("max_tokens must be >= 1 (omit it for the default)", "max_tokens")
    max_tokens = asked or limits.default_max_tokens
    if max_tokens > limits.max_tokens:
        raise invalid(f"max_tokens is {max_tokens}; the limit is {limits.max_tokens}", "max_tokens")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > 4:
        raise invalid("stop takes at most 4 strings", "stop")
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
        raise invalid(str(exc)) from None


def _text(content: str | list[TextPart] | None, param: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    for part in content:
        if part.type != "text":
            raise invalid(f"{param}: only text content parts are supported", param)
    return "".join(part.text for part in content)
