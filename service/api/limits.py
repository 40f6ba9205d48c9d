"""Limits: what one client may ask for, and what the server takes on at once; each transport
checks a request against them and answers with its own error (docs/protocol.md, OpenAI's
error shape)."""

from __future__ import annotations

from dataclasses import dataclass

from service.engine.params import DEFAULT_MAX_TOKENS
from service.settings import setting


@dataclass(slots=True)
class Limits:
    """What one client may ask for, and what the server takes on at once.

    Every limit is enforced with an error (docs/protocol.md), never a crash.
    """

    max_connections: int = setting(
        512,
        "open WebSockets; the next one gets `too_many_connections`. Also the size of the Redis"
        " connection pool, which waits up to 10 s for a free connection rather than failing",
    )
    max_inflight_turns: int = setting(
        256, "answers queued or running, WebSocket and HTTP; the next one gets `overloaded`"
    )
    max_frame_bytes: int = setting(
        64 * 1024, "largest frame a client may send; a larger one gets `frame_too_large`"
    )
    ws_max_size: int = setting(
        1024 * 1024,
        "the WebSocket transport's own cap (>= `max_frame_bytes`): a larger frame closes the"
        " connection (1009) before the server reads it",
    )
    max_body_bytes: int = setting(
        1024 * 1024, "largest HTTP request body; a larger one gets 413 `request_too_large`"
    )
    max_message_chars: int = setting(16_000, "characters in a user message or a prompt")
    max_system_chars: int = setting(8_000, "characters in a system prompt")
    default_max_tokens: int = setting(
        DEFAULT_MAX_TOKENS,
        "an answer's max_tokens when it gives none (/v1/chat, /v1/chat/completions), or what"
        " the context has left after the prompt if less",
    )
    default_completion_tokens: int = setting(
        16,
        "a /v1/completions answer's max_tokens when it gives none (OpenAI's default for that"
        " endpoint), or what the context has left after the prompt if less",
    )
    max_tokens: int = setting(2048, "the most max_tokens an answer may ask for")
    session_ttl_s: int = setting(
        7 * 24 * 3600,
        "seconds a session's Redis keys live after its latest activity (open, resume, a turn)",
    )
    drain_timeout_s: float = setting(
        10.0,
        "seconds answers in flight get at shutdown; the rest are cancelled, stored and"
        " reported `shutdown`",
    )
    send_queue_frames: int = setting(
        1024, "frames queued for one client before it counts as stalled"
    )
    send_timeout_s: float = setting(
        15.0,
        "seconds a client may leave the server unable to hand it a frame (the socket's buffers"
        " full and the writer stalled, or the queue full) before it is dropped, its answer"
        " stored as far as it got; the buffers fill first, so a client that stops reading is"
        " dropped later than this after its last read",
    )

    header_timeout_s: float = setting(
        10.0,
        "seconds a request's headers (a WebSocket handshake's included) may take from its first"
        " byte, or a new connection's; past it a 408 and the connection closed. At most"
        " `max_connections` connections may be waiting for their headers at once; a new one"
        " past that closes the one waiting longest (service/server/http_guard.py)",
    )
    max_pending_per_address: int = setting(
        64,
        "connections one client address may have waiting for their headers at once (as"
        " `header_timeout_s` counts them) once half the process's file descriptors below"
        " `fd_reserve` are in use; one more is reset as it is accepted, before any"
        " other work, unless its request's headers have all arrived. Peers in"
        " `trusted_proxies` are exempt, and `uds` has no such cap (service/server/listener.py)",
    )
    fd_reserve: int = setting(
        128,
        "file descriptors kept back below the process's open-file limit: a connection"
        " accepted into them pushes out the one waiting longest for its headers, or is reset"
        " if none is, so a client that sends its request at once still gets in and the"
        " server's own Redis connections and files still get a descriptor (not on `uds`)",
    )
    body_timeout_s: float = setting(
        10.0,
        "seconds an HTTP request's body may take to arrive in full, once its headers have; past"
        " it the request gets a 408 and its connection is closed",
    )

    def __post_init__(self) -> None:
        for name in (
            "max_connections",
            "max_inflight_turns",
            "max_frame_bytes",
            "max_body_bytes",
            "max_message_chars",
            "max_system_chars",
            "default_max_tokens",
            "default_completion_tokens",
            "max_tokens",
            "session_ttl_s",
            "send_queue_frames",
            "max_pending_per_address",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.ws_max_size < self.max_frame_bytes:
            raise ValueError("ws_max_size must be >= max_frame_bytes")
        if self.default_max_tokens > self.max_tokens:
            raise ValueError("default_max_tokens must be <= max_tokens")
        if self.default_completion_tokens > self.max_tokens:
            raise ValueError("default_completion_tokens must be <= max_tokens")
        if self.fd_reserve < 0:
            raise ValueError("fd_reserve must be >= 0")
        if self.drain_timeout_s < 0:
            raise ValueError("drain_timeout_s must be >= 0")
        if self.body_timeout_s <= 0 or self.header_timeout_s <= 0:
            raise ValueError("body_timeout_s and header_timeout_s must be > 0")
        if not self.send_timeout_s > 0:
            raise ValueError("send_timeout_s must be > 0")
