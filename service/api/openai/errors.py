"""OpenAI's error shape, `{"error": {"message", "type", "param", "code"}}`, and the errors
the OpenAI endpoints answer with."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import msgspec
from starlette.responses import Response

from service.api.refusal import Refusal, RefusalReason

_json = msgspec.json.Encoder()


class OpenAIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        code: str,
        param: str | None = None,
        kind: str = "",
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = dict(headers or {})  # e.g. Retry-After, sent with the response

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self, headers: Mapping[str, str] | None = None) -> Response:
        return Response(
            _json.encode(self.body()),
            self.status,
            {**self.headers, **(headers or {})},
            media_type="application/json",
        )


# What each refusal of the service is over HTTP: (status, OpenAI's error code).
_REFUSAL_STATUS = {
    RefusalReason.SHUTTING_DOWN: (503, "shutting_down"),
    RefusalReason.TOO_MANY_CONNECTIONS: (503, "too_many_connections"),
    RefusalReason.BUSY: (503, "busy"),
    RefusalReason.OVERLOADED: (429, "overloaded"),
    RefusalReason.UNAUTHORIZED: (401, "invalid_api_key"),
    RefusalReason.TOO_MANY_ATTEMPTS: (429, "too_many_attempts"),
}


def refusal_error(refusal: Refusal) -> OpenAIError:
    """A refusal of the service (or the gate) as an HTTP error, with the headers that tell a
    client what to do: when to retry, and that a bearer key is wanted."""
    status, code = _REFUSAL_STATUS[refusal.reason]
    headers = {}
    if refusal.reason is RefusalReason.UNAUTHORIZED:
        headers["WWW-Authenticate"] = "Bearer"
    if refusal.retry_after_s is not None:
        headers["Retry-After"] = str(math.ceil(refusal.retry_after_s))
    elif refusal.reason is RefusalReason.OVERLOADED:
        headers["Retry-After"] = "1"  # an overloaded server is usually free within a second
    # OpenAI's type for a limit on requests (its rate limits say "requests" or "tokens").
    kind = "requests" if status == 429 else ""
    return OpenAIError(status, refusal.message, code, kind=kind, headers=headers)


def invalid(message: str, param: str | None = None, code: str = "invalid_value") -> OpenAIError:
    return OpenAIError(400, message, code, param)


def unsupported(param: str, what: str = "is not supported by this server") -> OpenAIError:
    return OpenAIError(400, f"{param} {what}", "unsupported_parameter", param)


def model_not_found(name: str, served: tuple[str, ...]) -> OpenAIError:
    return OpenAIError(
        404,
        f"the model {name!r} does not exist here; this server serves {served[0]!r} "
        "(GET /v1/models)",
        "model_not_found",
        "model",
    )


_AT = re.compile(r"(?:Object contains unknown field `([^`]*)`|.*?)(?: - at `\$\.?([^`]*)`)?$")


def decode_error(exc: msgspec.DecodeError, what: str) -> OpenAIError:
    """A body that is not JSON, or not of the request's shape, with the field it names."""
    param = None
    if match := _AT.match(str(exc)):
        unknown, path = match.groups()
        param = ".".join(p for p in (path, unknown) if p) or None
    return invalid(f"not a valid {what}: {exc}", param, "bad_request")


def context_exceeded(
    prompt_tokens: int,
    max_model_len: int,
    max_tokens: int = 0,
    *,
    prompt_param: str = "messages",  # the request's prompt field: `prompt` on /v1/completions
    max_tokens_param: str = "max_tokens",  # as the request named it
) -> OpenAIError:
    """vLLM's refusal of a request that cannot fit the model's context."""
    asked = f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the {prompt_param}"
    asked += f", {max_tokens} in the completion)" if max_tokens else ")"
    return invalid(
        f"This model's maximum context length is {max_model_len} tokens. However, you "
        f"requested {asked}. Please reduce the length of the {prompt_param} or completion.",
        max_tokens_param if max_tokens else prompt_param,
        "context_length_exceeded",
    )
