"""The scheduler: which sequences run this step, and how many of their tokens.

Continuous batching under one token budget per step. Order of service:
1. running sequences that are decoding (one token each), oldest first;
2. running sequences still prefilling, a chunk each while the budget lasts;
3. swapped-out sequences coming back (only in a step that preempted nothing);
4. waiting requests, admitted first come first served while blocks and budget allow.

NOTE (reads before recompute): with a third tier (service/engine/kvtier), the scheduler asks
its scheduler side (`TierScheduler`, the only tier code it calls) whether the blocks after a
waiting prompt's prefix hit are worth loading (once per admission, and only a gap of
MIN_LOAD_BLOCKS or more). If so the prompt is not admitted at once: the load starts, the
sequence is set LOADING (it holds no blocks) while the tier's reader fetches them, and others
keep running. When the load finishes (or times out: then nothing is used) it goes back to the
front of the waiting queue and is admitted with the hit, the part of the run that still
continues it, and the rest to compute; the run's rows reach the runner in the step's batch
(`StepBatch.loaded`, in the order of the LOAD ops). At most MAX_LOADS loads are in flight
(each holds its blocks in host memory until admitted). SAVE ops of blocks the tier holds
already are dropped from the step's ops.

NOTE (preemption): when a running sequence cannot get a block, the newest running sequence is
preempted (swapped to the CPU pool or dropped for recompute, by policy; swap falls back to
recompute when the CPU pool is full). A preempted sequence resumes ahead of new requests.
Under greedy decoding it produces the same tokens it would have without the interruption.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from service.engine.blocks import BlockManager, BlockOp
from service.engine.config import PreemptionMode
from service.engine.sequence import Sequence, SequenceStatus
from service.engine.window_blocks import WindowedBlockManager

if TYPE_CHECKING:
    from service.engine.kvtier.connector import TierScheduler
    from service.engine.kvtier.tier import LoadedRun

MAX_LOADS = 8


@dataclass(slots=True)
class ScheduledChunk:
    seq: Sequence
    num_tokens: int  # computes tokens [seq.num_computed_tokens, + num_tokens)

    @property
    def samples(self) -> bool:
        """The chunk reaches the end of the sequence, so its last logits pick a token."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens


@dataclass(slots=True)
class StepBatch:
    chunks: list[ScheduledChunk]
    block_ops: list[BlockOp]  # to run, in order, before the forward
    preempted: list[Sequence] = field(default_factory=list)
    # Runs from the third tier, in the order of their LOAD ops' rows.
    loaded: list[LoadedRun] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass(slots=True)
class SchedulerCounters:
    preemptions_swap: int = 0
    preemptions_recompute: int = 0


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager | WindowedBlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        preemption_mode: PreemptionMode,
        tier: TierScheduler | None = None,
    ) -> None:
        self.block_manager = block_manager
        # The third tier's scheduler side; None without one, or without the prefix cache
        # (contiguous mode), through which its blocks are found.
        self.tier = tier if block_manager.enable_prefix_caching else None
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.preemption_mode = preemption_mode
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.swapped: deque[Sequence] = deque()
        self.loading: list[Sequence] = []  # waiting on the third tier, in arrival order
        self.counters = SchedulerCounters()

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A forked sample joins right after its parent's prefill."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self.loading)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence from whichever queue holds it; free its blocks."""
        if self.tier is not None:
            self.tier.cancel(seq)
        for queue in (self.running, self.waiting, self.swapped, self.loading):
            if seq in queue:
                queue.remove(seq)
                break
        self.block_manager.free(seq)

    def schedule(self) -> StepBatch:
        bm = self.block_manager
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[Sequence] = []
        loaded: list[LoadedRun] = []
        if self.tier is not None:
            self.tier.begin_step()
            self._collect_loads(self.tier)

        # Admission order, so a victim (the newest) is never one already scheduled this step.
        # A prefill chunk leaves room for every decode behind it, so decodes never starve.
        decodes_left = sum(s.num_uncomputed_tokens == 1 for s in self.running)
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            is_decode = seq.num_uncomputed_tokens == 1
            decodes_left -= is_decode
            n = min(seq.num_uncomputed_tokens, budget - (0 if is_decode else decodes_left))
            if n <= 0:
                continue
            while not bm.can_append(seq, n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break
            bm.append_slots(seq, n)
            chunks.append(ScheduledChunk(seq, n))
            budget -= n

        if not preempted:
            budget = self._resume_swapped(chunks, budget)
        if not preempted and not self.swapped:
            self._admit_waiting(chunks, budget, loaded)
        ops = bm.take_ops()
        if self.tier is not None:
            ops = self.tier.saves_needed(ops)
        return StepBatch(chunks, ops, preempted, loaded)

    def wait_for_load(self, timeout: float) -> None:
        """With nothing to run but loads to wait for: until one finishes, or `timeout`."""
        if self.tier is not None:
            self.tier.wait_for_load(timeout)

    def _resume_swapped(self, chunks: list[ScheduledChunk], budget: int) -> int:
        bm = self.block_manager
        while self.swapped and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.swapped[0]
            n = min(seq.num_uncomputed_tokens, budget)
            if not bm.can_swap_in(seq, n):
                break
            self.swapped.popleft()
            bm.swap_in(seq)
            bm.append_slots(seq, n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chunks.append(ScheduledChunk(seq, n))
            budget -= n
        return budget

    def _admit_waiting(
        self, chunks: list[ScheduledChunk], budget: int, loaded: list[LoadedRun]
    ) -> None:
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hit = bm.find_prefix(seq)
            run = None
            if self.tier is not None:
                if self.tier.wants_load(seq, len(hit.blocks)):
                    if len(self.loading) >= MAX_LOADS:
                        break  # first come, first served: it waits for a load to finish
                    self.waiting.popleft()
                    self.tier.start_load(seq, len(hit.blocks))
                    seq.status = SequenceStatus.LOADING
                    self.loading.append(seq)
                    continue
                run = self.tier.loaded_run(seq, len(hit.blocks))
            num_loaded = len(run) if run is not None else 0
            n = min(seq.num_tokens - hit.num_tokens - num_loaded * bm.block_size, budget)
            if not bm.can_allocate(seq, hit, n, num_loaded):
                break
            self.waiting.popleft()
            if self.tier is not None:
                self.tier.admitted(seq)
            hashes = run.hashes if run is not None else []
            bm.allocate(seq, hit, n, loaded=hashes, count_lookup=seq.params.max_tokens > 0)
            if run is not None:
                loaded.append(run)
            if seq.num_preemptions == 0:  # usage reports the first admission's hits
                seq.num_cached_tokens = hit.num_device_tokens
                seq.num_swapped_in_tokens = hit.num_cpu_tokens
                seq.num_loaded_tokens = num_loaded * bm.block_size
                seq.first_scheduled_time = time.monotonic()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chunks.append(ScheduledChunk(seq, n))
            budget -= n

    def _collect_loads(self, tier: TierScheduler) -> None:
        """Loads that finished (or timed out) put their sequences back at the queue's front."""
        pending: list[Sequence] = []
        ready: list[Sequence] = []
        for seq in self.loading:
            (ready if tier.load_done(seq) else pending).append(seq)
        if ready:
            for seq in ready:
                seq.status = SequenceStatus.WAITING
            self.loading = pending
            self.waiting.extendleft(reversed(ready))

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.num_preemptions += 1
        bm = self.block_manager
        if self.preemption_mode is PreemptionMode.SWAP and bm.can_swap_out(seq):
            bm.swap_out(seq)
            seq.status = SequenceStatus.SWAPPED
            self.swapped.appendleft(seq)  # newest victim is last preempted, first back
            self.counters.preemptions_swap += 1
            return
        bm.free(seq)
        seq.num_computed_tokens = 0
        if self.tier is not None:
            self.tier.preempted(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.counters.preemptions_recompute += 1
