"""ChatService: what one server process holds, and who may take how much of it.

Owners: the AsyncEngine owns the engine thread; the SessionStore owns Redis I/O; the
ChatConnections own their sockets. This class wires them, admits connections and answers
under the limits, and drains them on shutdown.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from service.api.auth import DEFAULT_TENANT, Gate
from service.api.config import ServerConfig
from service.api.loop_lag import LoopLagMonitor
from service.api.metrics import Metrics
from service.api.refusal import Refusal, RefusalReason
from service.engine.async_engine import AsyncEngine, EngineDeadError
from service.engine.blocks import CacheScope
from service.engine.config import dtype_name
from service.engine.engine import LLMEngine, RequestError
from service.engine.loader import LoadedModel
from service.engine.params import SamplingParams
from service.sessions.prompt import ChatFormat
from service.sessions.redis_server import EmbeddedRedis, connect
from service.sessions.store import SessionStore

if TYPE_CHECKING:
    from service.api.connection import ChatConnection

log = logging.getLogger(__name__)


class ChatService:
    def __init__(self, config: ServerConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self._loaded = loaded  # a model already in memory (tests share one across servers)
        self._engine: AsyncEngine | None = None
        self._store: SessionStore | None = None
        self._tenant_stores: dict[str, SessionStore] = {}  # store_for: the other tenants
        self.gate = Gate.from_config(config)  # API keys, origins, the failed-attempt limiter
        self._chat_format: ChatFormat | None = None
        self._embedded: EmbeddedRedis | None = None
        self.metrics = Metrics(lambda: self.engine.stats())
        self.lag = LoopLagMonitor(
            config.lag_interval_s, observe=self.metrics.event_loop_lag.observe
        )
        self.connections: set[ChatConnection] = set()
        self.busy_sessions: set[str] = set()  # sessions with an answer in flight
        self.draining = False
        # Set when the engine thread dies: /health answers 503 and `on_fatal` stops the server.
        self.engine_failure: BaseException | None = None
        self.on_fatal: Callable[[], None] | None = None  # the server sets it: exit non-zero
        self.balanced_at_exit: bool | None = None  # set by stop(): KV pools balanced?
        self._idle = asyncio.Event()  # no answer in flight
        self._idle.set()
        # Per session: the request computing the K/V of its stored conversation's tail.
        self._completions: dict[str, asyncio.Task[None]] = {}

    # ------------------------------------------------------------------ parts

    @property
    def engine(self) -> AsyncEngine:
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
    def chat_format(self) -> ChatFormat:
        if self._chat_format is None:
            raise RuntimeError("the service is not started")
        return self._chat_format

    @property
    def model_id(self) -> str:
        return self.engine.engine.model_id

    @property
    def namespace(self) -> str:
        return self.engine.engine.block_manager.namespace

    @property
    def block_size(self) -> int:
        return self.engine.engine.config.block_size

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
        engine = await asyncio.to_thread(LLMEngine, config.engine, self._loaded)
        self._chat_format = ChatFormat(engine.tokenizer)
        self._engine = AsyncEngine(engine, on_failure=self._engine_failed)
        await self._engine.start()
        self.lag.start()
        log.info(
            "pagechat: model %s (%s weights, %s activations), %d device + %d CPU KV blocks of "
            "%d tokens, Redis %s",
            engine.model_id,
            dtype_name(engine.weight_dtype),
            dtype_name(engine.activation_dtype),
            engine.block_manager.stats().device.total,
            engine.block_manager.stats().cpu.total,
            self.block_size,
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
        for task in self._completions.values():
            task.cancel()
        await asyncio.gather(*self._completions.values(), return_exceptions=True)
        if self._engine is not None:
            await self._engine.stop()
            if self.engine_failure is not None:
                self.balanced_at_exit = False  # a failed step leaves the pools in no known state
            else:
                try:
                    self._engine.engine.check_balanced()
                    self.balanced_at_exit = True
                except AssertionError as exc:
                    log.error("KV pools unbalanced at shutdown: %s", exc)
                    self.balanced_at_exit = False
        if self._store is not None:
            await self._store.close()
        if self._embedded is not None:
            await asyncio.to_thread(self._embedded.stop)

    # ------------------------------------------------------------------ conversation cache

    def complete_conversation(
        self, session_id: str, token_ids: list[int], scope: CacheScope | None
    ) -> None:
        """Cache the K/V of a stored conversation's tail, in the background.

        An answer's last token and the end-of-turn tokens after it were never fed to the model,
        so the block they fall in would miss the prefix cache on the next turn. A prefill-only
        request (max_tokens 0) computes them now, while the user reads the answer; the next
        turn then finds every full block of the conversation cached.
        """
        if self.draining or self._engine is None:
            return
        self._completions[session_id] = asyncio.create_task(
            self._complete(session_id, token_ids, scope), name=f"complete {session_id}"
        )

    async def wait_for_completion(self, session_id: str) -> None:
        """Let the session's cache completion finish before its next turn looks up the cache."""
        task = self._completions.get(session_id)
        if task is not None:
            await asyncio.wait([task])  # a cancelled turn must not cancel the completion

    async def _complete(
        self, session_id: str, token_ids: list[int], scope: CacheScope | None
    ) -> None:
        try:
            # Named after its session (the /kv view shows it so), unique per conversation length.
            request_id = f"{session_id}/tail/{len(token_ids)}"
            params = SamplingParams(max_tokens=0)
            stream = self.engine.generate(
                token_ids, params, request_id=request_id, cache_scope=scope
            )
            async for _ in stream:
                pass
        except (RequestError, EngineDeadError) as exc:
            # Too long for the context, or shutting down: the next turn recomputes the tail.
            log.debug("no cache completion for %s: %s", session_id, exc)
        finally:
            if self._completions.get(session_id) is asyncio.current_task():
                del self._completions[session_id]

    # ------------------------------------------------------------------ admission

    def admit(self, connection: ChatConnection) -> Refusal | None:
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

    def release(self, connection: ChatConnection) -> None:
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
