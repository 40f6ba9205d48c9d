"""ChatService: what one server process holds, and who may take how much of it.

Owners: the engine (a ServingEngine: the AsyncEngine's thread) owns the KV cache; the
SessionStore owns Redis I/O; the ConversationCache owns the tail prefills; the connections
own their sockets. This class wires them, admits connections and answers under the limits,
and drains them on shutdown.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

from service.api.auth import DEFAULT_TENANT, Gate
from service.api.config import ServerConfig
from service.api.loop_lag import LoopLagMonitor
from service.api.metrics import Metrics
from service.api.refusal import Refusal, RefusalReason
from service.engine.async_engine import AsyncEngine
from service.engine.engine import LLMEngine
from service.engine.loader import LoadedModel
from service.engine.serving import ServingEngine
from service.engine.values import KVInvariantError
from service.sessions.conversation_cache import ConversationCache
from service.sessions.prompt import ChatFormat
from service.sessions.redis_server import EmbeddedRedis, connect
from service.sessions.store import SessionStore

log = logging.getLogger(__name__)


class Connection(Protocol):
    """What the service needs of an open connection (service.api.connection.ChatConnection)."""

    @property
    def session_id(self) -> str | None: ...

    async def shutdown(self) -> None:
        """End the answer in flight (stored, reported), say why, close."""
        ...


class ChatService:
    def __init__(
        self,
        config: ServerConfig,
        loaded: LoadedModel | None = None,
        engine: ServingEngine | None = None,
    ) -> None:
        """`loaded`: a model already in memory (tests share one across servers); `engine`:
        one to serve with instead of an AsyncEngine over `config.engine` (tests' fakes)."""
        self.config = config
        self._loaded = loaded
        self._given_engine = engine
        self._engine: ServingEngine | None = None
        self._store: SessionStore | None = None
        self._tenant_stores: dict[str, SessionStore] = {}  # store_for: the other tenants
        self.gate = Gate.from_config(config)  # API keys, origins, the failed-attempt limiter
        self._conversations: ConversationCache | None = None
        self._embedded: EmbeddedRedis | None = None
        self.metrics = Metrics(lambda: self.engine.stats(), lambda: self.served_model_names[0])
        self.lag = LoopLagMonitor(
            config.lag_interval_s, observe=self.metrics.event_loop_lag.observe
        )
        self.connections: set[Connection] = set()
        self.busy_sessions: set[str] = set()  # sessions with an answer in flight
        self.draining = False
        # Set when the engine thread dies: /health answers 503 and `on_fatal` stops the server.
        self.engine_failure: BaseException | None = None
        self.on_fatal: Callable[[], None] | None = None  # the server sets it: exit non-zero
        self.balanced_at_exit: bool | None = None  # set by stop(): KV pools balanced?
        self._idle = asyncio.Event()  # no answer in flight
        self._idle.set()

    # ------------------------------------------------------------------ parts

    @property
    def engine(self) -> ServingEngine:
        if self._engine is None:
            raise RuntimeError("the service is not started")
        return self._engine

    @property
    def store(self) -> SessionStore:
        if self._store is None:
            raise RuntimeError("the service is not started")
        return self._store

    def store_for(self, tenant: str) -> SessionStore:
        """`tenant`'s sessions: a key space of its own over the same Redis client.

        NOTE: the default tenant keeps the plain prefix, so sessions made before API keys
        were on stay valid; another's keys are `{prefix}t:{tenant}:session:...`. Neither a
        tenant's name (auth._TENANT) nor a session id holds a ':', so key spaces never meet.
        """
        if tenant == DEFAULT_TENANT:
            return self.store
        store = self._tenant_stores.get(tenant)
        if store is None:
            base = self.store
            store = SessionStore(
                base._redis,  # shared, and closed once, with the default store
                prefix=f"{base.prefix}t:{tenant}:",
                ttl_s=base.ttl_s,
                replica=base.replica,
            )
            self._tenant_stores[tenant] = store
        return store

    @property
    def conversations(self) -> ConversationCache:
        """Cache scopes, page maps and tail prefills of the stored conversations."""
        if self._conversations is None:
            raise RuntimeError("the service is not started")
        return self._conversations

    @property
    def chat_format(self) -> ChatFormat:
        return self.conversations.chat_format

    @property
    def served_model_names(self) -> tuple[str, ...]:
        """The model names this server answers to (--served-model-name; else the model's id),
        the first the one it reports (/v1/models, the metrics' model_name)."""
        return self.config.served_model_name or (self.engine.model_id,)

    @property
    def _redis_pool_size(self) -> int:
        """One Redis connection for each WebSocket the server admits: a burst of opens or
        resumes as large as --max-connections never waits for another; past it, the pool
        waits (redis_server.POOL_TIMEOUT_S) instead of failing."""
        return self.config.limits.max_connections

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        config = self.config
        if config.redis_url is None:
            self._embedded = EmbeddedRedis(config.data_dir)
            await asyncio.to_thread(self._embedded.start)
            redis = self._embedded.client(max_connections=self._redis_pool_size)
        else:
            redis = connect(config.redis_url, max_connections=self._redis_pool_size)
        self._store = SessionStore(
            redis,
            prefix=config.redis_prefix,
            ttl_s=config.limits.session_ttl_s,
            replica=config.replica_id,
        )
        await self._store.ping()
        engine = self._given_engine
        if engine is None:
            built = await asyncio.to_thread(LLMEngine, config.engine, self._loaded)
            engine = AsyncEngine(built, on_failure=self._engine_failed)
        self._engine = engine
        self._conversations = ConversationCache(
            engine,
            ChatFormat(engine.tokenizer),
            replica_id=config.replica_id,
            share_across_sessions=config.prefix_cache_scope == "global",
        )
        await engine.start()
        self.lag.start()
        limits, precision = engine.limits, engine.precision
        self.metrics.describe_engine(precision)
        log.info(
            "pagechat: model %s (%s weights, %s activations, %s KV cache, CPU kernels %s,"
            " decode steps %s), %d device + %d CPU KV blocks of %d tokens, Redis %s",
            engine.model_id,
            precision.weights,
            precision.activation_dtype,
            precision.kv_cache_dtype or precision.activation_dtype,
            precision.cpu_kernels or "off",
            f"native on {precision.decode_threads} threads"
            if precision.decode_threads
            else "op by op",
            limits.num_device_blocks,
            limits.num_cpu_blocks,
            limits.block_size,
            config.redis_url or f"embedded under {config.data_dir}",
        )

    def _engine_failed(self, exc: BaseException) -> None:
        """The engine thread died: its state is unknown, so this process is done. Every
        stream has failed already; the server now drains and exits non-zero so that its
        supervisor (systemd, Docker's restart policy, Kubernetes) starts a fresh one."""
        log.critical("the engine failed (%r): unhealthy; shutting down to be restarted", exc)
        self.engine_failure = exc
        if self.on_fatal is not None:
            self.on_fatal()

    async def drain(self) -> None:
        """Refuse new work, give answers `drain_timeout_s` to finish, then end every
        connection: its answer is cancelled, stored and reported, and the socket closed."""
        self.draining = True
        if self._conversations is not None:
            self._conversations.close()
        timeout = self.config.limits.drain_timeout_s
        if not self._idle.is_set():
            log.info("waiting up to %.1fs for %d answers", timeout, len(self.busy_sessions))
            try:
                await asyncio.wait_for(self._idle.wait(), timeout)
            except TimeoutError:
                log.info("cancelling %d answers", len(self.busy_sessions))
        await asyncio.gather(*(c.shutdown() for c in list(self.connections)))

    async def stop(self) -> None:
        await self.lag.stop()
        if self._conversations is not None:
            await self._conversations.stop()
        if self._engine is not None:
            await self._engine.stop()
            if self.engine_failure is not None:
                self.balanced_at_exit = False  # a failed step leaves the pools in no known state
            else:
                try:
                    self._engine.check_balanced()
                    self.balanced_at_exit = True
                except KVInvariantError as exc:
                    log.error("KV pools unbalanced at shutdown: %s", exc)
                    self.balanced_at_exit = False
        if self._store is not None:
            await self._store.close()
        if self._embedded is not None:
            await asyncio.to_thread(self._embedded.stop)

    # ------------------------------------------------------------------ admission

    def admit(self, connection: Connection) -> Refusal | None:
        if self.draining:
            return Refusal(RefusalReason.SHUTTING_DOWN, "the server is shutting down")
        limit = self.config.limits.max_connections
        if len(self.connections) >= limit:
            return Refusal(
                RefusalReason.TOO_MANY_CONNECTIONS,
                f"the server has {limit} open connections; retry later",
            )
        self.connections.add(connection)
        self.metrics.open_connections.set(len(self.connections))
        return None

    def release(self, connection: Connection) -> None:
        self.connections.discard(connection)
        self.metrics.open_connections.set(len(self.connections))

    def begin_turn(self, session_id: str) -> Refusal | None:
        if self.draining:
            return Refusal(RefusalReason.SHUTTING_DOWN, "the server is shutting down")
        if session_id in self.busy_sessions:
            return Refusal(RefusalReason.BUSY, "this session is answering on another connection")
        limit = self.config.limits.max_inflight_turns
        if len(self.busy_sessions) >= limit:
            return Refusal(
                RefusalReason.OVERLOADED, f"the server is answering {limit} messages; retry later"
            )
        self.busy_sessions.add(session_id)
        self._idle.clear()
        self.metrics.inflight_turns.set(len(self.busy_sessions))
        return None

    def end_turn(self, session_id: str) -> None:
        self.busy_sessions.discard(session_id)
        self.metrics.inflight_turns.set(len(self.busy_sessions))
        if not self.busy_sessions:
            self._idle.set()
