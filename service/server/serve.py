"""`pagechat serve`: a uvicorn server that drains answers before it closes connections.

Shutdown order (SIGINT/SIGTERM): stop accepting; refuse new answers; give answers in flight
`--drain-timeout-s` seconds; cancel the rest (each is stored and reported with finish_reason
"shutdown"), close every socket with 1012; stop the engine (pools checked balanced); close
Redis (the embedded one saves to disk).
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import math
import signal
import socket
import sys
import time

import uvicorn
from uvicorn.config import STARTUP_FAILURE

from service.engine.loader import LoadedModel, check_model
from service.server.app import create_app
from service.server.config import ServerConfig
from service.server.connection_log import ConnectionLog
from service.server.http_guard import Waiting, guarded_h11
from service.server.hub import Hub
from service.server.listener import AcceptPolicy, OpenFiles, bind
from service.server.options import config_from_args

_uvicorn_log = logging.getLogger("uvicorn.error")
# The exit status when the engine thread died: distinct from 1 (an unclean stop) so that a
# supervisor's logs tell the two apart; either way it restarts the process.
EXIT_ENGINE_FAILED = 3


class PagechatServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, hub: Hub, accept_policy: AcceptPolicy) -> None:
        super().__init__(config)
        self.hub = hub
        self.accept_policy = accept_policy
        self.exit_code: int | None = None  # set when the server stops itself
        hub.on_fatal = self._engine_failed

    def _engine_failed(self) -> None:
        self.exit_code = EXIT_ENGINE_FAILED
        self.should_exit = True  # uvicorn's main loop notices within 0.1 s and shuts down

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's start-up on listening sockets of our own on `host`:`port`, whose accept()
        is the first gate (service/server/listener.py); a Unix socket is uvicorn's."""
        if sockets is not None or self.config.uds is not None:
            await super().startup(sockets)
            return
        try:
            listeners = bind(self.config.host, self.config.port, self.accept_policy)
        except OSError as exc:
            _uvicorn_log.error(exc)
            sys.exit(STARTUP_FAILURE)
        await super().startup(list(listeners))
        if self.started:  # uvicorn says it only for the sockets it binds: the same line
            port = listeners[0].getsockname()[1]
            host = f"[{self.config.host}]" if ":" in self.config.host else self.config.host
            _uvicorn_log.info("Uvicorn running on http://%s:%d (Press CTRL+C to quit)", host, port)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:
            server.close()  # stop accepting before the drain, not after it
        await self.hub.drain()
        await super().shutdown(sockets)
        self.accept_policy.closed_log.close()


def build_server(config: ServerConfig, loaded: LoadedModel | None = None) -> PagechatServer:
    hub = Hub(config, loaded)
    limits = config.limits
    # Connections waiting for their headers, shared by the listening socket and the protocol.
    waiting = Waiting()
    closed_log = ConnectionLog(logging.getLogger("service.server.http_guard"))
    accept_policy = AcceptPolicy(
        waiting,
        closed_log,
        OpenFiles(limits.fd_reserve),
        max_pending_per_address=limits.max_pending_per_address,
        trusted_proxies=tuple(ipaddress.ip_network(p) for p in config.trusted_proxies),
    )
    uv_config = uvicorn.Config(
        create_app(hub),
        host=config.host,
        port=config.port,
        uds=config.uds,
        ws="websockets-sansio",
        ws_max_size=config.limits.ws_max_size,
        lifespan="on",
        # Requests whose headers never finish: timed out and capped (uvicorn bounds neither).
        http=guarded_h11(limits.header_timeout_s, limits.max_connections, waiting, closed_log),
        access_log=config.access_log,
        # X-Forwarded-For names the client only from a --trusted-proxies peer (uvicorn would
        # trust 127.0.0.1 by default, letting any local process pick its address).
        proxy_headers=bool(config.trusted_proxies),
        forwarded_allow_ips=list(config.trusted_proxies),
        log_config=None,
        timeout_graceful_shutdown=int(config.limits.drain_timeout_s) + 10,
    )
    return PagechatServer(uv_config, hub, accept_policy)


class ClientFaultFilter(logging.Filter):
    """uvicorn logs a client's invalid UTF-8 text frame as an ERROR with a traceback, though it
    handles it right (closes with 1007): a client's fault is one INFO line, not a server error."""

    CLIENT_FAULTS = ("Invalid UTF-8 sequence received from client.",)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg in self.CLIENT_FAULTS:
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.exc_info = record.exc_text = None
        return True


class AcceptErrorFilter(logging.Filter):
    """asyncio logs every failed accept(), with a traceback, when the process is out of file
    descriptors, and retries a second later with the backlog still full: thousands of lines a
    minute that say one thing. One line (no traceback) per `every_s`, with how many it stands
    for."""

    PREFIX = "socket.accept() out of system resource"

    def __init__(self, every_s: float = 10.0) -> None:
        super().__init__()
        self.every_s = every_s
        self._last = -math.inf
        self._suppressed = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.getMessage().startswith(self.PREFIX):
            return True
        now = time.monotonic()
        if now - self._last < self.every_s:
            self._suppressed += 1
            return False
        error = record.exc_info[1] if record.exc_info else None
        record.msg = f"{self.PREFIX} ({error}); {self._suppressed} more like it not logged"
        record.args, record.exc_info, record.exc_text = (), None, None
        self._last, self._suppressed = now, 0
        return True


def serve(args: argparse.Namespace, loaded: LoadedModel | None = None) -> int:
    """`loaded`: a model already in memory (benchmarks/synthetic.py builds one); None loads
    `--model`."""
    try:
        config = config_from_args(args)
    except ValueError as exc:  # a setting out of range
        sys.stderr.write(f"pagechat serve: {exc}\n")
        return 2
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("uvicorn.error").addFilter(ClientFaultFilter())
    logging.getLogger("asyncio").addFilter(AcceptErrorFilter())
    try:
        if loaded is None and config.engine.model is not None:
            check_model(config.engine.model)  # an unusable model in one line, before start-up
        server = build_server(config, loaded)
    except (ValueError, FileNotFoundError) as exc:  # the model, or an unusable API keys file
        sys.stderr.write(f"pagechat serve: {exc}\n")
        return 2
    # uvicorn re-raises the signal that stopped it after shutting down, which would end the
    # process by that signal; absorb it so the exit status says whether shutdown was clean.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server.run()
    if not server.started:
        return 1
    if server.exit_code is not None:
        return server.exit_code
    return 0 if server.hub.balanced_at_exit else 1
