"""What the service sees of the engine: `ServingEngine`, the one interface that chat turns,
OpenAI answers, page maps, /v1/stats and /v1/kv are written against; the values it speaks in
are in `values.py`.

`AsyncEngine` is the engine behind it in a server; tests put a fake behind it to drive the
service without a model. Nothing on the service side reaches past it into the LLMEngine, its
block manager or its runner.

NOTE (threads): every method is called on the event loop. What reads the engine's state
(`kv_snapshot`) is answered by the engine thread between two steps, so no loop
code reads blocks while the engine moves them; `stats` is the snapshot published after the
latest step.
NOTE (abort): leaving `generate`'s iteration before it ends (use `contextlib.aclosing`), or
cancelling the task iterating it, aborts the request: its blocks are free before the next step.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from service.engine.params import SamplingParams, StructuredOutput
from service.engine.values import (
    CacheScope,
    EngineLimits,
    EnginePrecision,
    EngineStats,
    KVSnapshot,
    RequestOutput,
    TextTokenizer,
)


class ServingEngine(Protocol):
    @property
    def model_id(self) -> str: ...

    @property
    def namespace(self) -> str:
        """What block hashes cover besides tokens (the model id and the cache salt): a page
        map written under another namespace names blocks this engine never holds."""
        ...

    @property
    def tokenizer(self) -> TextTokenizer: ...

    @property
    def limits(self) -> EngineLimits: ...

    @property
    def precision(self) -> EnginePrecision: ...

    async def start(self) -> None: ...

    async def stop(self) -> None:
        """Abort what is running and stop; the pools are then idle."""
        ...

    def check_balanced(self) -> None:
        """After `stop`: KVInvariantError unless every block is accounted for."""
        ...

    def stats(self) -> EngineStats: ...

    async def check_structured(self, structured: StructuredOutput) -> None:
        """GrammarError unless answers can be constrained to `structured` (it is compiled
        now, off the event loop, and cached for the request that follows)."""
        ...

    def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_scope: CacheScope | None = None,
        persist: bool = False,
    ) -> AsyncIterator[RequestOutput]:
        """Every sample's outputs until all have finished; RequestError for a request the
        engine cannot take, EngineDeadError once the engine has failed (NOTE (abort)).
        `persist`: its full blocks also go to the third KV tier when it finishes."""
        ...

    async def kv_snapshot(self, max_sequences: int = 256) -> KVSnapshot:
        """Both pools slot by slot and the first `max_sequences` live block tables."""
        ...
