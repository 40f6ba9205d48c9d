"""A chat trace through the real Scheduler and BlockManager, without a model.

Each step "computes" what the scheduler picked by advancing `num_computed_tokens` (the
scheduler registered the full blocks as it scheduled them) and appends the trace's own answer
tokens (forking n > 1 samples after the prompt, as the engine does), so the real admission,
growth, prefix-cache, fork/copy-on-write and preemption logic is what is measured. After every
step the running sequences' device blocks are measured: slots reserved, slots holding a token,
slots no token will ever fill, logical and physical blocks. Used by `benchmarks/kv_memory.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from benchmarks.workload import Arrivals, Request, Trace, answer_token_ids
from service.engine.blocks import BlockManager, PagedSequence, PrefixHit
from service.engine.config import AllocationMode, PreemptionMode
from service.engine.params import SamplingParams
from service.engine.scheduler import Scheduler
from service.engine.sequence import Sequence, SequenceStatus

NAMESPACE = "bench/kv_memory"


@dataclass(slots=True, frozen=True)
class Allocator:
    name: str
    mode: AllocationMode
    block_size: int
    oracle: bool = False
    prefix_caching: bool = True


PAGED_16 = Allocator("paged-16", AllocationMode.PAGED, 16)
CONTIGUOUS = Allocator("contiguous", AllocationMode.CONTIGUOUS, 16)
ORACLE = Allocator("oracle", AllocationMode.PAGED, 1, oracle=True, prefix_caching=False)
ALLOCATORS = (
    Allocator("paged-8", AllocationMode.PAGED, 8),
    PAGED_16,
    Allocator("paged-32", AllocationMode.PAGED, 32),
    CONTIGUOUS,
    ORACLE,
)


class OracleBlockManager(BlockManager):
    """Reserves a sequence's exact final length (prompt + answer) when it is admitted.

    NOTE: it never forks (samples of one request each compute their prompt alone, as a
    reservation-based server does) and never shares prefixes, so growth never needs a block.
    """

    def __init__(self, num_slots: int, final_len: dict[int, int]) -> None:
        super().__init__(num_slots, 0, 1, namespace=NAMESPACE, enable_prefix_caching=False)
        self._final_len = final_len

    def _reserve(self, seq: PagedSequence, hit: PrefixHit, num_new_tokens: int) -> int:
        assert isinstance(seq, Sequence)  # the replay's own sequences, which have ids
        return max(num_new_tokens, self._final_len[seq.seq_id] - hit.num_tokens)

    def can_allocate(
        self, seq: PagedSequence, hit: PrefixHit, num_new_tokens: int, num_loaded: int = 0
    ) -> bool:
        reserve = self._reserve(seq, hit, num_new_tokens)
        return super().can_allocate(seq, hit, reserve, num_loaded)

    def allocate(
        self,
        seq: PagedSequence,
        hit: PrefixHit,
        num_new_tokens: int,
        *,
        loaded: list[int] | tuple[int, ...] = (),
        count_lookup: bool = True,
    ) -> None:
        reserve = self._reserve(seq, hit, num_new_tokens)
        super().allocate(seq, hit, reserve, loaded=loaded, count_lookup=count_lookup)

    def can_fork(self, parent: PagedSequence) -> bool:
        return False


@dataclass(slots=True)
class _Live:
    request: Request
    seqs: list[Sequence]
    forked: bool = False
    answers: dict[int, list[int]] = field(default_factory=dict)  # by sample index


@dataclass(slots=True)
class ReplayStats:
    """What one replay measured: sums over steps (slots, blocks), peaks, per-step series."""

    reserved: int = 0  # device slots in blocks held by running sequences
    used: int = 0  # of which hold a computed token
    never_used: int = 0  # of which no token of the holder's will ever fill
    logical: int = 0  # block-table entries
    physical: int = 0  # distinct blocks
    steps: int = 0
    saturated_steps: int = 0
    saturated_running: int = 0
    peak_running: int = 0
    peak_physical: int = 0
    peak_prompt_physical: int = 0
    peak_prompt_logical: int = 0
    preemptions: int = 0
    series_reserved: list[int] = field(default_factory=list)
    series_used: list[int] = field(default_factory=list)


def _measure(running: list[Sequence], bs: int, final_len: dict[int, int], t: ReplayStats) -> None:
    """Add one step's snapshot of the running sequences' device blocks to `t`.

    Private blocks are summed per sequence; a shared block (ref count > 1) counts once, with
    the most any of its holders has written into it.
    """
    shared: dict[int, list[int]] = {}  # id(block) -> [slots holding a token, ever, prompt?]
    physical = used = ever = prompt_physical = logical = prompt_logical = 0
    for seq in running:
        table, computed, final = seq.block_table, seq.num_computed_tokens, final_len[seq.seq_id]
        prompt_blocks = min(-(-seq.num_prompt_tokens // bs), len(table))
        logical += len(table)
        prompt_logical += prompt_blocks
        physical += len(table)
        prompt_physical += prompt_blocks
        used += min(computed, len(table) * bs)
        ever += min(final, len(table) * bs)
        for i, block in enumerate(table):
            if block is None or block.ref_count == 1:
                continue
            now_i = min(bs, max(0, computed - i * bs))
            ever_i = min(bs, max(0, final - i * bs))
            physical -= 1
            prompt_physical -= i < prompt_blocks
            used -= now_i
            ever -= ever_i
            entry = shared.get(id(block))
            if entry is None:
                shared[id(block)] = [now_i, ever_i, i < prompt_blocks]
            else:
                entry[0], entry[1] = max(entry[0], now_i), max(entry[1], ever_i)
                entry[2] = entry[2] or i < prompt_blocks
    for now_i, ever_i, is_prompt in shared.values():
        physical += 1
        used += now_i
        ever += ever_i
        prompt_physical += is_prompt
    t.reserved += physical * bs
    t.used += used
    t.never_used += physical * bs - ever
    t.logical += logical
    t.physical += physical
    t.steps += 1
    t.peak_running = max(t.peak_running, len(running))
    t.peak_physical = max(t.peak_physical, physical)
    t.peak_prompt_physical = max(t.peak_prompt_physical, prompt_physical)
    t.peak_prompt_logical = max(t.peak_prompt_logical, prompt_logical)
    t.series_reserved.append(physical * bs)
    t.series_used.append(used)


def _block_manager(
    alloc: Allocator, budget_tokens: int, max_model_len: int, final_len: dict[int, int]
) -> BlockManager:
    if alloc.oracle:
        return OracleBlockManager(budget_tokens, final_len)
    return BlockManager(
        budget_tokens // alloc.block_size,
        0,
        alloc.block_size,
        namespace=NAMESPACE,
        enable_prefix_caching=alloc.prefix_caching,
        mode=alloc.mode,
        max_model_len=max_model_len,
    )


def replay(
    trace: Trace,
    alloc: Allocator,
    *,
    budget_tokens: int,
    max_model_len: int,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 512,
) -> ReplayStats:
    """Run `trace` to the end through a scheduler over `alloc`; every turn due at once."""
    final_len: dict[int, int] = {}
    bm = _block_manager(alloc, budget_tokens, max_model_len, final_len)
    sched = Scheduler(
        bm,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        preemption_mode=PreemptionMode.RECOMPUTE,
    )
    arrivals = Arrivals(trace, burst=True)
    live: dict[str, _Live] = {}
    totals = ReplayStats()
    step = 0
    while not arrivals.done:
        for r in arrivals.due(step):
            prompt = arrivals.prompt(r)
            seq = Sequence(
                request_id=r.request_id,
                sample_index=0,
                token_ids=prompt,
                num_prompt_tokens=len(prompt),
                params=SamplingParams(max_tokens=r.output_len, n=r.n),
            )
            final_len[seq.seq_id] = len(prompt) + r.output_len
            live[r.request_id] = _Live(r, [seq])
            sched.add(seq)
        batch = sched.schedule()
        if batch.is_empty:
            raise RuntimeError(f"{alloc.name}: nothing fits the budget of {budget_tokens}")
        totals.preemptions += len(batch.preempted)
        sampling = [c.seq for c in batch.chunks if c.samples]
        for chunk in batch.chunks:
            chunk.seq.num_computed_tokens += chunk.num_tokens
        _measure(sched.running, bm.block_size, final_len, totals)
        if sched.waiting:
            totals.saturated_steps += 1
            totals.saturated_running += len(sched.running)
        for seq in sampling:
            for sample in _samples_of(live[seq.request_id], seq, bm, sched, final_len):
                _append(trace, live, sample, sched, arrivals, step)
        step += 1
    assert bm.is_idle_balanced()
    return totals


def _samples_of(
    entry: _Live, seq: Sequence, bm: BlockManager, sched: Scheduler, final_len: dict[int, int]
) -> list[Sequence]:
    """As the engine does: after the prompt's first sample, n - 1 forks share its blocks."""
    if entry.forked or entry.request.n == 1:
        return [seq]
    entry.forked = True
    children = []
    for i in range(1, entry.request.n):
        child = seq.fork(i, None)
        final_len[child.seq_id] = final_len[seq.seq_id]
        if bm.can_fork(seq):
            bm.fork(seq, child)
            sched.add_running(child)
            children.append(child)
        else:
            child.num_computed_tokens = 0
            child.num_registered_blocks = 0
            sched.add(child)
        entry.seqs.append(child)
    return [seq, *children]


def _append(
    trace: Trace,
    live: dict[str, _Live],
    seq: Sequence,
    sched: Scheduler,
    arrivals: Arrivals,
    step: int,
) -> None:
    entry = live[seq.request_id]
    answer = entry.answers.get(seq.sample_index)
    if answer is None:
        answer = answer_token_ids(trace.config, entry.request, seq.sample_index)
        entry.answers[seq.sample_index] = answer
    seq.token_ids.append(answer[seq.num_output_tokens])
    if seq.num_output_tokens < entry.request.output_len:
        return
    seq.status = SequenceStatus.FINISHED
    sched.remove(seq)
    if all(s.status is SequenceStatus.FINISHED for s in entry.seqs):
        del live[seq.request_id]
        arrivals.finish(entry.request, step, entry.seqs[0].token_ids)
