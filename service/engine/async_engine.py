"""AsyncEngine: the engine's steps on one thread, its streams on the asyncio loop.

It is the engine the service sees (`service.engine.serving.ServingEngine`).

NOTE (threads): only the engine thread touches the LLMEngine while it runs. The loop talks to
it through a command queue (add, abort, the pages of a conversation, a KV snapshot) and hears
back through `call_soon_threadsafe`, one batch of outputs per step. Once the thread has ended
(stopped or failed) nothing moves blocks any more, and the loop reads the engine itself.
torch releases the GIL inside its ops, so the loop stays responsive during a step.
NOTE (failures): an error tied to one request (anything `add_request` raises) fails that
request's stream and nothing else. An error inside a step leaves the engine's state unknown:
the thread stops, every stream fails with EngineDeadError, and `on_failure` tells the owner
(the service reports unhealthy at once and exits non-zero for its supervisor to restart it).
NOTE (cancellation): a stream that ends before its request finished (the consumer broke out,
was cancelled, or its client went away) aborts the request; the engine frees its blocks
before the next step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from service.engine.engine import LLMEngine
from service.engine.params import SamplingParams, StructuredOutput
from service.engine.plan import dtype_name
from service.engine.tokenizer import Tokenizer
from service.engine.values import (
    CacheScope,
    EngineDeadError,
    EngineLimits,
    EnginePrecision,
    EngineStats,
    KVSnapshot,
    RequestError,
    RequestOutput,
)

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_scope: CacheScope | None
    persist: bool = False


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _Snapshot:
    """Ask for a KV snapshot between two steps; the answer lands in `future`."""

    future: asyncio.Future[KVSnapshot]
    max_sequences: int


_Command = _Add | _Abort | _Snapshot


@dataclass(slots=True)
class _Stream:
    num_samples: int
    queue: asyncio.Queue[RequestOutput | BaseException] = field(default_factory=asyncio.Queue)
    num_finished: int = 0

    @property
    def done(self) -> bool:
        return self.num_finished == self.num_samples


class AsyncEngine:
    def __init__(
        self, engine: LLMEngine, on_failure: Callable[[BaseException], None] | None = None
    ) -> None:
        self.engine = engine
        self._on_failure = on_failure  # called on the loop once the engine thread has died
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._stopping = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stats = engine.stats()
        self._error: BaseException | None = None
        # True while the thread takes commands; flipped under the lock, so a command is either
        # queued for it or answered here, never left in a queue nobody reads.
        self._taking_commands = False
        self._lock = threading.Lock()
        blocks = engine.block_manager.stats()
        self.limits = EngineLimits(
            max_model_len=engine.max_model_len,
            block_size=engine.config.block_size,
            num_device_blocks=blocks.device.total,
            num_cpu_blocks=blocks.cpu.total,
        )
        self.precision = EnginePrecision(
            weights=engine.runner.model.weights_name,
            weight_dtype=dtype_name(engine.weight_dtype),
            activation_dtype=dtype_name(engine.activation_dtype),
            kv_cache_dtype=dtype_name(engine.kv_cache_dtype),
            decode_threads=engine.runner.native_decode_threads,
            cpu_kernels="" if engine.cpu_kernels is None else engine.cpu_kernels.describe(),
        )

    @property
    def model_id(self) -> str:
        return self.engine.model_id

    @property
    def namespace(self) -> str:
        return self.engine.block_manager.namespace

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="pagechat-engine", daemon=True)
        self._taking_commands = True
        self._thread.start()

    async def stop(self) -> None:
        """Abort what is running, stop the thread, leave the pools balanced, and write what
        the third tier has queued."""
        for request_id in list(self._streams):
            self._commands.put(_Abort(request_id))
        self._stopping.set()
        self._wakeup.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        await asyncio.to_thread(self.engine.close)

    def check_balanced(self) -> None:
        """After `stop`: KVInvariantError unless the pools' accounting holds."""
        if self._thread is not None:
            raise RuntimeError("the engine thread is running: stop it first")
        self.engine.check_balanced()

    def stats(self) -> EngineStats:
        """The snapshot published after the latest step (safe from any thread); the third
        tier's counters are read now, since its threads write while the engine is idle."""
        tier = self.engine.kv_tier
        if tier is None:
            return self._stats
        return dataclasses.replace(self._stats, kv_tier=tier.stats())

    async def check_structured(self, structured: StructuredOutput) -> None:
        await asyncio.to_thread(self.engine.grammars.check, structured)

    async def kv_snapshot(self, max_sequences: int = 256) -> KVSnapshot:
        """The KV pools slot by slot and the live block tables, taken between two steps."""
        future: asyncio.Future[KVSnapshot] = asyncio.get_running_loop().create_future()
        if not self._ask(_Snapshot(future, max_sequences)):
            raise EngineDeadError("the engine is not running") from self._error
        return await future

    @property
    def error(self) -> BaseException | None:
        """What stopped the engine thread, if it died (None while it runs or after a stop)."""
        return self._error

    @property
    def num_active_requests(self) -> int:
        return len(self._streams)

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_scope: CacheScope | None = None,
        persist: bool = False,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs until every sample has finished (`persist`: see
        `LLMEngine.add_request`).

        Use inside `contextlib.aclosing` (or consume to the end) so that leaving early aborts
        the request at once rather than when the generator is collected.
        """
        params = params or SamplingParams()
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._streams:
            raise RequestError(f"request {request_id!r} is already running")
        stream = _Stream(params.n)
        add = _Add(request_id, list(prompt_token_ids), params, cache_scope, persist)
        if not self._ask(add):
            raise EngineDeadError("the engine is not running") from self._error
        self._streams[request_id] = stream
        try:
            while not stream.done:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    stream.num_finished += 1
                yield item
        finally:
            del self._streams[request_id]
            if not stream.done:
                self._send(_Abort(request_id))

    # ------------------------------------------------------------------ engine thread

    def _send(self, command: _Command) -> None:
        self._commands.put(command)
        self._wakeup.set()

    def _ask(self, command: _Command) -> bool:
        """Queue a command for the engine thread; False if it takes no more commands."""
        with self._lock:
            if self._taking_commands:
                self._send(command)
            return self._taking_commands

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stopping.is_set():
                self._drain_commands()
                if not engine.has_unfinished_requests():
                    self._stats = engine.stats()
                    self._wakeup.wait()
                    self._wakeup.clear()
                    continue
                outputs = engine.step()
                self._stats = engine.stats()
                if outputs:
                    self._post(self._deliver, outputs)
            self._drain_commands()
        except BaseException as exc:  # the thread must report, not vanish
            log.exception("engine thread failed")
            self._error = exc
            self._post(self._fail_all, exc)
            if self._on_failure is not None:
                self._post(self._on_failure, exc)
        finally:
            with self._lock:
                self._taking_commands = False
            self._settle_leftovers()

    def _pending_commands(self) -> Iterator[_Command]:
        while True:
            try:
                yield self._commands.get_nowait()
            except queue.Empty:
                return

    def _drain_commands(self) -> None:
        for command in self._pending_commands():
            if isinstance(command, _Abort):
                self.engine.abort(command.request_id)
                continue
            if isinstance(command, _Snapshot):
                self._post(_resolve, command.future, self.engine.kv_snapshot(command.max_sequences))
                continue
            try:
                self.engine.add_request(
                    command.request_id,
                    command.prompt_token_ids,
                    command.params,
                    command.cache_scope,
                    persist=command.persist,
                )
            except RequestError as exc:
                self._post(self._reject, command.request_id, exc)
            except Exception as exc:  # a bad request must not stop the engine for everyone
                log.exception("request %s refused by the engine", command.request_id)
                self.engine.abort(command.request_id)
                refused = RequestError(f"the engine refused the request: {exc!r}")
                self._post(self._reject, command.request_id, refused)

    def _settle_leftovers(self) -> None:
        """Answer the commands queued after the thread's last look at its queue (they would
        wait forever otherwise): no snapshot, no new request."""
        for command in self._pending_commands():
            if isinstance(command, _Add):
                self._post(self._reject, command.request_id, EngineDeadError("the engine stopped"))
            elif isinstance(command, _Snapshot):
                why = "stopped" if self._error is None else f"failed: {self._error!r}"
                self._post(_fail, command.future, EngineDeadError(f"the engine {why}"))

    def _post(self, callback: object, *args: object) -> None:
        assert self._loop is not None
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(callback, *args)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ loop side

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.queue.put_nowait(out)

    def _reject(self, request_id: str, exc: RequestError | EngineDeadError) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.queue.put_nowait(exc)

    def _fail_all(self, exc: BaseException) -> None:
        for stream in self._streams.values():
            stream.queue.put_nowait(EngineDeadError(f"the engine failed: {exc!r}"))


def _resolve(future: asyncio.Future[T], result: T) -> None:
    if not future.done():  # its waiter may have been cancelled meanwhile
        future.set_result(result)


def _fail(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
