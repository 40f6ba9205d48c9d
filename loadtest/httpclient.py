"""A blocking client of the OpenAI-compatible /v1/chat/completions, streamed as server-sent
events, for Locust users (gevent makes its socket cooperative)."""

from __future__ import annotations

import http.client
import json
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from loadtest.wsclient import TurnResult


class CompletionError(Exception):
    """The server refused the request or ended its stream with an error."""


@dataclass(slots=True)
class Completion:
    """One streamed answer: its timing (as a WebSocket turn's) and its last chunk's usage."""

    turn: TurnResult
    finish_reason: str | None = None
    usage: dict[str, Any] = field(default_factory=dict)


def completions_target(base: str) -> tuple[str, int, bool]:
    """(host, port, tls) of a Locust host given as ws(s):// or http(s)://."""
    parts = urlsplit(base)
    tls = parts.scheme in ("https", "wss")
    return parts.hostname or "127.0.0.1", parts.port or (443 if tls else 80), tls


def stream_completion(
    base: str, messages: list[dict[str, str]], params: dict[str, Any], timeout_s: float
) -> Completion:
    """POST one streamed chat completion and read it to `data: [DONE]`."""
    host, port, tls = completions_target(base)
    conn_type = http.client.HTTPSConnection if tls else http.client.HTTPConnection
    conn = conn_type(host, port, timeout=timeout_s)
    body = {
        "messages": messages,
        "stream": True,
        "stream_options": {"include_usage": True},
        **params,
    }
    result = Completion(TurnResult(sent_at=time.perf_counter()))
    try:
        conn.request(
            "POST",
            "/v1/chat/completions",
            json.dumps(body).encode(),
            {"content-type": "application/json"},
        )
        response = conn.getresponse()
        if response.status != 200:
            raise CompletionError(f"{response.status}: {response.read().decode(errors='replace')}")
        for line in response:
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                return result
            chunk = json.loads(data)
            if "error" in chunk:
                raise CompletionError(chunk["error"].get("message", "stream error"))
            if chunk.get("usage"):
                result.usage = chunk["usage"]
            for choice in chunk["choices"]:
                content = choice["delta"].get("content")
                if content:  # one chunk per engine step: one token, as a rule
                    result.turn.add_tokens(1, time.perf_counter())
                    result.turn.text += content
                if choice["finish_reason"] is not None:
                    result.finish_reason = choice["finish_reason"]
        raise CompletionError("the stream ended before data: [DONE]")
    finally:
        conn.close()
