"""An engine without a model, behind the interface the service sees (ServingEngine): for
driving turns, connections and the conversation cache in-process, fast and scripted.

Every prompt is answered with the same text (`answer`), one token per output, cut at the
request's max_tokens; the eos token ends it (finish "stop"). Its "prefix cache" is the set of
full blocks of every sequence it was sent, so usage and page maps say what a real engine's
would after the same requests. `hold` pauses every answer after its first token until it is
set, so a test can act while an answer streams.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from service.engine.blocks import hash_blocks
from service.engine.grammar import GrammarCompiler
from service.engine.params import SamplingParams, StructuredOutput
from service.engine.tokenizer import Tokenizer
from service.engine.values import (
    BlockStats,
    CacheScope,
    EngineDeadError,
    EngineLimits,
    EnginePrecision,
    EngineStats,
    FinishReason,
    KVInvariantError,
    KVSnapshot,
    PoolUsage,
    RequestError,
    RequestOutput,
    StepTiming,
)
from tests.tiny_model import gguf_tokenizer

ANSWER = "Hello there!"


@dataclass(slots=True, frozen=True)
class FakeRequest:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    scope: CacheScope | None
    persist: bool = False


class FakeEngine:
    def __init__(
        self,
        *,
        answer: str = ANSWER,
        model_id: str = "fake-model",
        max_model_len: int = 512,
        block_size: int = 4,
    ) -> None:
        self.tokenizer: Tokenizer = gguf_tokenizer()
        self.model_id = model_id
        self.namespace = f"{model_id}|"
        self.limits = EngineLimits(
            max_model_len=max_model_len,
            block_size=block_size,
            num_device_blocks=1024,
            num_cpu_blocks=0,
        )
        self.precision = EnginePrecision(
            weights="fp32", weight_dtype="float32", activation_dtype="float32"
        )
        # The answer's ids, closed by eos as a model ends its turn.
        self.answer_ids = [*self.tokenizer.encode(answer), self.tokenizer.eos_token_ids[0]]
        self.hold = threading.Event()
        self.hold.set()
        self.requests: list[FakeRequest] = []  # every request, in the order it came
        self.aborted: list[str] = []  # requests whose stream was left before the end
        self.running: set[str] = set()
        self._cached: set[int] = set()  # hashes of every full block of every sequence seen
        self._started = False
        self._grammars: GrammarCompiler | None = None

    async def start(self) -> None:
        self._started = True

    async def stop(self) -> None:
        self._started = False

    def check_balanced(self) -> None:
        if self.running:
            raise KVInvariantError(f"requests still running: {sorted(self.running)}")

    def stats(self) -> EngineStats:
        total = self.limits.num_device_blocks
        blocks = BlockStats(
            device=PoolUsage(total=total, free=total, cached=0, in_use=0),
            cpu=PoolUsage(total=0, free=0, cached=0, in_use=0),
            prefix_queries=0,
            prefix_hits=0,
            prefix_cpu_hits=0,
            blocks_swapped_out=0,
            blocks_swapped_in=0,
            blocks_copied=0,
            blocks_dropped=0,
        )
        return EngineStats(
            blocks=blocks,
            num_waiting=0,
            num_running=len(self.running),
            num_swapped=0,
            preemptions_swap=0,
            preemptions_recompute=0,
            steps=0,
            prompt_tokens_computed=0,
            tokens_generated=0,
            timing=StepTiming(),
        )

    def cached(self, token_ids: list[int], scope: CacheScope | None) -> list[bool]:
        """Whether each full block of `token_ids` in `scope` is in the (fake) prefix cache."""
        return [h in self._cached for h in self._hashes(token_ids, scope)]

    async def kv_snapshot(self, max_sequences: int = 256) -> KVSnapshot:
        raise EngineDeadError("the fake engine keeps no pools")

    async def check_structured(self, structured: StructuredOutput) -> None:
        """As the engine checks it: compiled by llguidance on this tokenizer."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.tokenizer.vocab_size)
        self._grammars.check(structured)

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_scope: CacheScope | None = None,
        persist: bool = False,
    ) -> AsyncIterator[RequestOutput]:
        if not self._started:
            raise EngineDeadError("the fake engine is not started")
        params = params or SamplingParams()
        request_id = request_id or f"req-{len(self.requests)}"
        prompt = list(prompt_token_ids)
        if len(prompt) >= self.limits.max_model_len:
            raise RequestError(f"the prompt has {len(prompt)} tokens")
        self.requests.append(FakeRequest(request_id, prompt, params, cache_scope, persist))
        hashes = self._hashes(prompt, cache_scope)
        cached = 0  # as a real engine, it leaves the prompt's last token to compute
        while (
            cached < (len(prompt) - 1) // self.limits.block_size and hashes[cached] in self._cached
        ):
            cached += 1
        self._cached.update(hashes)
        self.running.add(request_id)
        answer = self.answer_ids[: params.max_tokens]
        detokenizer = self.tokenizer.detokenizer()
        produced: list[int] = []
        finished = False
        try:
            if not answer:  # prefill only
                finished = True
                yield self._output(request_id, prompt, cached, [], "", 0, FinishReason.LENGTH)
                return
            for i, token in enumerate(answer, start=1):
                if i > 1:
                    while not self.hold.is_set():
                        await asyncio.sleep(0.005)
                await asyncio.sleep(0)
                last = i == len(answer)
                ended = token in self.tokenizer.eos_token_ids
                reason = None if not last else FinishReason.STOP if ended else FinishReason.LENGTH
                text = "" if ended else detokenizer.push(token)
                finished = last
                produced.append(token)
                yield self._output(request_id, prompt, cached, [token], text, i, reason)
        finally:
            self.running.discard(request_id)
            # The answer's tokens were fed back, all but the newest one.
            self._cached.update(self._hashes(prompt + produced[:-1], cache_scope))
            if not finished:
                self.aborted.append(request_id)

    def _hashes(self, token_ids: list[int], scope: CacheScope | None) -> list[int]:
        return hash_blocks(token_ids, self.limits.block_size, self.namespace, scope)

    def _output(
        self,
        request_id: str,
        prompt: list[int],
        cached_blocks: int,
        tokens: list[int],
        text: str,
        num_output_tokens: int,
        reason: FinishReason | None,
    ) -> RequestOutput:
        return RequestOutput(
            request_id=request_id,
            index=0,
            new_token_ids=tokens,
            new_text=text,
            finished=reason is not None,
            finish_reason=reason,
            logprobs=None,
            num_prompt_tokens=len(prompt),
            num_cached_tokens=cached_blocks * self.limits.block_size,
            num_swapped_in_tokens=0,
            num_loaded_tokens=0,
            num_output_tokens=num_output_tokens,
        )
