"""What the service sees of the engine: `ServingEngine`, the one interface that chat turns,
OpenAI answers, page maps, /v1/stats and /v1/kv are written against, and the values it
describes the engine with.

`AsyncEngine` is the engine behind it in a server; tests put a fake behind it to drive the
service without a model. Nothing on the service side reaches past it into the LLMEngine, its
block manager or its runner.

NOTE (threads): every method is called on the event loop. What reads the engine's state
(`pages_of`, `kv_snapshot`) is answered by the engine thread between two steps, so no loop
code reads blocks while the engine moves them; `stats` is the snapshot published after the
latest step.
NOTE (abort): leaving `generate`'s iteration before it ends (use `contextlib.aclosing`), or
cancelling the task iterating it, aborts the request: its blocks are free before the next step.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from service.engine.blocks import CacheScope
from service.engine.engine import EngineStats, KVPages, KVSnapshot, RequestOutput
from service.engine.params import SamplingParams
from service.engine.tokenizer import Tokenizer


class EngineDeadError(RuntimeError):
    """The engine has stopped, or failed: no request can be served."""


@dataclass(slots=True, frozen=True)
class EngineLimits:
    max_model_len: int  # the longest sequence, prompt + answer (capped by the model's context)
    block_size: int  # tokens per KV block: page maps count in these
    num_device_blocks: int
    num_cpu_blocks: int


@dataclass(slots=True, frozen=True)
class EnginePrecision:
    # the layers' matmul weights: their GGUF types where packed ("Q4_1", "Q4_K+Q6_K"), else
    # fp32 | bf16 | fp16
    weights: str
    weight_dtype: str  # the dense matmul weights' dtype ("bfloat16")
    activation_dtype: str  # the activations'
    kv_cache_dtype: str = ""  # the KV cache's ("float16"); "" where it is the activations'
    # Threads of the native decode stack (decode steps' layers in one native call); 0 where
    # decode steps run op by op.
    decode_threads: int = 0
    # The CPU kernels' version ("avx512", "avx2 (gemv generic)"); "" where none run.
    cpu_kernels: str = ""


class ServingEngine(Protocol):
    @property
    def model_id(self) -> str: ...

    @property
    def namespace(self) -> str:
        """What block hashes cover besides tokens (the model id and the cache salt): a page
        map written under another namespace names blocks this engine never holds."""
        ...

    @property
    def tokenizer(self) -> Tokenizer: ...

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

    async def pages_of(self, token_ids: list[int], scope: CacheScope | None) -> KVPages:
        """The block hashes of `token_ids` in `scope`, and where each block is now."""
        ...

    async def kv_snapshot(self, max_sequences: int = 256) -> KVSnapshot:
        """Both pools slot by slot and the first `max_sequences` live block tables."""
        ...
