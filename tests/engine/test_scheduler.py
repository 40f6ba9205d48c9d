"""The scheduler (service/engine/scheduler.py) on a real block manager and no model: which
sequences a step serves, in which order, and whom it preempts.

`step` does what the engine does with a batch, minus the forward: the chunks' tokens count as
computed, and a chunk that reaches the end of its sequence appends one sampled token.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from service.engine.blocks import BlockManager, BlockOp, OpKind, PrefixHit, hash_blocks
from service.engine.config import PreemptionMode
from service.engine.kvtier.connector import MIN_LOAD_BLOCKS, TierScheduler, TierState
from service.engine.kvtier.dir_backend import DirBackend
from service.engine.kvtier.record import BlockLayout
from service.engine.kvtier.tier import KVTier
from service.engine.params import SamplingParams
from service.engine.scheduler import Scheduler, StepBatch
from service.engine.sequence import Sequence, SequenceStatus
from service.engine.values import Tier

BLOCK_SIZE = 4
SAMPLED = 7  # the token every sampled position gets


class Harness:
    def __init__(
        self,
        *,
        device_blocks: int = 64,
        cpu_blocks: int = 16,
        budget: int = 8,
        mode: PreemptionMode = PreemptionMode.SWAP,
        tier: TierScheduler | None = None,
    ) -> None:
        # A third tier is found through the prefix cache: with one, the cache is on.
        self.bm = BlockManager(
            device_blocks,
            cpu_blocks,
            BLOCK_SIZE,
            namespace="t",
            enable_prefix_caching=tier is not None,
            save_evicted=tier is not None,
        )
        self.scheduler = Scheduler(
            self.bm, max_num_seqs=8, max_num_batched_tokens=budget, preemption_mode=mode, tier=tier
        )
        self.seqs: list[Sequence] = []

    def add(self, name: str, prompt_len: int) -> Sequence:
        """A request, queued as waiting."""
        seq = self._new(name, prompt_len)
        self.scheduler.add(seq)
        return seq

    def add_running(self, name: str, prompt_len: int, computed: int) -> Sequence:
        """A sequence already running with `computed` of its prompt's tokens in the cache (all
        of them: it has sampled a token and decodes), as forked samples and sequences coming
        back from the CPU pool join the running list: at its end."""
        seq = self._new(name, prompt_len)
        self.bm.allocate(seq, PrefixHit(block_size=BLOCK_SIZE), computed)
        seq.num_computed_tokens = computed
        if computed == prompt_len:
            seq.token_ids.append(SAMPLED)
        self.scheduler.add_running(seq)
        return seq

    def step(self) -> StepBatch:
        batch = self.scheduler.schedule()
        for chunk in batch.chunks:
            samples = chunk.samples
            chunk.seq.num_computed_tokens += chunk.num_tokens
            if samples:
                chunk.seq.token_ids.append(SAMPLED)
        return batch

    def decoding(self, name: str, prompt_len: int) -> Sequence:
        """A request admitted and prefilled alone: it decodes from the next step on."""
        seq = self.add(name, prompt_len)
        while seq.num_uncomputed_tokens != 1:
            self.step()
        return seq

    def _new(self, name: str, prompt_len: int) -> Sequence:
        seq = Sequence(
            request_id=name,
            sample_index=0,
            token_ids=list(range(100, 100 + prompt_len)),
            num_prompt_tokens=prompt_len,
            params=SamplingParams(),
        )
        self.seqs.append(seq)
        return seq

    def release_all(self) -> None:
        for seq in self.seqs:
            if seq.status is not SequenceStatus.FINISHED:
                seq.status = SequenceStatus.FINISHED
                self.scheduler.remove(seq)
        assert self.bm.is_idle_balanced()


def served(batch: StepBatch) -> list[tuple[str, int]]:
    return [(c.seq.request_id, c.num_tokens) for c in batch.chunks]


MakeHarness = Callable[..., Harness]


@pytest.fixture
def harness() -> Iterator[MakeHarness]:
    made: list[Harness] = []

    def make(**options: Any) -> Harness:
        h = Harness(**options)
        made.append(h)
        return h

    yield make
    for h in made:  # every test leaves the pools as it found them
        h.release_all()


def test_decodes_are_served_first_oldest_first_then_a_new_prompt_takes_the_rest(
    harness: MakeHarness,
) -> None:
    h = harness(budget=8)
    old = h.decoding("old", 3)
    young = h.decoding("young", 5)
    h.add("prompt", 20)
    assert served(h.step()) == [("old", 1), ("young", 1), ("prompt", 6)]
    # The prompt goes on in chunks behind the decodes until it is all computed.
    assert served(h.step()) == [("old", 1), ("young", 1), ("prompt", 6)]
    assert (old.num_output_tokens, young.num_output_tokens) == (4, 3)


def test_a_prefill_chunk_leaves_room_for_every_decode_behind_it(
    harness: MakeHarness,
) -> None:
    h = harness(budget=8)
    h.add_running("prefilling", 20, computed=4)  # first in the running list
    h.add_running("d1", 3, computed=3)  # decoding
    h.add_running("d2", 3, computed=3)
    # Alone the prefill would take all 8 tokens; it takes 6 so that both decodes run.
    assert served(h.step()) == [("prefilling", 6), ("d1", 1), ("d2", 1)]


def test_the_newest_running_sequence_is_preempted_and_swapped_out(
    harness: MakeHarness,
) -> None:
    h = harness(device_blocks=3, budget=8)
    first = h.decoding("first", 3)  # 1 block; its 5th token needs a second
    newest = h.decoding("newest", 6)  # 2 blocks: the pool is full
    batch = h.step()  # `first` needs a block, and none is free: `newest` makes room
    assert batch.preempted == [newest]
    assert served(batch) == [("first", 1)]
    assert newest.status is SequenceStatus.SWAPPED
    assert {b.tier for b in newest.block_table} == {Tier.CPU}
    assert list(h.scheduler.swapped) == [newest]
    assert h.scheduler.counters.preemptions_swap == 1
    assert first.num_output_tokens == 3


def test_without_room_in_the_cpu_pool_the_newest_is_dropped_for_recompute(
    harness: MakeHarness,
) -> None:
    h = harness(device_blocks=3, cpu_blocks=0, budget=8)
    h.decoding("first", 3)
    newest = h.decoding("newest", 6)
    assert h.step().preempted == [newest]
    assert newest.status is SequenceStatus.WAITING and newest.block_table == []
    assert newest.num_computed_tokens == 0  # all of it is computed again on return
    assert h.scheduler.waiting[0] is newest  # ahead of requests that never ran
    assert h.scheduler.counters.preemptions_recompute == 1


def test_swapped_sequences_come_back_before_any_waiting_request_is_admitted(
    harness: MakeHarness,
) -> None:
    h = harness(device_blocks=3, budget=8)
    first = h.decoding("first", 3)
    newest = h.decoding("newest", 6)
    h.step()  # `newest` swapped out
    h.add("waiting", 2)  # one block: it would fit in the free one
    assert h.bm.num_free_device_blocks == 1
    # While `newest` cannot come back, the waiting request is not admitted either.
    assert served(h.step()) == [("first", 1)]
    assert h.scheduler.waiting[0].request_id == "waiting"
    # Once room frees up, the swapped sequence comes back first, then the waiting one.
    first.status = SequenceStatus.FINISHED
    h.scheduler.remove(first)
    assert served(h.step()) == [("newest", 1), ("waiting", 2)]
    assert newest.status is SequenceStatus.RUNNING
    assert {b.tier for b in newest.block_table} == {Tier.DEVICE}


# The third tier, through its scheduler side: a real tier over a directory, blocks of one
# layer, one head of two dimensions.
LAYOUT = BlockLayout("tiny", "t", torch.float32, (1, 2, BLOCK_SIZE, 1, 2))


@pytest.fixture
def kv_tier(tmp_path: Path) -> Iterator[KVTier]:
    kv_tier = KVTier([DirBackend(tmp_path, cap_bytes=1 << 20)], LAYOUT)
    yield kv_tier
    kv_tier.close()


@pytest.fixture
def tier(kv_tier: KVTier) -> TierScheduler:
    return TierScheduler(kv_tier)


def stored(kv_tier: KVTier, token_ids: list[int], num_blocks: int) -> list[int]:
    """The first `num_blocks` full blocks of `token_ids` written to the tier; their hashes."""
    hashes = hash_blocks(token_ids, BLOCK_SIZE, "t")[:num_blocks]
    kv_tier.save(hashes, torch.randn(1, 2, num_blocks, BLOCK_SIZE, 1, 2))
    assert kv_tier.flush()
    return hashes


def test_a_prompt_missing_the_pools_waits_on_the_tier_holding_no_blocks_then_loads(
    harness: MakeHarness, kv_tier: KVTier, tier: TierScheduler
) -> None:
    h = harness(budget=8, tier=tier)
    prompt = h.add("prompt", 5 * BLOCK_SIZE + 1)
    hashes = stored(kv_tier, prompt.token_ids, 5)
    assert served(h.step()) == []  # asked the tier: nothing to run meanwhile
    assert prompt.status is SequenceStatus.LOADING and prompt.block_table == []
    assert h.scheduler.loading == [prompt]
    assert prompt.tier is not None and prompt.tier.ticket is not None
    assert prompt.tier.ticket.done.wait(10)
    batch = h.step()
    assert served(batch) == [("prompt", 1)]  # the five blocks loaded, one token computed
    assert [run.hashes for run in batch.loaded] == [hashes]
    assert [(op.kind, op.src) for op in batch.block_ops] == [(OpKind.LOAD, i) for i in range(5)]
    assert prompt.num_loaded_tokens == 5 * BLOCK_SIZE and prompt.num_cached_tokens == 0
    assert prompt.tier.run is None  # handed to the step; asked once per admission
    assert not h.scheduler.loading


def test_a_gap_shorter_than_min_load_blocks_is_recomputed_without_asking(
    harness: MakeHarness, kv_tier: KVTier, tier: TierScheduler
) -> None:
    h = harness(budget=32, tier=tier)
    prompt = h.add("prompt", (MIN_LOAD_BLOCKS - 1) * BLOCK_SIZE + 1)
    stored(kv_tier, prompt.token_ids, MIN_LOAD_BLOCKS - 1)
    assert served(h.step()) == [("prompt", prompt.num_prompt_tokens)]
    assert prompt.tier is None and prompt.num_loaded_tokens == 0


def test_removing_a_loading_sequence_gives_its_load_up(
    harness: MakeHarness, tier: TierScheduler
) -> None:
    h = harness(tier=tier)
    prompt = h.add("prompt", 6 * BLOCK_SIZE + 1)
    h.step()
    assert prompt.tier is not None and (ticket := prompt.tier.ticket) is not None
    prompt.status = SequenceStatus.FINISHED
    h.scheduler.remove(prompt)
    assert ticket.cancelled and prompt.tier.ticket is None and prompt.tier.run is None
    assert not h.scheduler.loading and not h.scheduler.has_work()


def test_a_sequence_preempted_for_recompute_asks_the_tier_again(
    harness: MakeHarness, tier: TierScheduler
) -> None:
    h = harness(device_blocks=3, cpu_blocks=0, budget=8, tier=tier)
    h.decoding("first", 3)
    newest = h.decoding("newest", 6)
    newest.tier = TierState(start=0, ticket=None)  # as if it had asked when admitted
    assert h.step().preempted == [newest]
    assert newest.tier is None  # its blocks may be in the tier by now


def test_save_ops_of_blocks_the_tier_holds_already_are_dropped(
    kv_tier: KVTier, tier: TierScheduler
) -> None:
    [held] = stored(kv_tier, list(range(BLOCK_SIZE)), 1)  # written by this process: known
    ops = [
        BlockOp(OpKind.SAVE_CPU, 0, -1, held),
        BlockOp(OpKind.SWAP_OUT, 1, 0),
        BlockOp(OpKind.SAVE_DEVICE, 2, -1, held + 1),
    ]
    assert tier.saves_needed(ops) == ops[1:]
