"""Server settings: where to listen, which Redis, and every limit in one dataclass.

`pagechat serve` fills these from its options, each of which defaults to a PAGECHAT_*
environment variable (see `service.api.server`).
"""

from __future__ import annotations

import ipaddress
import socket
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

from service.engine.config import EngineConfig


@dataclass(slots=True)
class Limits:
    """What one client may ask for, and what the server takes on at once.

    Every limit is enforced with an error frame (docs/protocol.md), never a crash.
    """

    max_connections: int = 512  # open WebSockets; the next one gets too_many_connections
    max_inflight_turns: int = 256  # answers queued or running; the next gets overloaded
    max_frame_bytes: int = 64 * 1024  # larger frames get frame_too_large
    # The transport's own cap: larger frames close the connection (1009) before we see them.
    ws_max_size: int = 1024 * 1024
    max_message_chars: int = 16_000  # a user message's content
    max_system_chars: int = 8_000  # a session's system prompt
    default_max_tokens: int = 512
    max_tokens: int = 2048  # the most a user message may ask for
    session_ttl_s: int = 7 * 24 * 3600  # Redis keys expire this long after the last activity
    drain_timeout_s: float = 10.0  # on shutdown, answers get this long to finish
    # A client that lets this many frames queue up, or leaves one unread this long, is dropped
    # (its answer is stored as far as it got).
    send_queue_frames: int = 1024
    send_timeout_s: float = 15.0

    def __post_init__(self) -> None:
        for name in (
            "max_connections",
            "max_inflight_turns",
            "max_frame_bytes",
            "max_message_chars",
            "max_system_chars",
            "default_max_tokens",
            "max_tokens",
            "session_ttl_s",
            "send_queue_frames",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.ws_max_size < self.max_frame_bytes:
            raise ValueError("ws_max_size must be >= max_frame_bytes")
        if self.default_max_tokens > self.max_tokens:
            raise ValueError("default_max_tokens must be <= max_tokens")
        if self.drain_timeout_s < 0:
            raise ValueError("drain_timeout_s must be >= 0")
        if not self.send_timeout_s > 0:
            raise ValueError("send_timeout_s must be > 0")


@dataclass(slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (logged at start-up)
    uds: str | None = None  # a Unix socket to listen on instead (behind a local proxy)
    redis_url: str | None = None  # None: an embedded Redis persisting under data_dir
    redis_prefix: str = "pagechat:"
    data_dir: Path = Path("data")
    replica_id: str = field(default_factory=socket.gethostname)
    engine: EngineConfig = field(default_factory=EngineConfig)
    limits: Limits = field(default_factory=Limits)
    lag_interval_s: float = 0.05  # the event-loop lag probe's sleep
    access_log: bool = False
    # Who shares prefix-cache blocks within a tenant: "session" (default): across sessions
    # only the template's prefix and the system prompt; "global": everything, as before.
    prefix_cache_scope: str = "session"
    # Who may come in (service.api.auth). No keys file: no keys, one tenant, all open.
    api_keys_file: Path | None = None
    # Origins whose pages may open /v1/chat besides the server's own; "*": any page.
    allowed_origins: tuple[str, ...] = ()
    # Peers (addresses or networks) whose X-Forwarded-For names the client; none by default.
    trusted_proxies: tuple[str, ...] = ()
    # The model names the OpenAI endpoints answer to, the first listed; none: the model's id.
    served_model_names: tuple[str, ...] = ()
    # Origins whose pages may call the HTTP API (CORS); "*": any. None by default: no CORS.
    cors_allowed_origins: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError("port must be in 0..65535")
        if self.prefix_cache_scope not in ("session", "global"):
            raise ValueError("prefix_cache_scope must be session or global")
        if self.lag_interval_s <= 0:
            raise ValueError("lag_interval_s must be > 0")
        self.data_dir = Path(self.data_dir)
        if self.api_keys_file is not None:
            self.api_keys_file = Path(self.api_keys_file)
        self.allowed_origins = tuple(
            "*" if origin == "*" else normalize_origin(origin) for origin in self.allowed_origins
        )
        self.cors_allowed_origins = tuple(
            "*" if origin == "*" else normalize_origin(origin)
            for origin in self.cors_allowed_origins
        )
        for proxy in self.trusted_proxies:
            try:
                ipaddress.ip_network(proxy)
            except ValueError:
                raise ValueError(
                    f"trusted proxy {proxy!r} is neither an IP address nor a network"
                ) from None


def normalize_origin(origin: str) -> str:
    """`origin` as browsers send it in `Origin`: `scheme://host[:port]` in lower case, the
    scheme's default port left out. ValueError for anything else (a path, "null")."""
    try:
        parts = urllib.parse.urlsplit(origin.strip())
        port = parts.port
    except ValueError:
        parts, port = None, None
    if (
        parts is None
        or parts.scheme not in ("http", "https")
        or not parts.hostname
        or parts.username is not None
        or parts.path not in ("", "/")
        or parts.query
        or parts.fragment
    ):
        raise ValueError(f"not an origin (http[s]://host[:port]): {origin!r}")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    default = 80 if parts.scheme == "http" else 443
    return f"{parts.scheme}://{host}" + ("" if port in (None, default) else f":{port}")
