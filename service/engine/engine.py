"""LLMEngine: the synchronous engine. add_request -> step() -> RequestOutputs.

One step: the scheduler picks chunks (and issues block moves), the runner computes their
logits in one forward, the sampler picks tokens, and this module turns tokens into text,
checks stop conditions and frees what finished. Everything here runs on one thread.

With a third KV tier (service/engine/kvtier) the engine opens its `KVTierConnector` and hands
the scheduler side to the Scheduler and the worker side to the ModelRunner; the engine itself
calls it only when a request that persists finishes (its blocks are saved), for stats and at
close.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Literal

import torch

from kernels.backend import get_backend
from service.engine.blocks import BlockManager, hash_blocks
from service.engine.config import AllocationMode, EngineConfig
from service.engine.cuda_graphs import StepRunner, make_step_runner
from service.engine.grammar import GrammarCompiler, TokenBitmasks
from service.engine.host_memory import release_freed, tune_allocator
from service.engine.kvtier.connector import KVTierConnector
from service.engine.kvtier.record import BlockLayout
from service.engine.loader import LoadedModel, load_model
from service.engine.model import ModelArgs
from service.engine.params import SamplingParams
from service.engine.plan import EnginePlan, plan_engine
from service.engine.runner import ModelRunner
from service.engine.sampler import SampledToken, Sampler, SamplingRow
from service.engine.scheduler import ScheduledChunk, Scheduler
from service.engine.sequence import Sequence, SequenceStatus
from service.engine.stop import StopChecker
from service.engine.token_counts import TokenCounts
from service.engine.values import (
    CacheScope,
    EngineStats,
    FinishReason,
    GrammarError,
    KVInvariantError,
    KVSnapshot,
    RequestError,
    RequestOutput,
    SequencePages,
    StepTiming,
    Tier,
)
from service.engine.window_blocks import (
    LayerGroups,
    PoolSizes,
    WindowedBlockManager,
    pool_sizes,
)

LOAD_POLL_S = 0.05  # an engine waiting only on tier loads still takes commands this often

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Request:
    request_id: str
    params: SamplingParams
    seqs: list[Sequence]
    stop_checkers: dict[int, StopChecker] = field(default_factory=dict)
    forked: bool = False
    persist: bool = False  # save its blocks to the third tier when it finishes


@dataclass(slots=True, frozen=True)
class KVPages:
    """Where a token sequence's KV pages are now: each full block's chain hash, in order, and
    the tier holding that block (None: in no pool; a later prefill computes it again)."""

    block_hashes: list[int]
    tiers: list[Tier | None]


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedModel | None = None,
        plan: EnginePlan | None = None,
    ) -> None:
        torch.set_num_threads(config.num_threads)
        tune_allocator()
        self.config = config
        self.plan = plan = plan or plan_engine(config)
        device = plan.device
        if loaded is None:
            loaded = _load_model(config, plan)
        # A model loaded by the caller decides the activations; the KV cache follows them
        # unless `kv_cache_dtype` says otherwise (float16 on the CPU by default).
        self.activation_dtype = loaded.model.activation_dtype
        self.kv_cache_dtype = plan.kv_cache_for(self.activation_dtype)
        self.weight_dtype = loaded.model.dense_weight_dtype
        self.cpu_kernels = loaded.model.kernels
        self.model_id = loaded.model_id
        self.tokenizer = loaded.tokenizer
        self.max_model_len = min(config.max_model_len, loaded.args.max_position_embeddings)
        loaded.model.ensure_positions(self.max_model_len)
        namespace = f"{loaded.model_id}|{config.cache_salt}"
        self.kv_tier = self._open_tier(loaded.args, namespace)
        self.window_groups = self._window_groups(loaded.args)
        sizes = self._pool_sizes(loaded.args)
        self.scheduler = self._build_scheduler(sizes, namespace)
        self.block_manager = self.scheduler.block_manager
        self.runner = self._build_runner(loaded, device, sizes)
        # Pure decode steps replay CUDA graphs where they can; every other step the runner.
        self.step_runner: StepRunner = make_step_runner(self.runner, config, self.max_model_len)
        self.sampler = Sampler(device, config.seed, plan.cpu_kernels)
        self.vocab_size = loaded.args.vocab_size  # the logits' width
        self._grammars: GrammarCompiler | None = None
        self._grammar_lock = threading.Lock()
        self._bitmasks: TokenBitmasks | None = None
        self._requests: dict[str, _Request] = {}
        self._steps = 0
        self._prompt_tokens = 0
        self._prompt_tokens_computed = 0
        self._tokens_generated = 0
        self._timing = StepTiming()

    @property
    def grammars(self) -> GrammarCompiler:
        """Built at first use (the vocabulary's trie takes 0.5 s for 49k tokens, 4 s for
        262k): from any thread, as the API checks grammars before the engine runs them."""
        with self._grammar_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size)
            return self._grammars

    def _window_groups(self, args: ModelArgs) -> LayerGroups | None:
        """The layer split where the windowed layers get pools of their own (see
        `EngineConfig.window_pools`); None: one pool for every layer."""
        config = self.config
        if not config.window_pools or self.kv_tier is not None:
            return None
        if config.allocation is not AllocationMode.PAGED:
            return None
        return LayerGroups.of(args.layer_windows)

    def _pool_sizes(self, args: ModelArgs) -> PoolSizes:
        """Every pool's blocks: given, or what their MiB hold."""
        config = self.config
        groups = self.window_groups
        sizes = pool_sizes(
            layer_bytes=ModelRunner.block_bytes(args, config.block_size, self.kv_cache_dtype, 1),
            num_layers=args.num_layers,
            groups=groups,
            device_bytes=config.kv_cache_mb << 20,
            cpu_bytes=config.swap_space_mb << 20,
            block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
        )
        if config.num_device_blocks is not None:
            sizes = dataclasses.replace(
                sizes, device=config.num_device_blocks, window_device=config.num_device_blocks
            )
        if config.num_cpu_blocks is not None:
            sizes = dataclasses.replace(
                sizes, cpu=config.num_cpu_blocks, window_cpu=config.num_cpu_blocks
            )
        if config.allocation is AllocationMode.CONTIGUOUS:
            per_seq = -(-self.max_model_len // config.block_size)
            if per_seq > sizes.device:
                raise ValueError(
                    f"contiguous mode needs {per_seq} blocks per sequence; "
                    f"the pool has {sizes.device}"
                )
        return sizes

    def _open_tier(self, args: ModelArgs, namespace: str) -> KVTierConnector | None:
        """The third tier, where one is configured. It is keyed by block hash: without the
        prefix cache there are none, and no tier."""
        config = self.config
        if config.kv_tier is None or not config.enable_prefix_caching:
            return None
        shape = (args.num_layers, 2, config.block_size, args.num_kv_heads, args.head_dim)
        layout = BlockLayout(self.model_id, namespace, self.kv_cache_dtype, shape)
        return KVTierConnector.open(config.kv_tier, layout)

    def _build_scheduler(self, sizes: PoolSizes, namespace: str) -> Scheduler:
        """The block manager over the pools' slots (one per layer group), and the scheduler
        over it (with the tier's scheduler side)."""
        config = self.config

        def manager(num_device: int, num_cpu: int) -> BlockManager:
            return BlockManager(
                num_device,
                num_cpu,
                config.block_size,
                namespace=namespace,
                enable_prefix_caching=config.enable_prefix_caching,
                mode=config.allocation,
                max_model_len=self.max_model_len,
                save_evicted=self.kv_tier is not None,
            )

        full = manager(sizes.device, sizes.cpu)
        block_manager: BlockManager | WindowedBlockManager = full
        if self.window_groups is not None:
            block_manager = WindowedBlockManager(
                full, manager(sizes.window_device, sizes.window_cpu), self.window_groups
            )
        return Scheduler(
            block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            preemption_mode=config.preemption_mode,
            tier=self.kv_tier.scheduler if self.kv_tier is not None else None,
        )

    def _build_runner(
        self, loaded: LoadedModel, device: torch.device, sizes: PoolSizes
    ) -> ModelRunner:
        """The model runner: the pools (tensors), the attention backend, the tier's worker."""
        config = self.config
        return ModelRunner(
            loaded.model,
            loaded.args,
            block_size=config.block_size,
            num_device_blocks=sizes.device,
            num_cpu_blocks=sizes.cpu,
            window_groups=self.window_groups,
            num_window_blocks=(sizes.window_device, sizes.window_cpu),
            device=device,
            dtype=self.kv_cache_dtype,
            backend=get_backend(config.attention_backend, device, self.plan.cpu_kernels),
            tier=self.kv_tier.worker if self.kv_tier is not None else None,
            decode_threads=self.plan.native_threads,
            eager_pools=config.kv_pool_pages == "eager",
        )

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        cache_scope: CacheScope | None = None,
        *,
        persist: bool = False,
    ) -> None:
        """Queue a request; `cache_scope` limits who shares its KV blocks (None: everyone);
        `persist` saves its full blocks to the third tier when it finishes (a stored
        conversation, so that a restart or another replica finds it)."""
        params = params or SamplingParams()
        if request_id in self._requests:
            raise RequestError(f"request {request_id!r} is already running")
        if not prompt_token_ids:
            raise RequestError("the prompt is empty")
        if len(prompt_token_ids) >= self.max_model_len:
            raise RequestError(
                f"the prompt has {len(prompt_token_ids)} tokens; the context holds "
                f"{self.max_model_len} including at least one generated token"
            )
        blocks_needed = -(-(len(prompt_token_ids) + 1) // self.config.block_size)
        capacity = self.block_manager.stats().device.total
        if blocks_needed > capacity:
            raise RequestError(
                f"the prompt needs {blocks_needed} KV blocks; the device pool has {capacity}"
            )
        grammar = None
        if params.structured is not None:
            try:
                grammar = self.grammars.matcher(params.structured)
            except GrammarError as exc:
                raise RequestError(
                    f"the {params.structured.kind} cannot be matched: {exc}"
                ) from None
        seq = Sequence(
            request_id=request_id,
            sample_index=0,
            token_ids=list(prompt_token_ids),
            num_prompt_tokens=len(prompt_token_ids),
            params=params,
            cache_scope=cache_scope,
            generator=self._generator(params, 0),
            grammar=grammar,
        )
        request = _Request(request_id, params, [seq], persist=persist)
        request.stop_checkers[0] = StopChecker(self.tokenizer, params)
        self._requests[request_id] = request
        self.scheduler.add(seq)
        if params.max_tokens > 0:  # a prefill-only request fills the cache; nobody asked it
            self._prompt_tokens += len(prompt_token_ids)

    def pages_of(self, token_ids: list[int], scope: CacheScope | None = None) -> KVPages:
        """The hashes this engine gives the full blocks of `token_ids` in `scope`, and the
        pool holding each of those blocks now (None: neither; the third tier may hold it)."""
        bm = self.block_manager
        hashes = hash_blocks(token_ids, bm.block_size, bm.namespace, scope)
        return KVPages(hashes, [bm.tier_of(h) for h in hashes])

    def abort(self, request_id: str) -> bool:
        """Drop a request and release its blocks. False if it is not running."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        for seq in request.seqs:
            if not seq.is_finished:
                seq.status = SequenceStatus.FINISHED
                seq.finish_reason = FinishReason.ABORT
                self.scheduler.remove(seq)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    # ------------------------------------------------------------------ stepping

    def step(self) -> list[RequestOutput]:
        """Schedule, execute (block moves and inputs, the forward), postprocess (sample, then
        text, stop checks and releases); each phase's time goes to `StepTiming`."""
        clock = _PhaseClock()
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return self._idle()
        sampling = [c for c in batch.chunks if c.samples]  # before their tokens count as computed
        clock.lap("schedule")

        inputs = self.step_runner.prepare(batch)
        clock.lap("prepare")
        logits = self.step_runner.execute(inputs)  # [len(sampling), V]
        clock.lap("forward")

        # After the launch: on a GPU the forward is still running while the masks fill.
        allowed = self._grammar_masks(sampling)
        clock.lap("grammar")
        self._count_computed(batch.chunks)
        outputs, samples = self._sample(sampling, logits, allowed)
        clock.lap("sample")
        outputs += self._append_tokens(samples)
        clock.lap("postprocess")
        clock.add_to(self._timing)
        return outputs

    def stats(self) -> EngineStats:
        sched = self.scheduler
        return EngineStats(
            blocks=self.block_manager.stats(),
            num_waiting=len(sched.waiting),
            num_running=len(sched.running),
            num_swapped=len(sched.swapped),
            preemptions_swap=sched.counters.preemptions_swap,
            preemptions_recompute=sched.counters.preemptions_recompute,
            steps=self._steps,
            prompt_tokens=self._prompt_tokens,
            prompt_tokens_computed=self._prompt_tokens_computed,
            tokens_generated=self._tokens_generated,
            timing=dataclasses.replace(self._timing),
            kv_tier=self.kv_tier.stats() if self.kv_tier is not None else None,
        )

    def kv_snapshot(self, max_sequences: int = 256) -> KVSnapshot:
        """A snapshot of the KV pools for live views (read between steps, on this thread)."""
        live = self._live_sequences()
        bm = self.block_manager
        return KVSnapshot(
            block_size=bm.block_size,
            device=bm.slot_states(Tier.DEVICE),
            cpu=bm.slot_states(Tier.CPU),
            sequences=[
                SequencePages(
                    request_id=seq.request_id,
                    sample_index=seq.sample_index,
                    status=seq.status.value,
                    num_tokens=seq.num_tokens,
                    num_computed_tokens=seq.num_computed_tokens,
                    blocks=[(b.tier, b.slot) for b in seq.block_table if b is not None],
                )
                for seq in live[:max_sequences]
            ],
            num_sequences=len(live),
        )

    def check_balanced(self) -> None:
        """KVInvariantError unless the KV pools' accounting holds for the sequences alive now.

        Sequences waiting on the third tier hold no blocks; with none alive, no load is
        left waiting in the scheduler.
        """
        live = self._live_sequences()
        self.block_manager.check_invariants(live)
        for seq in self.scheduler.loading:
            if seq.block_table:
                raise KVInvariantError("a sequence loading from the tier holds blocks")
            if seq not in live:
                raise KVInvariantError("a finished sequence is still loading")
        if not live and not self.block_manager.is_idle_balanced():
            raise KVInvariantError("blocks leaked with no request alive")
        if not live and self.scheduler.loading:
            raise KVInvariantError("a load is left with no request alive")

    def close(self) -> None:
        """Write what the third tier has queued and stop its threads (at shutdown)."""
        if self.kv_tier is not None:
            self.kv_tier.close()

    # ------------------------------------------------------------------ internals

    def _idle(self) -> list[RequestOutput]:
        """A step with nothing to run: wait for the tier if only loads are left."""
        if self.scheduler.loading:
            # Only loads to wait for: wake when one finishes (or soon, for new commands).
            self.scheduler.wait_for_load(LOAD_POLL_S)
        elif self.scheduler.has_work() and not self.scheduler.running:
            raise RuntimeError("scheduler is stuck: work is queued but nothing fits")
        return []

    def _count_computed(self, chunks: list[ScheduledChunk]) -> None:
        """The step's chunks are in the cache now."""
        self._steps += 1
        for chunk in chunks:
            seq = chunk.seq
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                self._prompt_tokens_computed += min(
                    chunk.num_tokens, seq.num_prompt_tokens - seq.num_computed_tokens
                )
            seq.num_computed_tokens += chunk.num_tokens

    def _grammar_masks(self, sampling: list[ScheduledChunk]) -> dict[int, torch.Tensor]:
        """The allowed-token bitmask row of each sequence about to sample that follows a
        grammar, by seq_id (a fork made after this step's prefill shares its parent's)."""
        constrained = [c.seq for c in sampling if c.seq.grammar is not None]
        if not constrained:
            return {}
        if self._bitmasks is None:
            self._bitmasks = TokenBitmasks(self.vocab_size, self.config.max_num_seqs)
        rows = self._bitmasks.fill([seq.grammar for seq in constrained if seq.grammar])
        return {seq.seq_id: rows[i] for i, seq in enumerate(constrained)}

    def _sample(
        self,
        sampling: list[ScheduledChunk],
        logits: torch.Tensor,
        allowed: dict[int, torch.Tensor],
    ) -> tuple[list[RequestOutput], list[tuple[Sequence, SampledToken]]]:
        """A token for each sample of each chunk that samples (forking a request's other
        samples after its prefill); prefill-only requests finish instead, with an output."""
        outputs = []
        rows: list[SamplingRow] = []
        row_seqs: list[Sequence] = []
        logit_rows: list[int] = []
        for i, chunk in enumerate(sampling):
            if chunk.seq.params.max_tokens == 0:
                outputs.append(self._finish_prefill_only(chunk.seq))
                continue
            mask = allowed.get(chunk.seq.seq_id)  # the forks share their parent's
            for seq in self._samples_of(chunk.seq):
                rows.append(self._sampling_row(seq, mask))
                row_seqs.append(seq)
                logit_rows.append(i)
        if rows and logit_rows != list(range(len(sampling))):
            logits = logits[torch.tensor(logit_rows, dtype=torch.int64, device=logits.device)]
        sampled = self.sampler(logits, rows) if rows else []
        return outputs, list(zip(row_seqs, sampled, strict=True))

    def _sampling_row(self, seq: Sequence, allowed: torch.Tensor | None) -> SamplingRow:
        params = seq.params
        blocked: frozenset[int] = frozenset()
        if seq.num_output_tokens < params.min_tokens:  # min_tokens: no stop token yet
            blocked = self._requests[seq.request_id].stop_checkers[seq.sample_index].stop_ids
        if params.penalized and seq.counts is None:  # at its first sample (or readmission)
            prompt = seq.num_prompt_tokens
            seq.counts = TokenCounts(seq.token_ids[:prompt], seq.token_ids[prompt:])
        return SamplingRow(
            params,
            seq.generator,
            token_ids=seq.token_ids if params.bad_words else (),
            num_prompt_tokens=seq.num_prompt_tokens,
            counts=seq.counts,
            blocked=blocked,
            allowed=allowed,
        )

    def _append_tokens(self, samples: list[tuple[Sequence, SampledToken]]) -> list[RequestOutput]:
        """Each sampled token appended, turned into text and checked for a stop."""
        now = time.monotonic()
        outputs = []
        for seq, token in samples:
            seq.token_ids.append(token.token_id)
            if seq.counts is not None:
                seq.counts.add(token.token_id)
            if seq.grammar is not None and not seq.grammar.accept(token.token_id):
                log.warning(
                    "request %s: its grammar broke off at token %d (%s); the answer ends "
                    "with an error", seq.request_id, token.token_id, seq.grammar.error,
                )  # fmt: skip
            if seq.first_token_time is None:
                seq.first_token_time = now
            self._tokens_generated += 1
            outputs.append(self._process_token(seq, token.token_id, token.logprobs))
        return outputs

    def _live_sequences(self) -> list[Sequence]:
        return [s for r in self._requests.values() for s in r.seqs if not s.is_finished]

    def _generator(self, params: SamplingParams, index: int) -> torch.Generator | None:
        if params.seed is None:
            return None
        return self.sampler.new_generator(params.seed + index)

    def _samples_of(self, seq: Sequence) -> list[Sequence]:
        """The sequences that sample from `seq`'s logits: itself, plus n-1 forks after prefill."""
        request = self._requests[seq.request_id]
        if request.forked or request.params.n == 1:
            return [seq]
        request.forked = True
        children = []
        for i in range(1, request.params.n):
            child = seq.fork(i, self._generator(request.params, i))
            batch_full = len(self.scheduler.running) >= self.config.max_num_seqs
            if self.block_manager.can_fork(seq) and not batch_full:
                self.block_manager.fork(seq, child)
                self.scheduler.add_running(child)
                children.append(child)
            else:
                # The batch is full, or contiguous mode has no room for another reservation:
                # the sample waits its turn and computes its prompt (a prefix-cache hit if
                # the parent's blocks survive) like a request of its own.
                child.num_computed_tokens = 0
                child.num_registered_blocks = 0
                self.scheduler.add(child)
            request.seqs.append(child)
            request.stop_checkers[i] = StopChecker(self.tokenizer, request.params)
        return [seq, *children]

    def _persist(self, seq: Sequence) -> None:
        """A request that persists, finishing: the tier's scheduler side picks its computed
        full blocks the tier lacks, the worker side copies them out before they are freed."""
        tier = self.kv_tier
        if tier is None or not self._requests[seq.request_id].persist:
            return
        save = tier.scheduler.request_finished(seq)
        if save is not None:
            tier.worker.save_blocks(save)

    def _finish_prefill_only(self, seq: Sequence) -> RequestOutput:
        """The prompt's K/V are computed and its full blocks cached: nothing to generate."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = FinishReason.LENGTH
        self._persist(seq)
        self.scheduler.remove(seq)
        del self._requests[seq.request_id]
        return RequestOutput(
            request_id=seq.request_id,
            index=0,
            new_token_ids=[],
            new_text="",
            finished=True,
            finish_reason=FinishReason.LENGTH,
            logprobs=None,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            num_swapped_in_tokens=seq.num_swapped_in_tokens,
            num_loaded_tokens=seq.num_loaded_tokens,
            num_output_tokens=0,
            first_scheduled_time=seq.first_scheduled_time,
        )

    def _process_token(
        self, seq: Sequence, token_id: int, logprobs: list[tuple[int, float]] | None
    ) -> RequestOutput:
        request = self._requests[seq.request_id]
        checker = request.stop_checkers[seq.sample_index]
        text, reason = checker.push(token_id, seq.num_output_tokens)
        error = None
        if seq.grammar is not None and (error := seq.grammar.error) is not None:
            reason = FinishReason.ERROR  # the text does not match: never a `stop`
        elif reason is None and seq.grammar is not None and seq.grammar.is_finished:
            reason = FinishReason.STOP  # the grammar is complete: nothing follows
            text += checker.flush()
        if reason is None and seq.num_tokens >= self.max_model_len:
            reason = FinishReason.LENGTH
            text += checker.flush()
        if reason is not None:
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = reason
            self._persist(seq)
            self.scheduler.remove(seq)
            if all(s.is_finished for s in request.seqs):
                del self._requests[seq.request_id]
        return RequestOutput(
            request_id=seq.request_id,
            index=seq.sample_index,
            new_token_ids=[token_id],
            new_text=text,
            finished=reason is not None,
            finish_reason=reason,
            logprobs=[logprobs] if logprobs is not None else None,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            num_swapped_in_tokens=seq.num_swapped_in_tokens,
            num_loaded_tokens=seq.num_loaded_tokens,
            num_output_tokens=seq.num_output_tokens,
            first_scheduled_time=seq.first_scheduled_time,
            error=error,
        )


Phase = Literal["schedule", "prepare", "forward", "grammar", "sample", "postprocess"]


class _PhaseClock:
    """One step's phases, timed back to back: `lap(phase)` gives `phase` the time since the
    previous lap; `add_to` adds them to the engine's StepTiming (an idle step adds nothing)."""

    __slots__ = ("_laps", "_last")

    def __init__(self) -> None:
        self._last = time.perf_counter()
        self._laps: list[tuple[Phase, float]] = []

    def lap(self, phase: Phase) -> None:
        now = time.perf_counter()
        self._laps.append((phase, now - self._last))
        self._last = now

    def add_to(self, timing: StepTiming) -> None:
        for phase, seconds in self._laps:
            setattr(timing, phase, getattr(timing, phase) + seconds)


def _load_model(config: EngineConfig, plan: EnginePlan) -> LoadedModel:
    """The configured model, with the heap loading freed handed back before the KV pools
    are committed."""
    loaded = load_model(
        config.model,
        dtype=plan.activation_dtype,
        device=plan.device,
        weight_dtype=plan.weight_dtype,
        kernels=plan.cpu_kernels,
        dense_dtype=plan.dense_dtype,
        serve_stored=plan.serve_stored,
        threads=plan.native_threads,
        matmul_inputs=config.matmul_inputs,
        regroup_rows=config.weight_layout == "auto",
    )
    release_freed()
    return loaded
