"""Hub: what one server process holds, wired together: started, handed to the transports,
drained and stopped.

Owners: the engine (a ServingEngine: the AsyncEngine's thread) owns the KV cache; the
SessionStore owns Redis I/O; the ConversationCache owns the tail prefills; `Admission` owns
the counts of connections and answers; the connections own their sockets. Each transport gets
the parts it works with (`chat_parts`, `openai_parts`), never the hub itself.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from service.api.access.gate import DEFAULT_TENANT, Gate
from service.api.admission import Admission
from service.api.observability.loop_lag import LoopLagMonitor
from service.api.observability.metrics import Metrics
from service.api.openai.routes import OpenAIParts
from service.api.ws.connection import ChatParts
from service.engine.async_engine import AsyncEngine
from service.engine.engine import LLMEngine
from service.engine.loader import LoadedModel
from service.engine.serving import ServingEngine
from service.engine.values import KVInvariantError
from service.server.config import ServerConfig
from service.sessions.conversation_cache import ConversationCache
from service.sessions.prompt import ChatFormat
from service.sessions.redis_server import EmbeddedRedis, connect
from service.sessions.store import SessionStore

log = logging.getLogger(__name__)


class Hub:
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
        # API keys, origins, the failed-attempt limiter
        self.gate = Gate.load(config.api_keys_file, config.allowed_origins)
        self._conversations: ConversationCache | None = None
        self._embedded: EmbeddedRedis | None = None
        self.metrics = Metrics(lambda: self.engine.stats(), lambda: self.served_model_names[0])
        self.lag = LoopLagMonitor(
            config.lag_interval_s, observe=self.metrics.event_loop_lag.observe
        )
        self.admission = Admission(config.limits, self.metrics)
        # Set when the engine thread dies: /health answers 503 and `on_fatal` stops the server.
        self.engine_failure: BaseException | None = None
        self.on_fatal: Callable[[], None] | None = None  # the server sets it: exit non-zero
        self.balanced_at_exit: bool | None = None  # set by stop(): KV pools balanced?

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
            store = self.store.under(f"{self.store.prefix}t:{tenant}:")
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

    def chat_parts(self) -> ChatParts:
        """What a /v1/chat connection works with (once started)."""
        return ChatParts(
            limits=self.config.limits,
            gate=self.gate,
            admission=self.admission,
            engine=self.engine,
            conversations=self.conversations,
            metrics=self.metrics,
            stores=self.store_for,
        )

    def openai_parts(self) -> OpenAIParts:
        """What the OpenAI endpoints work with (once started)."""
        return OpenAIParts(
            limits=self.config.limits,
            engine=self.engine,
            chat_format=self.chat_format,
            admission=self.admission,
            metrics=self.metrics,
            names=self.served_model_names,
            stores=self.store_for,
            ignore_unknown_fields=self.config.unknown_request_fields == "ignore",
        )

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
        admission = self.admission
        if self._conversations is not None:
            self._conversations.close()
        timeout = self.config.limits.drain_timeout_s
        if admission.answers_in_flight:
            log.info("waiting up to %.1fs for %d answers", timeout, admission.answers_in_flight)
        if not await admission.drain(timeout):
            log.info("cancelling %d answers", admission.answers_in_flight)
        await asyncio.gather(*(c.shutdown() for c in list(admission.connections)))

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
