"""AsyncEngine: the engine's steps on one thread, its streams on the asyncio loop.

NOTE (threads): only the engine thread touches the LLMEngine. The loop talks to it through a
command queue (add, abort, page-map snapshot) and hears back through `call_soon_threadsafe`,
one batch of outputs per step. torch releases the GIL inside its ops, so the loop stays
responsive during a step.
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
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field

from service.engine.blocks import CacheScope, Tier
from service.engine.engine import EngineStats, LLMEngine, PageMap, RequestError, RequestOutput
from service.engine.params import SamplingParams

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread stopped; no request can be served."""


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_scope: CacheScope | None


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _Snapshot:
    """Ask for a page map between two steps; the answer lands in `future`."""

    future: asyncio.Future[PageMap]
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

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="pagechat-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Abort what is running, stop the thread, and leave the pools balanced."""
        for request_id in list(self._streams):
            self._commands.put(_Abort(request_id))
        self._stopping.set()
        self._wakeup.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None

    def stats(self) -> EngineStats:
        """The snapshot published after the latest step (safe from any thread)."""
        return self._stats

    def block_tiers(self, block_hashes: list[int]) -> list[Tier | None]:
        """Where each block is now (device, CPU, or gone), for page maps.

        Read from the loop while the engine thread may be moving blocks: a snapshot that can
        be one step stale, which is all a page map promises.
        """
        tier_of = self.engine.block_manager.tier_of
        return [tier_of(h) for h in block_hashes]

    async def page_map(self, max_sequences: int = 256) -> PageMap:
        """The KV pools slot by slot and the live block tables, taken between two steps."""
        if self._error is not None or self._thread is None:
            raise EngineDeadError("the engine is not running") from self._error
        future: asyncio.Future[PageMap] = asyncio.get_running_loop().create_future()
        self._send(_Snapshot(future, max_sequences))
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
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs until every sample has finished.

        Use inside `contextlib.aclosing` (or consume to the end) so that leaving early aborts
        the request at once rather than when the generator is collected.
        """
        if self._error is not None or self._thread is None:
            raise EngineDeadError("the engine is not running") from self._error
        params = params or SamplingParams()
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._streams:
            raise RequestError(f"request {request_id!r} is already running")
        stream = _Stream(params.n)
        self._streams[request_id] = stream
        self._send(_Add(request_id, list(prompt_token_ids), params, cache_scope))
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
            self._fail_snapshots(exc)
            if self._on_failure is not None:
                self._post(self._on_failure, exc)

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
                self._post(_resolve, command.future, self.engine.page_map(command.max_sequences))
                continue
            try:
                self.engine.add_request(
                    command.request_id,
                    command.prompt_token_ids,
                    command.params,
                    command.cache_scope,
                )
            except RequestError as exc:
                self._post(self._reject, command.request_id, exc)
            except Exception as exc:  # a bad request must not stop the engine for everyone
                log.exception("request %s refused by the engine", command.request_id)
                self.engine.abort(command.request_id)
                refused = RequestError(f"the engine refused the request: {exc!r}")
                self._post(self._reject, command.request_id, refused)

    def _fail_snapshots(self, exc: BaseException) -> None:
        """Page maps asked for after the last step would otherwise wait forever."""
        for command in self._pending_commands():
            if isinstance(command, _Snapshot):
                dead = EngineDeadError(f"the engine failed: {exc!r}")
                self._post(_fail, command.future, dead)

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

    def _reject(self, request_id: str, exc: RequestError) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.queue.put_nowait(exc)

    def _fail_all(self, exc: BaseException) -> None:
        for stream in self._streams.values():
            stream.queue.put_nowait(EngineDeadError(f"the engine failed: {exc!r}"))


def _resolve(future: asyncio.Future[PageMap], page_map: PageMap) -> None:
    if not future.done():  # its waiter may have been cancelled meanwhile
        future.set_result(page_map)


def _fail(future: asyncio.Future[PageMap], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
