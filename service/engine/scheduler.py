"""The scheduler: which sequences run this step, and how many of their tokens.

Continuous batching under one token budget per step. Order of service:
1. running sequences that are decoding (one token each), oldest first;
2. running sequences still prefilling, a chunk each while the budget lasts;
3. swapped-out sequences coming back (only in a step that preempted nothing);
4. waiting requests, admitted first come first served while blocks and budget allow.

NOTE (reads before recompute): with a third tier (service/kvtier), a waiting prompt whose
prefix hit stops at least MIN_LOAD_BLOCKS full blocks short of its end is not admitted at
once: the tier is asked for the blocks after the hit, the sequence is set LOADING (it holds
no blocks) while the tier's reader fetches them, and others keep running. When the load
finishes (or times out: then nothing is used) it goes back to the front of the waiting queue
and is admitted with the hit, the run the tier found, and the rest to compute. A sequence asks
once per admission; a shorter prefix gap is recomputed, as cheap as one step's delay. At most
MAX_LOADS loads are in flight (each holds its blocks in host memory until admitted).

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

if TYPE_CHECKING:
    from service.kvtier.tier import KVTier, LoadedRun

MIN_LOAD_BLOCKS = 4
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
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        preemption_mode: PreemptionMode,
        kv_tier: KVTier | None = None,
    ) -> None:
        self.block_manager = block_manager
        self.kv_tier = kv_tier
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
        if seq.tier_ticket is not None:
            seq.tier_ticket.cancelled = True
            seq.tier_ticket = None
        seq.tier_run = None
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
        self._collect_loads()

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
        return StepBatch(chunks, bm.take_ops(), preempted, loaded)

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
            if self._wants_load(seq, len(hit.blocks)):
                if len(self.loading) >= MAX_LOADS:
                    break  # first come, first served: it waits for a load to finish
                self.waiting.popleft()
                self._start_load(seq, len(hit.blocks))
                continue
            run = self._usable_run(seq, len(hit.blocks))
            num_loaded = len(run) if run is not None else 0
            n = min(seq.num_tokens - hit.num_tokens - num_loaded * bm.block_size, budget)
            if not bm.can_allocate(seq, hit, n, num_loaded):
                break
            self.waiting.popleft()
            seq.tier_run = None
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

    # ------------------------------------------------------------------ third tier

    def _wants_load(self, seq: Sequence, num_hit_blocks: int) -> bool:
        if self.kv_tier is None or seq.tier_probed or not self.block_manager.enable_prefix_caching:
            return False
        max_blocks = (seq.num_tokens - 1) // self.block_manager.block_size
        return max_blocks - num_hit_blocks >= MIN_LOAD_BLOCKS

    def _start_load(self, seq: Sequence, start: int) -> None:
        assert self.kv_tier is not None
        max_blocks = (seq.num_tokens - 1) // self.block_manager.block_size
        seq.tier_probed = True
        seq.tier_load_start = start
        seq.tier_ticket = self.kv_tier.load(seq.block_hashes[start:max_blocks])
        seq.status = SequenceStatus.LOADING
        self.loading.append(seq)

    def _collect_loads(self) -> None:
        """Loads that finished (or timed out) put their sequences back at the queue's front."""
        tier = self.kv_tier
        if tier is None or not self.loading:
            return
        ready = []
        for seq in self.loading:
            ticket = seq.tier_ticket
            assert ticket is not None
            if ticket.done.is_set() or tier.expired(ticket):
                seq.tier_run = None if ticket.cancelled else ticket.result
                seq.tier_ticket = None
                seq.status = SequenceStatus.WAITING
                ready.append(seq)
        if ready:
            self.loading = [s for s in self.loading if s.tier_ticket is not None]
            self.waiting.extendleft(reversed(ready))

    def _usable_run(self, seq: Sequence, num_hit_blocks: int) -> LoadedRun | None:
        """The part of `seq`'s loaded run that continues its prefix hit now.

        Blocks may have come or gone while it waited: a hit that reaches into the run shortens
        it; a hit that stops before the run starts leaves a gap, and the run is not used.
        """
        run = seq.tier_run
        if run is None:
            return None
        offset = num_hit_blocks - seq.tier_load_start
        if offset < 0 or offset >= len(run):
            seq.tier_run = None
            return None
        return run.tail(offset) if offset else run

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
        seq.tier_probed = False  # its blocks may be in the third tier by now
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.counters.preemptions_recompute += 1
