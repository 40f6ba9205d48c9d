"""Server settings: where to listen, which Redis, and every limit in one dataclass.

`pagechat serve` fills these from its options, each of which defaults to a PAGECHAT_*
environment variable; both are made from the fields here (`service.server.options`).
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass, field
from pathlib import Path

from service.api.access.gate import normalize_origin
from service.api.limits import Limits
from service.engine.config import EngineConfig
from service.settings import setting


@dataclass(slots=True)
class ServerConfig:
    """Each field but `engine` and `limits` (groups of their own) is an option of `pagechat
    serve` (service.server.options) and a row of docs/config.md, both written from its help."""

    host: str = setting("127.0.0.1", "interface to listen on")
    port: int = setting(8000, "port to listen on (0: any free port, logged at start-up)")
    uds: str | None = setting(
        None, "listen on this Unix socket instead of `host` and `port` (behind a local proxy)"
    )
    redis_url: str | None = setting(
        None,
        "the Redis to keep sessions in: redis://, rediss://, unix:// or redis+sentinel://"
        " (docs/deploy.md); none: an embedded Redis persisting under `data_dir`",
    )
    redis_prefix: str = setting("pagechat:", "prefix of every Redis key")
    data_dir: Path = setting(Path("data"), "where the embedded Redis persists")
    replica_id: str = setting(
        default_factory=socket.gethostname,
        doc="this replica's name as a session's owner (the replica that served its latest turn)",
        shown_default="the host's name",
    )
    engine: EngineConfig = field(default_factory=EngineConfig)
    limits: Limits = field(default_factory=Limits)
    lag_interval_s: float = setting(0.05, "seconds the event-loop lag probe sleeps each time")
    access_log: bool = setting(False, "log every HTTP request and WebSocket")
    log_level: str = setting("info", "debug | info | warning | error | critical")
    prefix_cache_scope: str = setting(
        "session",
        "who shares prefix-cache blocks within a tenant. session: across sessions, only the"
        " blocks wholly inside the template's prefix and the system prompt | global: every"
        " block ([protocol.md](protocol.md#who-shares-cached-blocks))",
    )
    api_keys_file: Path | None = setting(
        None,
        "API keys, one `KEY TENANT [admin]` a line, `#` comments; a key is 16+ characters or"
        " `sha256:` and its SHA-256 in hex. Read once at start-up; a file that cannot be used"
        " stops the start with its line named (exit status 2). None: no keys, every endpoint"
        " open, one tenant `default` ([protocol.md](protocol.md#access))",
    )
    allowed_origins: tuple[str, ...] = setting(
        (),
        "comma-separated `http[s]://host[:port]` whose pages may open /v1/chat besides the"
        " server's own origin reached by IP address or `localhost`; a server reached by a name"
        " lists its own origin here (DNS rebinding: docs/protocol.md); `*` for any. A"
        " handshake without `Origin` (not a browser) is always accepted",
    )
    trusted_proxies: tuple[str, ...] = setting(
        (),
        "comma-separated addresses or networks (`10.0.0.5`, `172.16.0.0/12`) of proxies whose"
        " `X-Forwarded-For` names the client, for the failed-attempt counts. None:"
        " `X-Forwarded-For` is ignored (uvicorn's own default, trusting 127.0.0.1, is not used)",
    )
    served_model_name: tuple[str, ...] = setting(
        (),
        "comma-separated names the OpenAI endpoints answer to (vLLM's option); /v1/models"
        " lists the first, which is also every metric's `model_name` label (protocol.md,"
        " Metrics), and a request naming any other model gets a 404 `model_not_found`",
        shown_default="the model's id",
    )
    unknown_request_fields: str = setting(
        "refuse",
        "refuse | ignore: a field that no OpenAI request of this server has (`temprature`)."
        " refuse: a 400 naming it, as OpenAI's API answers. ignore: dropped, as vLLM does, and"
        " named in a warning in the log (at most one a minute), for clients that send other"
        " servers' fields (docs/protocol.md)",
    )
    cors_allowed_origins: tuple[str, ...] = setting(
        (),
        "comma-separated `http[s]://host[:port]` whose pages may call the HTTP API (CORS,"
        " preflights answered, GET and POST); `*` for any. None: no CORS headers, so pages"
        " elsewhere cannot read the answers. /v1/chat is governed by `allowed_origins`",
    )

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError("port must be in 0..65535")
        if self.prefix_cache_scope not in ("session", "global"):
            raise ValueError("prefix_cache_scope must be session or global")
        if self.unknown_request_fields not in ("refuse", "ignore"):
            raise ValueError("unknown_request_fields must be refuse or ignore")
        if self.lag_interval_s <= 0:
            raise ValueError("lag_interval_s must be > 0")
        if self.log_level.lower() not in ("debug", "info", "warning", "error", "critical"):
            raise ValueError("log_level must be debug, info, warning, error or critical")
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
