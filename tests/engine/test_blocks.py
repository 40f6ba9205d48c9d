"""Tests for `service/engine/blocks.py`: one test per behaviour, then a stateful property test.

Both drive the manager the way the engine does (find_prefix / can_allocate / allocate, then
write; can_append / append_slots, then write; fork; swap; free) against `KVStore`, a miniature
of the runner's tensors: the "K/V" written at token position p is a pure function of the token
ids up to and including p, and the ops drained after every call are applied in order. A block
whose content is lost, stale, shared when it should not be, or moved out of order reads back
wrong.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from service.engine.blocks import (
    AllocationMode,
    Block,
    BlockManager,
    BlockOp,
    OpKind,
    block_namespace,
    hash_block,
    hash_blocks,
)
from service.engine.params import SamplingParams
from service.engine.sequence import Sequence
from service.engine.values import CacheScope, KVInvariantError, SlotState, Tier

NAMESPACE = "pagechat/test-model"
POISON = -1  # what a slot holds when nothing may read it; kv_values() are never negative


def kv_values(token_ids: list[int]) -> list[int]:
    """The K/V a model writes at each position: a function of every token up to it.

    hash() of ints and tuples is not salted per process, so failures replay exactly.
    """
    values, prev = [], 0
    for token in token_ids:
        prev = hash((prev, token)) & ((1 << 62) - 1)
        values.append(prev)
    return values


# (salt, private id or None when shared within the salt, the shared part's key or "")
Owner = tuple[str, str | None, str]


def block_owner(scope: CacheScope | None, index: int, block_size: int) -> Owner:
    """Who may find block `index` of a prompt in `scope`: the policy, written out again."""
    if scope is None:
        return ("", None, "")
    if scope.private is None:
        return (scope.salt, None, "")
    if (index + 1) * block_size <= scope.shared_tokens:
        return (scope.salt, None, scope.shared_key)
    return (scope.salt, scope.private, "")


def owner_namespace(owner: Owner) -> str:
    salt, private, key = owner
    namespace = NAMESPACE + (f"|salt:{len(salt)}:{salt}" if salt else "")
    namespace += f"|shared:{len(key)}:{key}" if key else ""
    return namespace + (f"|private:{len(private)}:{private}" if private is not None else "")


def chain_hashes(
    token_ids: list[int], block_size: int, scope: CacheScope | None = None
) -> list[int]:
    """The content hash of every full block of `token_ids`, computed independently."""
    hashes: list[int] = []
    for i in range(len(token_ids) // block_size):
        parent = hashes[-1] if hashes else None
        chunk = token_ids[i * block_size : (i + 1) * block_size]
        namespace = owner_namespace(block_owner(scope, i, block_size))
        hashes.append(hash_block(parent, chunk, namespace))
    return hashes


def make_seq(token_ids: list[int], scope: CacheScope | None = None) -> Sequence:
    return Sequence(
        request_id="req",
        sample_index=0,
        token_ids=list(token_ids),
        num_prompt_tokens=len(token_ids),
        params=SamplingParams(),
        cache_scope=scope,
    )


class KVStore:
    """The runner's KV tensors in miniature: one int per token slot, per tier."""

    def __init__(self, bm: BlockManager, num_device_blocks: int, num_cpu_blocks: int) -> None:
        self.bm = bm
        bs = bm.block_size
        self.slots = {
            Tier.DEVICE: np.full((num_device_blocks, bs), POISON, dtype=np.int64),
            Tier.CPU: np.full((num_cpu_blocks, bs), POISON, dtype=np.int64),
        }
        self.saved: dict[int, np.ndarray] = {}  # the third tier: block hash -> K/V
        self.staged: list[np.ndarray] = []  # rows LOAD ops copy from, in row order

    def run_ops(self) -> list[BlockOp]:
        """Drain the manager's ops and perform them in the order issued."""
        ops = self.bm.take_ops()
        device, cpu = self.slots[Tier.DEVICE], self.slots[Tier.CPU]
        for op in ops:
            if op.kind is OpKind.SWAP_OUT:
                cpu[op.dst] = device[op.src]
            elif op.kind is OpKind.SWAP_IN:
                device[op.dst] = cpu[op.src]
            elif op.kind in (OpKind.SAVE_CPU, OpKind.SAVE_DEVICE):
                assert op.block_hash is not None
                pool = cpu if op.kind is OpKind.SAVE_CPU else device
                self.saved[op.block_hash] = pool[op.src].copy()
            elif op.kind is OpKind.LOAD:
                device[op.dst] = self.staged[op.src]
            else:
                device[op.dst] = device[op.src]
        self.staged = []
        return ops

    def write(self, seq: Sequence, start: int, stop: int) -> None:
        bs = self.bm.block_size
        values = kv_values(seq.token_ids[:stop])
        for pos in range(start, stop):
            block = seq.block_table[pos // bs]
            assert block.tier is Tier.DEVICE, "wrote into a block that is not on the device"
            # A full block registered as it was scheduled may already have other holders,
            # prompts admitted in the same step; they read what its hash names, which is
            # what this write puts there. Any other shared block must be copied first.
            registered = block.block_hash is not None and block.block_hash == (
                seq.block_hashes[pos // bs] if pos // bs < len(seq.block_hashes) else None
            )
            assert block.ref_count == 1 or registered, "wrote into a shared block"
            self.slots[Tier.DEVICE][block.slot, pos % bs] = values[pos]

    def read(self, block: Block) -> list[int]:
        return [int(v) for v in self.slots[block.tier][block.slot]]

    def assert_computed_positions_intact(self, seq: Sequence) -> None:
        """Every computed position of `seq` reads back its own K/V, on whichever tier."""
        bs = self.bm.block_size
        expected = kv_values(seq.token_ids[: seq.num_computed_tokens])
        got = [self.read(seq.block_table[p // bs])[p % bs] for p in range(len(expected))]
        assert got == expected, f"seq {seq.seq_id}: K/V differs from what was written"

    def poison_all_but(self, keep: set[tuple[Tier, int]]) -> None:
        for tier, slots in self.slots.items():
            for slot in range(len(slots)):
                if (tier, slot) not in keep:
                    slots[slot] = POISON


# ---------------------------------------------------------------------- the engine, in brief


def compute(kv: KVStore, seq: Sequence, n: int) -> None:
    """The forward: write the K/V of the `n` tokens scheduled for `seq`."""
    kv.write(seq, seq.num_computed_tokens, seq.num_computed_tokens + n)
    seq.num_computed_tokens += n


def allocate_prompt(bm: BlockManager, seq: Sequence, chunk: int) -> int | None:
    """Admission's half in the scheduler: look the prompt up and take its blocks.

    Returns how many tokens the coming forward computes, or None if they do not fit.
    """
    hit = bm.find_prefix(seq)
    assert hit.num_tokens < seq.num_tokens, "the last token is never a hit"
    n = min(seq.num_tokens - hit.num_tokens, chunk)
    if not bm.can_allocate(seq, hit, n):
        return None
    found_on_cpu = sum(b.tier is Tier.CPU for b in hit.blocks) * bm.block_size
    before = bm.stats()
    bm.allocate(seq, hit, n)
    after = bm.stats()
    assert (hit.num_cpu_tokens, hit.num_device_tokens) == (
        found_on_cpu,
        hit.num_tokens - found_on_cpu,
    ), "a hit reports where its blocks were found, even once they are swapped in"
    assert after.prefix_queries - before.prefix_queries == seq.num_tokens
    assert after.prefix_cpu_hits - before.prefix_cpu_hits == found_on_cpu
    assert after.prefix_hits - before.prefix_hits == hit.num_tokens - found_on_cpu
    assert seq.block_table[: len(hit.blocks)] == list(hit.blocks)
    assert seq.num_computed_tokens == hit.num_tokens
    return n


def admit(bm: BlockManager, kv: KVStore, seq: Sequence, chunk: int) -> bool:
    """A step that admits `seq` alone: allocate, run the ops, compute."""
    n = allocate_prompt(bm, seq, chunk)
    if n is None:
        return False
    kv.run_ops()
    compute(kv, seq, n)
    return True


def extend(bm: BlockManager, kv: KVStore, seq: Sequence, n: int) -> bool:
    if not bm.can_append(seq, n):
        return False
    bm.append_slots(seq, n)
    kv.run_ops()
    compute(kv, seq, n)
    return True


def decode(bm: BlockManager, kv: KVStore, seq: Sequence, token: int) -> bool:
    seq.token_ids.append(token)
    return extend(bm, kv, seq, 1)


def fork(bm: BlockManager, kv: KVStore, parent: Sequence, sample_index: int) -> Sequence:
    child = parent.fork(sample_index, None)
    bm.fork(parent, child)
    kv.run_ops()
    return child


def manager(
    num_device_blocks: int,
    num_cpu_blocks: int,
    block_size: int,
    *,
    mode: AllocationMode = AllocationMode.PAGED,
    max_model_len: int = 0,
    enable_prefix_caching: bool = True,
    watermark_blocks: int = 0,
    save_evicted: bool = False,
) -> tuple[BlockManager, KVStore]:
    bm = BlockManager(
        num_device_blocks,
        num_cpu_blocks,
        block_size,
        namespace=NAMESPACE,
        enable_prefix_caching=enable_prefix_caching,
        mode=mode,
        max_model_len=max_model_len,
        watermark_blocks=watermark_blocks,
        save_evicted=save_evicted,
    )
    return bm, KVStore(bm, num_device_blocks, num_cpu_blocks)


# ---------------------------------------------------------------------- paging and prefix hits


def test_blocks_are_taken_on_demand_one_at_a_time_as_a_sequence_grows() -> None:
    bm, kv = manager(8, 0, 4)
    seq = make_seq([1, 2, 3, 4, 5])
    assert admit(bm, kv, seq, chunk=2)
    assert len(seq.block_table) == 1
    assert extend(bm, kv, seq, 3)
    assert len(seq.block_table) == 2  # 5 tokens
    for token, blocks in [(6, 2), (7, 2), (8, 2), (9, 3), (10, 3)]:
        assert decode(bm, kv, seq, token)
        assert len(seq.block_table) == blocks
        assert bm.stats().device.in_use == blocks
    kv.assert_computed_positions_intact(seq)
    bm.free(seq)
    assert bm.is_idle_balanced()


def test_a_released_prompts_full_blocks_are_a_prefix_hit_for_the_same_prompt() -> None:
    bm, kv = manager(8, 0, 2)
    first = make_seq([1, 2, 3, 4, 5])
    assert admit(bm, kv, first, chunk=5)
    full_blocks = tuple(first.block_table[:2])
    bm.free(first)

    again = make_seq([1, 2, 3, 4, 5])
    hit = bm.find_prefix(again)
    assert hit.blocks == full_blocks
    assert hit.num_tokens == hit.num_device_tokens == 4
    assert admit(bm, kv, again, chunk=5)
    assert again.num_computed_tokens == 5
    assert not bm.take_ops()
    assert bm.stats().prefix_hits == 4
    kv.assert_computed_positions_intact(again)


def test_a_prompt_admitted_in_the_same_step_shares_the_blocks_that_step_computes() -> None:
    """Two users send the same system prompt at once: the second shares the first's full
    blocks before their K/V exist, because the forward writes them before attention reads."""
    bm, kv = manager(8, 0, 2)
    first = make_seq([1, 2, 3, 4, 5, 6])
    assert allocate_prompt(bm, first, chunk=6) == 6
    second = make_seq([1, 2, 3, 4, 9])
    hit = bm.find_prefix(second)
    assert hit.blocks == tuple(first.block_table[:2])  # registered, not yet computed
    assert allocate_prompt(bm, second, chunk=8) == 1
    assert not kv.run_ops()
    compute(kv, first, 6)  # the forward: every scheduled token's K/V
    compute(kv, second, 1)
    kv.assert_computed_positions_intact(first)
    kv.assert_computed_positions_intact(second)
    assert bm.stats().device.in_use == 3 + 1  # 3 blocks for the first, 1 of its own
    assert bm.stats().prefix_hits == 4
    bm.check_invariants([first, second])
    bm.free(first)
    bm.free(second)
    assert bm.is_idle_balanced()


def test_a_block_is_registered_when_the_step_that_fills_it_is_scheduled() -> None:
    bm, _ = manager(8, 0, 4)
    seq = make_seq([1, 2, 3, 4, 5, 6])
    assert allocate_prompt(bm, seq, chunk=3) == 3  # a partial block: nothing to share yet
    assert bm.tier_of(hash_blocks([1, 2, 3, 4], 4, NAMESPACE)[0]) is None
    seq.num_computed_tokens += 3
    bm.append_slots(seq, 3)  # fills block 0, starts block 1
    assert bm.tier_of(hash_blocks([1, 2, 3, 4], 4, NAMESPACE)[0]) is Tier.DEVICE
    assert seq.num_registered_blocks == 1
    seq.num_computed_tokens += 3
    bm.free(seq)
    assert bm.is_idle_balanced()


def test_the_last_prompt_token_is_never_a_prefix_hit() -> None:
    bm, kv = manager(8, 0, 2)
    first = make_seq([1, 2, 3, 4])
    assert admit(bm, kv, first, chunk=4)
    bm.free(first)
    # Both blocks are cached, but the last token's logits are needed: only one block is a hit.
    assert bm.find_prefix(make_seq([1, 2, 3, 4])).num_tokens == 2
    assert bm.find_prefix(make_seq([1, 2, 3, 4, 9])).num_tokens == 4


def test_prefix_hits_chain_so_a_different_first_block_means_no_hit_on_later_ones() -> None:
    bm, kv = manager(8, 0, 2)
    first = make_seq([1, 2, 3, 4, 5])
    assert admit(bm, kv, first, chunk=5)
    bm.free(first)
    # Same second block, different first: the second block's K/V depend on the first.
    assert bm.find_prefix(make_seq([9, 2, 3, 4, 5])).num_tokens == 0
    assert bm.find_prefix(make_seq([1, 2, 9, 4, 5])).num_tokens == 2


def test_a_sequence_recomputed_after_preemption_reuses_its_own_cached_blocks() -> None:
    bm, kv = manager(8, 0, 2)
    seq = make_seq([1, 2, 3, 4, 5])
    assert admit(bm, kv, seq, chunk=5)
    for token in (6, 7):
        assert decode(bm, kv, seq, token)
    bm.free(seq)
    seq.num_computed_tokens = 0
    hit = bm.find_prefix(seq)
    assert hit.num_device_tokens == 6  # three full blocks; the 7th token is recomputed
    assert admit(bm, kv, seq, chunk=16)
    kv.assert_computed_positions_intact(seq)


# ---------------------------------------------------------------------- eviction between tiers


def test_the_lru_cached_block_moves_to_the_cpu_pool_when_the_device_runs_out() -> None:
    bm, kv = manager(3, 2, 2)
    first = make_seq([1, 2, 3, 4, 5])
    assert admit(bm, kv, first, chunk=5)
    head, tail = first.block_table[0], first.block_table[1]
    tail_slot = tail.slot
    bm.free(first)  # tail released before head: the tail is least recently used
    assert bm.stats().device.cached == 2

    other = make_seq([7, 8, 9])
    hit = bm.find_prefix(other)
    bm.allocate(other, hit, 3)
    assert kv.run_ops() == [BlockOp(OpKind.SWAP_OUT, tail_slot, 0)]
    assert (tail.tier, tail.slot, head.tier) == (Tier.CPU, 0, Tier.DEVICE)
    stats = bm.stats()
    assert (stats.blocks_swapped_out, stats.blocks_dropped) == (1, 0)
    assert (stats.device.cached, stats.device.in_use, stats.cpu.cached) == (1, 2, 1)


def test_a_block_dropped_from_the_cpu_pool_is_saved_before_its_slot_is_reused() -> None:
    bm, kv = manager(2, 1, 2, save_evicted=True)
    first = make_seq([1, 2, 3])
    assert admit(bm, kv, first, chunk=3)
    bm.free(first)  # block [1, 2] cached on the device
    second = make_seq([4, 5, 6])
    assert admit(bm, kv, second, chunk=3)  # [1, 2] moves to the CPU pool
    bm.free(second)
    third = make_seq([7, 8, 9])
    hit = bm.find_prefix(third)
    bm.allocate(third, hit, 3)
    ops = kv.run_ops()
    # The CPU pool's one slot is needed for [4, 5]: [1, 2] is saved first, then overwritten.
    [h12] = chain_hashes([1, 2], 2)
    save = BlockOp(OpKind.SAVE_CPU, 0, -1, h12)
    assert ops.index(save) < ops.index(BlockOp(OpKind.SWAP_OUT, ops[-1].src, 0))
    assert kv.saved[h12].tolist() == kv_values([1, 2])
    assert bm.tier_of(h12) is None and bm.stats().blocks_dropped == 1


def test_without_a_cpu_pool_a_dropped_device_block_is_saved_from_the_device() -> None:
    bm, kv = manager(2, 0, 2, save_evicted=True)
    first = make_seq([1, 2, 3])
    assert admit(bm, kv, first, chunk=3)
    bm.free(first)
    [h12] = chain_hashes([1, 2], 2)
    assert admit(bm, kv, make_seq([4, 5, 6]), chunk=3)
    assert kv.saved[h12].tolist() == kv_values([1, 2])


def test_blocks_loaded_from_the_tier_count_as_computed_and_are_cached_like_others() -> None:
    bm, kv = manager(8, 0, 2)
    tokens = [1, 2, 3, 4, 5, 6, 7]
    hashes = chain_hashes(tokens, 2)
    seq = make_seq(tokens)
    hit = bm.find_prefix(seq)
    assert hit.num_tokens == 0
    assert bm.can_allocate(seq, hit, 1, num_loaded=3)
    kv.staged = [np.array(kv_values(tokens)[2 * i : 2 * i + 2]) for i in range(3)]
    bm.allocate(seq, hit, 1, loaded=hashes[:3])
    ops = kv.run_ops()
    assert [(op.kind, op.src) for op in ops] == [
        (OpKind.LOAD, 0),
        (OpKind.LOAD, 1),
        (OpKind.LOAD, 2),
    ]
    assert seq.num_computed_tokens == 6
    compute(kv, seq, 1)
    kv.assert_computed_positions_intact(seq)
    assert bm.stats().prefix_tier_hits == 6
    assert [bm.tier_of(h) for h in hashes[:3]] == [Tier.DEVICE] * 3
    bm.free(seq)
    again = make_seq([*tokens[:6], 9])
    assert bm.find_prefix(again).num_tokens == 6  # now ordinary device hits


def test_a_prefix_hit_on_a_cpu_block_swaps_it_back_in_bit_exact() -> None:
    bm, kv = manager(3, 2, 2)
    first = make_seq([1, 2, 3, 4, 5])
    assert admit(bm, kv, first, chunk=5)
    tail = first.block_table[1]
    bm.free(first)
    other = make_seq([7, 8, 9])
    assert admit(bm, kv, other, chunk=3)
    bm.free(other)
    assert (tail.tier, tail.slot) == (Tier.CPU, 0)

    again = make_seq([1, 2, 3, 4, 6])
    hit = bm.find_prefix(again)
    assert (hit.num_device_tokens, hit.num_cpu_tokens) == (2, 2)
    assert bm.can_allocate(again, hit, 1)
    bm.allocate(again, hit, 1)
    # Where the hit was found, as usage reports read it after allocation.
    assert (hit.num_device_tokens, hit.num_cpu_tokens) == (2, 2)
    ops = kv.run_ops()
    assert BlockOp(OpKind.SWAP_IN, 0, tail.slot) in ops
    assert tail.tier is Tier.DEVICE and again.block_table[1] is tail
    compute(kv, again, 1)
    kv.assert_computed_positions_intact(again)
    stats = bm.stats()
    assert (stats.prefix_hits, stats.prefix_cpu_hits, stats.blocks_swapped_in) == (2, 2, 1)


def test_the_device_evicts_the_least_recently_released_block_first() -> None:
    bm, kv = manager(3, 4, 2)
    for tokens in ([1, 2, 3], [4, 5, 6]):
        seq = make_seq(tokens)
        assert admit(bm, kv, seq, chunk=3)
        bm.free(seq)
    reuse = make_seq([1, 2, 9])  # [1, 2] is a hit again, then released after [4, 5]
    assert admit(bm, kv, reuse, chunk=3)
    bm.free(reuse)
    other = make_seq([7, 8, 9])
    assert admit(bm, kv, other, chunk=3)  # two slots: the free one, then the LRU victim
    assert bm.find_prefix(make_seq([4, 5, 6])).num_cpu_tokens == 2
    assert bm.find_prefix(make_seq([1, 2, 3])).num_device_tokens == 2


def test_the_cpu_pool_drops_its_own_lru_block_when_full() -> None:
    bm, kv = manager(2, 2, 2)
    for tokens in ([1, 2, 3], [4, 5, 6], [7, 8, 9], [3, 2, 1]):
        seq = make_seq(tokens)
        assert admit(bm, kv, seq, chunk=3)
        bm.free(seq)
    stats = bm.stats()
    assert (stats.blocks_swapped_out, stats.blocks_dropped) == (3, 1)
    assert (stats.cpu.cached, stats.device.cached) == (2, 1)
    assert bm.find_prefix(make_seq([1, 2, 3])).num_tokens == 0  # the first swapped out
    assert bm.find_prefix(make_seq([4, 5, 6])).num_cpu_tokens == 2
    assert bm.find_prefix(make_seq([7, 8, 9])).num_cpu_tokens == 2
    assert bm.find_prefix(make_seq([3, 2, 1])).num_device_tokens == 2


def test_allocating_several_cpu_hits_with_both_pools_full_keeps_every_hit() -> None:
    # Swapping in the first CPU hit evicts a device block to the CPU pool, whose LRU entry is
    # the second, not yet claimed, CPU hit: it must not be the one dropped.
    bm, kv = manager(4, 2, 1)
    for tokens in ([1, 2, 3, 4], [5, 6, 7]):
        seq = make_seq(tokens)
        assert admit(bm, kv, seq, chunk=4)
        bm.free(seq)
    again = make_seq([1, 2, 3, 9])
    hit = bm.find_prefix(again)
    assert (hit.num_device_tokens, hit.num_cpu_tokens) == (1, 2)
    assert admit(bm, kv, again, chunk=1)
    assert all(b.tier is Tier.DEVICE for b in again.block_table)
    kv.assert_computed_positions_intact(again)
    bm.check_invariants([again])


def test_claiming_a_cached_device_hit_takes_it_off_the_evictable_list() -> None:
    bm, kv = manager(2, 0, 2)
    first = make_seq([1, 2, 3])
    assert admit(bm, kv, first, chunk=3)
    bm.free(first)  # one block cached, one free
    again = make_seq([1, 2, 3, 4, 5])
    hit = bm.find_prefix(again)
    assert hit.num_device_tokens == 2
    assert bm.num_free_device_blocks == 2
    assert not bm.can_allocate(again, hit, 3)  # the hit and two more: three blocks
    assert bm.can_allocate(again, hit, 2)


def test_blocks_in_use_are_never_evicted() -> None:
    bm, kv = manager(2, 4, 2)
    seq = make_seq([1, 2, 3, 4])
    assert admit(bm, kv, seq, chunk=4)
    other = make_seq([5, 6])
    assert not bm.can_allocate(other, bm.find_prefix(other), 2)
    assert bm.num_free_device_blocks == 0


def test_the_watermark_holds_device_blocks_back_from_admission_only() -> None:
    bm, kv = manager(3, 0, 2, watermark_blocks=1)
    seq = make_seq([1, 2, 3, 4, 5])
    assert not bm.can_allocate(seq, bm.find_prefix(seq), 5)
    assert admit(bm, kv, seq, chunk=4)
    assert extend(bm, kv, seq, 1)  # growing may use the watermark


# ---------------------------------------------------------------------- fork and copy-on-write


def test_copy_on_write_copies_a_shared_partial_block_once_per_writer() -> None:
    bm, kv = manager(8, 0, 4)
    parent = make_seq([1, 2, 3])
    assert admit(bm, kv, parent, chunk=3)
    shared = parent.block_table[0]
    children = [fork(bm, kv, parent, i) for i in (1, 2)]
    assert shared.ref_count == 3

    for writer, token in [(parent, 10), (children[0], 11)]:
        assert decode(bm, kv, writer, token)
        assert writer.block_table[0] is not shared
    assert bm.stats().blocks_copied == 2
    assert shared.ref_count == 1

    # The last holder writes in place; a writer that already copied does not copy again.
    assert decode(bm, kv, children[1], 12)
    assert children[1].block_table[0] is shared
    assert decode(bm, kv, parent, 13)
    assert bm.stats().blocks_copied == 2
    for seq in (parent, *children):
        kv.assert_computed_positions_intact(seq)
    bm.check_invariants([parent, *children])


def test_the_copy_is_issued_before_the_write_and_after_any_eviction_for_its_slot() -> None:
    bm, kv = manager(2, 2, 2)
    cached = make_seq([7, 8, 9])
    assert admit(bm, kv, cached, chunk=3)
    bm.free(cached)  # one cached block, one free slot
    parent = make_seq([1])
    assert admit(bm, kv, parent, chunk=1)
    child = fork(bm, kv, parent, 1)
    parent.token_ids.append(5)
    assert bm.can_append(parent, 1)
    bm.append_slots(parent, 1)
    ops = kv.run_ops()
    assert [op.kind for op in ops] == [OpKind.SWAP_OUT, OpKind.COPY]
    assert ops[0].src == ops[1].dst  # the evicted block's slot receives the copy
    compute(kv, parent, 1)
    kv.assert_computed_positions_intact(parent)
    kv.assert_computed_positions_intact(child)


def test_growing_past_a_shared_partial_block_needs_room_for_its_copy_too() -> None:
    bm, kv = manager(3, 0, 4)
    parent = make_seq([1, 2, 3, 4, 5, 6])
    assert admit(bm, kv, parent, chunk=3)
    fork(bm, kv, parent, 1)
    filler = make_seq([7])
    assert admit(bm, kv, filler, chunk=1)
    # Tokens 3..5 need a copy of the shared block and a new block: two, with one free.
    assert not bm.can_append(parent, 3)
    assert bm.can_append(parent, 1)


def test_full_shared_blocks_are_never_copied() -> None:
    bm, kv = manager(8, 0, 2)
    parent = make_seq([1, 2, 3, 4])
    assert admit(bm, kv, parent, chunk=4)
    child = fork(bm, kv, parent, 1)
    assert decode(bm, kv, parent, 5)
    assert decode(bm, kv, child, 6)
    assert bm.stats().blocks_copied == 0
    assert parent.block_table[:2] == child.block_table[:2]
    assert parent.block_table[2] is not child.block_table[2]


# ---------------------------------------------------------------------- preemption by swap


def test_swap_out_moves_only_private_blocks_and_swap_in_brings_them_back() -> None:
    bm, kv = manager(8, 8, 2)
    parent = make_seq([1, 2, 3, 4, 5])
    assert admit(bm, kv, parent, chunk=5)
    child = fork(bm, kv, parent, 1)
    assert decode(bm, kv, parent, 6)  # copies the shared partial block
    assert decode(bm, kv, parent, 7)  # a new private block
    shared, private = parent.block_table[:2], parent.block_table[2:]
    private_slots = [b.slot for b in private]

    assert bm.can_swap_out(parent)
    bm.swap_out(parent)
    ops = kv.run_ops()
    assert [(op.kind, op.src) for op in ops] == [(OpKind.SWAP_OUT, s) for s in private_slots]
    assert all(b.tier is Tier.DEVICE for b in shared)
    assert all(b.tier is Tier.CPU for b in private)
    assert bm.stats().cpu.in_use == 2
    kv.assert_computed_positions_intact(parent)
    kv.assert_computed_positions_intact(child)

    assert bm.can_swap_in(parent, 1)
    bm.swap_in(parent)
    assert [op.kind for op in kv.run_ops()] == [OpKind.SWAP_IN] * 2
    assert all(b.tier is Tier.DEVICE for b in parent.block_table)
    assert decode(bm, kv, parent, 8)
    kv.assert_computed_positions_intact(parent)
    bm.check_invariants([parent, child])


def test_can_swap_in_counts_the_blocks_the_next_tokens_need() -> None:
    bm, kv = manager(3, 4, 2)
    seq = make_seq([1, 2, 3, 4, 5])
    assert admit(bm, kv, seq, chunk=4)
    bm.swap_out(seq)
    kv.run_ops()
    filler = make_seq([7])
    assert admit(bm, kv, filler, chunk=1)
    assert bm.can_swap_in(seq, 0)
    assert not bm.can_swap_in(seq, 1)  # token 4 starts a third block


def test_a_swapped_out_sequence_freed_leaves_its_full_blocks_cached_on_the_cpu() -> None:
    bm, kv = manager(4, 4, 2)
    seq = make_seq([1, 2, 3, 4, 5])
    assert admit(bm, kv, seq, chunk=5)
    bm.swap_out(seq)
    kv.run_ops()
    bm.free(seq)
    assert (bm.stats().cpu.cached, bm.stats().cpu.free) == (2, 2)
    again = make_seq([1, 2, 3, 4, 5])
    assert bm.find_prefix(again).num_cpu_tokens == 4
    assert admit(bm, kv, again, chunk=1)
    kv.assert_computed_positions_intact(again)


def test_swap_out_needs_room_for_every_private_block() -> None:
    bm, kv = manager(8, 1, 2)
    seq = make_seq([1, 2, 3, 4, 5])
    assert admit(bm, kv, seq, chunk=5)
    assert not bm.can_swap_out(seq)


# ---------------------------------------------------------------------- page-map views


def test_slot_states_tell_free_in_use_shared_and_cached_slots_apart() -> None:
    bm, kv = manager(8, 4, 2)
    parent = make_seq([1, 2, 3, 4, 5])  # blocks [1 2] [3 4] [5]
    assert admit(bm, kv, parent, chunk=5)
    child = fork(bm, kv, parent, 1)
    assert decode(bm, kv, child, 9)  # writes into the shared partial block: copied first
    device = bm.slot_states(Tier.DEVICE)
    shared = {b.slot for b in parent.block_table[:2]}
    assert {b.slot for b in child.block_table[:2]} == shared
    own = {parent.block_table[2].slot, child.block_table[2].slot}
    assert len(own) == 2
    assert {i for i, s in enumerate(device) if s is SlotState.SHARED} == shared
    assert {i for i, s in enumerate(device) if s is SlotState.IN_USE} == own
    assert device.count(SlotState.FREE) == 8 - 4
    assert bm.slot_states(Tier.CPU) == [SlotState.FREE] * 4

    child_full = child.block_table[2].slot  # [5 9]: full once the child decoded
    bm.free(child)
    bm.free(parent)
    device = bm.slot_states(Tier.DEVICE)
    # Full blocks stay cached for a prefix hit; the parent's partial last block is freed.
    assert {i for i, s in enumerate(device) if s is SlotState.CACHED} == shared | {child_full}
    assert device.count(SlotState.FREE) == 5
    assert bm.is_idle_balanced()


def test_slot_states_follow_a_block_swapped_to_the_cpu() -> None:
    bm, kv = manager(4, 4, 2)
    seq = make_seq([1, 2, 3, 4, 5])
    assert admit(bm, kv, seq, chunk=5)
    assert bm.can_swap_out(seq)
    bm.swap_out(seq)
    kv.run_ops()
    cpu = bm.slot_states(Tier.CPU)
    assert {i for i, s in enumerate(cpu) if s is SlotState.IN_USE} == {
        b.slot for b in seq.block_table
    }
    assert bm.slot_states(Tier.DEVICE) == [SlotState.FREE] * 4
    bm.free(seq)
    assert bm.is_idle_balanced()


# ---------------------------------------------------------------------- contiguous mode


def test_contiguous_mode_reserves_max_model_len_at_admission_and_never_grows() -> None:
    bm, kv = manager(6, 0, 4, mode=AllocationMode.CONTIGUOUS, max_model_len=10)
    seq = make_seq([1, 2])
    assert bm.find_prefix(seq).num_tokens == 0
    assert admit(bm, kv, seq, chunk=2)
    assert len(seq.block_table) == 3  # ceil(10 / 4)
    for token in range(3, 11):
        assert decode(bm, kv, seq, token)
        assert len(seq.block_table) == 3
    kv.assert_computed_positions_intact(seq)
    other = make_seq([1])
    assert admit(bm, kv, other, chunk=1)
    assert not bm.can_allocate(make_seq([5]), bm.find_prefix(make_seq([5])), 1)
    bm.free(seq)
    bm.free(other)
    assert bm.is_idle_balanced()
    assert bm.stats().device.free == 6  # nothing is cached in contiguous mode


def test_contiguous_fork_copies_only_the_computed_blocks() -> None:
    bm, kv = manager(6, 0, 4, mode=AllocationMode.CONTIGUOUS, max_model_len=10)
    parent = make_seq([1, 2, 3, 4, 5])
    assert admit(bm, kv, parent, chunk=5)
    assert bm.can_fork(parent)
    child = fork(bm, kv, parent, 1)
    assert len(child.block_table) == 3
    assert bm.stats().blocks_copied == 2  # ceil(5 / 4), not the whole reservation
    kv.assert_computed_positions_intact(child)
    assert not bm.can_fork(parent)


# ---------------------------------------------------------------------- hashes, stats, checks


def test_hash_block_values_are_pinned_so_stored_page_maps_stay_valid() -> None:
    # Page maps in Redis outlive the process: these values must never change.
    first = hash_block(None, [1, 2, 3, 4], NAMESPACE)
    assert first == 15144478872839961911
    assert hash_block(first, [5, 6, 7, 8], NAMESPACE) == 13569300167870941280


def test_hash_block_depends_on_parent_tokens_and_namespace() -> None:
    base = hash_block(None, [1, 2], NAMESPACE)
    assert hash_block(None, [1, 2], NAMESPACE) == base
    assert hash_block(None, (t for t in [1, 2]), NAMESPACE) == base
    assert hash_block(base, [1, 2], NAMESPACE) != base
    assert hash_block(None, [2, 1], NAMESPACE) != base
    assert hash_block(None, [1, 2], NAMESPACE + "/salt") != base


def test_hash_blocks_chains_every_full_block_and_ignores_the_partial_tail() -> None:
    tokens = [1, 2, 3, 4, 5]
    assert hash_blocks(tokens, 2, NAMESPACE) == chain_hashes(tokens, 2)
    assert len(hash_blocks(tokens, 2, NAMESPACE)) == 2
    assert hash_blocks(tokens[:1], 2, NAMESPACE) == []


# ---------------------------------------------------------------------- cache scopes

HASHES_BEFORE_SCOPES = [15144478872839961911, 13569300167870941280]  # of range(1, 11), bs 4
SCOPED_SHARED_HASH, SCOPED_PRIVATE_HASH = 15152071268033970816, 2624356586863062220


def test_no_scope_and_the_default_scope_hash_as_before_scopes_existed() -> None:
    tokens = list(range(1, 11))
    assert hash_blocks(tokens, 4, NAMESPACE) == HASHES_BEFORE_SCOPES
    assert hash_blocks(tokens, 4, NAMESPACE, None) == HASHES_BEFORE_SCOPES
    assert hash_blocks(tokens, 4, NAMESPACE, CacheScope()) == HASHES_BEFORE_SCOPES
    # Private only past token 8: both full blocks are shared, in the engine's own namespace.
    scope = CacheScope(private="s", shared_tokens=8)
    assert hash_blocks(tokens, 4, NAMESPACE, scope) == HASHES_BEFORE_SCOPES


def test_scoped_hash_values_are_pinned_so_stored_page_maps_stay_valid() -> None:
    scope = CacheScope(salt="tenant", private="session", shared_tokens=4)
    shared, private = hash_blocks(list(range(1, 11)), 4, NAMESPACE, scope)
    assert shared == SCOPED_SHARED_HASH
    assert private == SCOPED_PRIVATE_HASH


@pytest.mark.parametrize(
    "scope",
    [
        None,
        CacheScope(salt="t"),
        CacheScope(private="s"),
        CacheScope(salt="t", private="s", shared_tokens=5),
        CacheScope(private="s", shared_tokens=100),
    ],
)
def test_hash_blocks_in_a_scope_chains_shared_blocks_into_private_ones(
    scope: CacheScope | None,
) -> None:
    tokens = list(range(1, 14))
    assert hash_blocks(tokens, 4, NAMESPACE, scope) == chain_hashes(tokens, 4, scope)


def test_salts_and_ids_cannot_spell_one_another() -> None:
    """Both may come from clients: no pair may hash like another pair, or like no scope."""
    scopes = [
        CacheScope(salt="a"),
        CacheScope(private="a"),
        CacheScope(salt="a|b"),
        CacheScope(salt="a", private="b"),
        CacheScope(salt="a|private:1:b"),
        CacheScope(private="salt:1:a"),
        CacheScope(salt="a", private="b|c"),
        CacheScope(salt="a|b", private="c"),
        CacheScope(salt="a:", private="b"),
        CacheScope(salt="a", private="b", shared_tokens=4, shared_key="c"),
        CacheScope(salt="a|shared:1:c", private="b", shared_tokens=4),
        CacheScope(private="b", shared_tokens=4, shared_key="a"),
    ]
    namespaces = {block_namespace(NAMESPACE, scope, 0, 4) for scope in scopes}
    assert len(namespaces) == len(scopes) and NAMESPACE not in namespaces
    hashes = {hash_blocks([1, 2, 3, 4], 4, NAMESPACE, scope)[0] for scope in scopes}
    assert len(hashes | set(hash_blocks([1, 2, 3, 4], 4, NAMESPACE))) == len(scopes) + 1


def test_sessions_share_the_shared_part_only_under_the_same_key() -> None:
    """The shared part's blocks are keyed by a digest of the whole shared part: a session
    whose system prompt merely begins like another's finds none of its blocks, not even the
    first (else a system prompt could be read block by block)."""
    bm, kv = manager(16, 0, 4)
    tokens = list(range(1, 15))
    alice = CacheScope(private="alice", shared_tokens=8, shared_key="prompt-1")
    first = make_seq(tokens, alice)
    assert admit(bm, kv, first, chunk=14)
    bm.free(first)

    def hit(scope: CacheScope) -> int:
        return bm.find_prefix(make_seq(tokens, scope)).num_tokens

    assert hit(CacheScope(private="bob", shared_tokens=8, shared_key="prompt-1")) == 8
    assert hit(CacheScope(private="bob", shared_tokens=8, shared_key="prompt-2")) == 0
    assert hit(CacheScope(private="bob", shared_tokens=4, shared_key="prompt-2")) == 0


def test_a_cache_scope_is_validated_at_construction() -> None:
    with pytest.raises(ValueError, match="shared_tokens"):
        CacheScope(shared_tokens=-1)
    with pytest.raises(ValueError, match="non-empty"):
        CacheScope(private="")


def test_sessions_of_one_salt_share_only_blocks_wholly_inside_the_shared_part() -> None:
    bm, kv = manager(16, 0, 4)
    tokens = list(range(1, 15))  # [1..4] [5..8] [9..12] [13 14]
    alice = CacheScope(private="alice", shared_tokens=6)  # the system prompt ends in block 1
    first = make_seq(tokens, alice)
    assert admit(bm, kv, first, chunk=14)
    alices = list(first.block_table)
    bm.free(first)

    def hit(scope: CacheScope | None) -> int:
        return bm.find_prefix(make_seq(tokens, scope)).num_tokens

    # Block 1 holds two of alice's own tokens: only block 0 is shared with bob.
    assert hit(CacheScope(private="bob", shared_tokens=6)) == 4
    assert hit(alice) == 12
    assert hit(None) == hit(CacheScope()) == 4  # unscoped requests find the shared part only
    assert hit(CacheScope(salt="other", private="alice", shared_tokens=6)) == 0

    bob = make_seq(tokens, CacheScope(private="bob", shared_tokens=6))
    assert admit(bm, kv, bob, chunk=14)
    assert bob.block_table[0] is alices[0]
    assert not set(map(id, bob.block_table[1:])) & set(map(id, alices))
    kv.assert_computed_positions_intact(bob)
    bm.free(bob)
    assert bm.stats().device.cached == 1 + 2 + 2  # the shared block, then two private each
    assert bm.is_idle_balanced()


def test_a_shared_part_ending_on_a_block_boundary_shares_that_whole_block() -> None:
    bm, kv = manager(16, 0, 4)
    tokens = list(range(1, 15))
    first = make_seq(tokens, CacheScope(private="alice", shared_tokens=8))
    assert admit(bm, kv, first, chunk=14)
    bm.free(first)
    assert (
        bm.find_prefix(make_seq(tokens, CacheScope(private="bob", shared_tokens=8))).num_tokens == 8
    )


def test_tenants_with_different_salts_share_nothing() -> None:
    bm, kv = manager(16, 0, 4)
    tokens = list(range(1, 15))
    first = make_seq(tokens, CacheScope(salt="t1"))
    assert admit(bm, kv, first, chunk=14)
    bm.free(first)

    def hit(scope: CacheScope | None) -> int:
        return bm.find_prefix(make_seq(tokens, scope)).num_tokens

    assert hit(CacheScope(salt="t1")) == 12
    assert hit(CacheScope(salt="t1", private="s", shared_tokens=100)) == 12
    assert hit(CacheScope(salt="t2")) == hit(None) == hit(CacheScope(private="s")) == 0


def test_a_fork_keeps_its_parents_scope_for_the_blocks_it_fills() -> None:
    bm, kv = manager(16, 0, 4)
    scope = CacheScope(private="s")
    parent = make_seq([1, 2, 3, 4, 5, 6], scope)
    assert admit(bm, kv, parent, chunk=6)
    child = fork(bm, kv, parent, 1)
    assert child.cache_scope == scope
    assert decode(bm, kv, child, 7) and decode(bm, kv, child, 8)  # fills block 1
    assert child.block_hashes == chain_hashes(child.token_ids, 4, scope)
    assert bm.tier_of(chain_hashes(child.token_ids, 4, scope)[1]) is Tier.DEVICE
    bm.free(parent)
    bm.free(child)
    assert bm.is_idle_balanced()


def test_tier_of_follows_a_hashed_block_between_tiers_until_it_is_dropped() -> None:
    bm, kv = manager(2, 1, 2)
    first = make_seq([1, 2, 3])
    assert admit(bm, kv, first, chunk=3)
    (h,) = hash_blocks(first.token_ids, 2, NAMESPACE)
    assert bm.tier_of(h) is Tier.DEVICE
    bm.free(first)
    second = make_seq([4, 5, 6])
    assert admit(bm, kv, second, chunk=3)  # evicts [1, 2] to the CPU pool
    assert bm.tier_of(h) is Tier.CPU
    bm.free(second)
    third = make_seq([7, 8, 9])
    assert admit(bm, kv, third, chunk=3)  # evicts [4, 5]; the full CPU pool drops [1, 2]
    assert bm.tier_of(h) is None


def test_stats_count_usage_per_tier_and_prefix_queries() -> None:
    bm, kv = manager(4, 2, 2)
    seq = make_seq([1, 2, 3, 4, 5])
    assert admit(bm, kv, seq, chunk=5)
    stats = bm.stats()
    assert (stats.device.total, stats.device.free, stats.device.in_use) == (4, 1, 3)
    assert (stats.cpu.total, stats.cpu.free, stats.cpu.in_use) == (2, 2, 0)
    bm.free(seq)
    stats = bm.stats()
    assert (stats.device.free, stats.device.cached, stats.device.in_use) == (2, 2, 0)
    again = make_seq([1, 2, 3, 4, 5, 6])
    assert admit(bm, kv, again, chunk=6)
    stats = bm.stats()
    assert (stats.prefix_queries, stats.prefix_hits, stats.prefix_cpu_hits) == (11, 4, 0)
    assert bm.num_free_device_blocks == 1


def bump_a_ref_count_by_hand(bm: BlockManager, seq: Sequence) -> None:
    seq.block_table[0].ref_count += 1


def put_a_slot_in_two_places(bm: BlockManager, seq: Sequence) -> None:
    seq.block_table[1].slot = seq.block_table[0].slot


def hold_a_released_block_in_the_table(bm: BlockManager, seq: Sequence) -> None:
    stale = list(seq.block_table)
    bm.free(seq)
    seq.block_table.extend(stale)


@pytest.mark.parametrize(
    ("corrupt", "match"),
    [
        (bump_a_ref_count_by_hand, "ref count"),
        (put_a_slot_in_two_places, "misplaced"),
        (hold_a_released_block_in_the_table, "released"),
    ],
    ids=["ref-count", "slot-in-two-places", "released-block"],
)
def test_check_invariants_catches_a_corrupted_block_table(
    corrupt: Callable[[BlockManager, Sequence], None], match: str
) -> None:
    bm, kv = manager(4, 0, 2)
    seq = make_seq([1, 2, 3])
    assert admit(bm, kv, seq, chunk=3)
    bm.check_invariants([seq])
    corrupt(bm, seq)
    with pytest.raises(KVInvariantError, match=match):
        bm.check_invariants([seq])


@pytest.mark.server
def test_check_invariants_holds_under_python_dash_o() -> None:
    """Raised, not asserted: optimized Python, which drops every assert, still reports a
    leak (the server's exit status depends on it)."""
    script = (
        "from service.engine.blocks import BlockManager, KVInvariantError, PrefixHit\n"
        "from service.engine.params import SamplingParams\n"
        "from service.engine.sequence import Sequence\n"
        "bm = BlockManager(4, 0, 2, namespace='n')\n"
        "seq = Sequence('r', 0, [1, 2, 3], 3, SamplingParams())\n"
        "bm.allocate(seq, PrefixHit(block_size=2), 3)\n"
        "seq.block_table[0].ref_count += 1\n"
        "try:\n"
        "    bm.check_invariants([seq])\n"
        "except KVInvariantError as exc:\n"
        "    print('caught', exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-O", "-c", script], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "caught ref count != holders"


def test_is_idle_balanced_only_once_everything_is_released() -> None:
    bm, kv = manager(4, 2, 2)
    seq = make_seq([1, 2, 3])
    assert admit(bm, kv, seq, chunk=3)
    assert not bm.is_idle_balanced()
    bm.free(seq)
    assert bm.is_idle_balanced()


# ---------------------------------------------------------------------- the stateful property

TOKENS = st.integers(0, 2)  # a tiny alphabet, so prefix hits are frequent
INDEX = st.integers(0, 15)
# A few tenants and sessions; "t|p" as a salt must not meet ("t", "p") as a salt and an id.
SCOPES = st.none() | st.builds(
    CacheScope,
    salt=st.sampled_from(["", "t", "t|p"]),
    private=st.sampled_from([None, "p", "q"]),
    shared_tokens=st.integers(0, 12),
    shared_key=st.sampled_from(["", "", "k", "l"]),
)
CHUNK = st.integers(1, 6)
MAX_LIVE = 6
SAME_SCOPE = "same"  # step_with_twin: the twin is in the running sequence's scope


def pick(seqs: list[Sequence], index: int) -> Sequence:
    return seqs[index % len(seqs)]


class BlockManagerMachine(RuleBasedStateMachine):
    """The engine's use of the manager, at random, against a simulated KV store.

    As in the engine, a running sequence whose tokens are all computed samples its next token
    at once, so a sequence at rest (running, swapped or waiting) has a token to compute.
    """

    def __init__(self) -> None:
        super().__init__()
        self.waiting: list[Sequence] = []  # holding no blocks: new, or preempted to recompute
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        # Conversations so far, with their scopes, to resume later.
        self.histories: list[tuple[list[int], CacheScope | None]] = []
        self.hash_tokens: dict[int, list[int]] = {}  # block hash -> the tokens it covers
        # Block hash -> who may find each block of the chain it ends (`block_owner`).
        self.hash_owners: dict[int, tuple[Owner, ...]] = {}
        self.scopes: dict[int, CacheScope | None] = {}  # seq_id -> the scope it was given
        self.seen: dict[int, Block] = {}  # every block handle that may still hold content

    @property
    def live(self) -> list[Sequence]:
        return self.waiting + self.running + self.swapped

    @initialize(
        block_size=st.integers(1, 4),
        num_device_blocks=st.integers(4, 12),
        num_cpu_blocks=st.integers(0, 8),
        mode=st.sampled_from([AllocationMode.PAGED] * 3 + [AllocationMode.CONTIGUOUS]),
        prefix_caching=st.sampled_from([True, True, True, False]),
        max_model_len=st.integers(2, 12),
        watermark_blocks=st.sampled_from([0, 0, 0, 1]),
    )
    def setup(
        self,
        block_size: int,
        num_device_blocks: int,
        num_cpu_blocks: int,
        mode: AllocationMode,
        prefix_caching: bool,
        max_model_len: int,
        watermark_blocks: int,
    ) -> None:
        if mode is AllocationMode.CONTIGUOUS:
            # Room for about three reservations, so that forks and pressure happen.
            max_model_len = max(2, min(max_model_len, num_device_blocks * block_size // 3))
        else:
            max_model_len = 24
        self.max_len = max_model_len
        self.bm, self.kv = manager(
            num_device_blocks,
            num_cpu_blocks,
            block_size,
            mode=mode,
            max_model_len=max_model_len,
            enable_prefix_caching=prefix_caching,
            watermark_blocks=watermark_blocks,
        )

    # ------------------------------------------------------------------ rules

    @precondition(lambda self: len(self.live) < MAX_LIVE)
    @rule(
        suffix=st.lists(TOKENS, min_size=1, max_size=8),
        index=INDEX,
        resume=st.booleans(),
        scope=SCOPES,
    )
    def new_request(
        self, suffix: list[int], index: int, resume: bool, scope: CacheScope | None
    ) -> None:
        """A new prompt, or a conversation resumed: an earlier one's tokens plus more, in its
        own scope or (another session, tenant, or a mistake) in any other."""
        self.waiting.append(self._new_seq(*self._prompt(suffix, index, resume, scope)))

    @precondition(lambda self: self.waiting)
    @rule(index=INDEX, chunk=CHUNK, token=TOKENS)
    def schedule(self, index: int, chunk: int, token: int) -> None:
        seq = pick(self.waiting, index)
        if admit(self.bm, self.kv, seq, chunk):
            self.waiting.remove(seq)
            self.running.append(seq)
            self._sample(seq, token)

    @precondition(lambda self: self.running)
    @rule(
        indices=st.lists(INDEX, min_size=1, max_size=3),
        chunk=CHUNK,
        tokens=st.lists(TOKENS, min_size=4, max_size=4),
        admit_index=st.none() | INDEX,
    )
    def step(
        self, indices: list[int], chunk: int, tokens: list[int], admit_index: int | None
    ) -> None:
        """One engine step over a few running sequences, perhaps admitting a waiting one."""
        scheduled = list(dict.fromkeys(pick(self.running, i) for i in indices))
        admitted = (
            [pick(self.waiting, admit_index)] if admit_index is not None and self.waiting else []
        )
        self._step(scheduled, admitted, chunk, tokens)

    @precondition(lambda self: self.running and len(self.live) < MAX_LIVE)
    @rule(
        index=INDEX,
        chunk=CHUNK,
        suffix=st.lists(TOKENS, min_size=1, max_size=4),
        tokens=st.lists(TOKENS, min_size=2, max_size=2),
        scope=st.just(SAME_SCOPE) | SCOPES,
    )
    def step_with_twin(
        self,
        index: int,
        chunk: int,
        suffix: list[int],
        tokens: list[int],
        scope: CacheScope | str | None,
    ) -> None:
        """A step that runs a sequence's next chunk and admits a prompt starting with all of
        its tokens (users sharing a system prompt, arriving together): the newcomer shares
        the blocks that chunk fills that its scope may find, which the same forward computes."""
        seq = pick(self.running, index)
        twin_scope = self.scopes[seq.seq_id] if scope == SAME_SCOPE else scope
        assert not isinstance(twin_scope, str)
        twin = self._new_seq((seq.token_ids + suffix)[: self.max_len], twin_scope)
        self.waiting.append(twin)
        self._step([seq], [twin], chunk, tokens)

    @precondition(lambda self: self.running)
    @rule(index=INDEX, token=TOKENS)
    def fill(self, index: int, token: int) -> None:
        """Grow a sequence by the most tokens that fit: accounting errors live at the edge."""
        seq = pick(self.running, index)
        fits = [n for n in range(1, seq.num_uncomputed_tokens + 1) if self.bm.can_append(seq, n)]
        if fits:
            assert extend(self.bm, self.kv, seq, fits[-1])
            self._sample(seq, token)

    @precondition(lambda self: self.running and len(self.live) < MAX_LIVE)
    @rule(index=INDEX, token=TOKENS)
    def fork(self, index: int, token: int) -> None:
        """Another sample of `parent`; it draws its own next token if that one is pending."""
        parent = pick(self.running, index)
        if not self.bm.can_fork(parent):
            return
        child = fork(self.bm, self.kv, parent, parent.sample_index + 1)
        self.scopes[child.seq_id] = self.scopes[parent.seq_id]
        if child.num_uncomputed_tokens == 1 and child.num_output_tokens > 0:
            child.token_ids[-1] = token
        self.running.append(child)

    @precondition(lambda self: self.live)
    @rule(index=INDEX)
    def finish(self, index: int) -> None:
        self._finish(pick(self.live, index))

    @precondition(lambda self: self.running)
    @rule(index=INDEX)
    def swap_out(self, index: int) -> None:
        seq = pick(self.running, index)
        if self.bm.can_swap_out(seq):
            self.bm.swap_out(seq)
            self.kv.run_ops()
            self.running.remove(seq)
            self.swapped.append(seq)

    @precondition(lambda self: self.swapped)
    @rule(index=INDEX, chunk=CHUNK, token=TOKENS)
    def swap_in(self, index: int, chunk: int, token: int) -> None:
        """Resume a swapped sequence with its next chunk, as the scheduler does."""
        seq = pick(self.swapped, index)
        n = min(seq.num_uncomputed_tokens, chunk)
        if not self.bm.can_swap_in(seq, n):
            return
        self.bm.swap_in(seq)
        self.kv.run_ops()
        self.swapped.remove(seq)
        self.running.append(seq)
        if n:
            assert self.bm.can_append(seq, n), "can_swap_in promised room for the next chunk"
            assert extend(self.bm, self.kv, seq, n)
            self._sample(seq, token)

    @precondition(lambda self: self.running or self.swapped)
    @rule(index=INDEX)
    def recompute(self, index: int) -> None:
        """Preemption by recompute: drop the blocks, keep the tokens."""
        seq = pick(self.running + self.swapped, index)
        self._observe(seq)
        self.bm.free(seq)
        self.kv.run_ops()
        seq.num_computed_tokens = 0
        (self.running if seq in self.running else self.swapped).remove(seq)
        self.waiting.append(seq)

    @rule(
        suffix=st.lists(TOKENS, min_size=1, max_size=12),
        index=INDEX,
        resume=st.booleans(),
        scope=SCOPES,
    )
    def pressure(
        self, suffix: list[int], index: int, resume: bool, scope: CacheScope | None
    ) -> None:
        """A one-shot request passes through: it takes what room it can and leaves it cached."""
        seq = self._new_seq(*self._prompt(suffix, index, resume, scope))
        for chunk in range(seq.num_tokens, 0, -1):
            if admit(self.bm, self.kv, seq, chunk):
                self._finish(seq)
                return

    def _step(
        self, scheduled: list[Sequence], admitted: list[Sequence], chunk: int, tokens: list[int]
    ) -> None:
        """As the scheduler and the forward do it: room for the running sequences' chunks,
        then the waiting ones' admission, then every block op, then all the K/V."""
        batch: list[tuple[Sequence, int]] = []
        for seq in scheduled:
            if seq.num_uncomputed_tokens == 0:  # at max length
                self._finish(seq)
                continue
            n = min(seq.num_uncomputed_tokens, chunk)
            blocks_before = len(seq.block_table)
            if self.bm.can_append(seq, n):
                self.bm.append_slots(seq, n)
                batch.append((seq, n))
            if self.bm.mode is AllocationMode.CONTIGUOUS:
                assert len(seq.block_table) == blocks_before, "contiguous mode never grows"
        for seq in admitted:
            n = allocate_prompt(self.bm, seq, chunk)
            if n is not None:
                self.waiting.remove(seq)
                self.running.append(seq)
                batch.append((seq, n))
        self.kv.run_ops()
        # The forward writes every scheduled token's K/V before any attention reads them.
        for seq, n in batch:
            compute(self.kv, seq, n)
        for (seq, _), token in zip(batch, tokens, strict=False):
            self._sample(seq, token)

    def _new_seq(self, token_ids: list[int], scope: CacheScope | None) -> Sequence:
        seq = make_seq(token_ids, scope)
        self.scopes[seq.seq_id] = scope
        return seq

    def _prompt(
        self, suffix: list[int], index: int, resume: bool, scope: CacheScope | None
    ) -> tuple[list[int], CacheScope | None]:
        """`suffix` alone in `scope`, or after a past conversation (in its scope when the
        index is even, in `scope` when odd)."""
        if not (resume and self.histories):
            return suffix[: self.max_len], scope
        prefix, own = self.histories[index % len(self.histories)]
        return (prefix + suffix)[: self.max_len], own if index % 2 == 0 else scope

    def _sample(self, seq: Sequence, token: int) -> None:
        if seq.num_uncomputed_tokens == 0 and seq.num_tokens < self.max_len:
            seq.token_ids.append(token)

    def _finish(self, seq: Sequence) -> None:
        self._observe(seq)
        self.bm.free(seq)
        self.kv.run_ops()
        for queue in (self.waiting, self.running, self.swapped):
            if seq in queue:
                queue.remove(seq)
        self.histories.append((seq.token_ids[: seq.num_computed_tokens], self.scopes[seq.seq_id]))

    def _observe(self, seq: Sequence) -> None:
        """Remember `seq`'s blocks and what its block hashes cover, to check them later."""
        bs, scope = self.bm.block_size, self.scopes[seq.seq_id]
        for i, h in enumerate(chain_hashes(seq.token_ids, bs, scope)):
            self.hash_tokens[h] = seq.token_ids[: (i + 1) * bs]
            # One hash, one chain of owners: a hit never crosses a tenant or a session.
            owners = tuple(block_owner(scope, j, bs) for j in range(i + 1))
            assert self.hash_owners.setdefault(h, owners) == owners, "a hash with two owners"
        for block in seq.block_table:
            self.seen[id(block)] = block

    # ------------------------------------------------------------------ invariants

    @invariant()
    def the_pool_and_every_block_content_are_consistent(self) -> None:
        bm, kv, bs = self.bm, self.kv, self.bm.block_size
        assert not bm.take_ops(), "every op was drained"
        bm.check_invariants(self.live)
        for seq in self.live:
            self._observe(seq)

        for seq in self.waiting:
            assert not seq.block_table
        for seq in self.running + self.swapped:
            if bm.mode is AllocationMode.CONTIGUOUS:
                assert len(seq.block_table) == -(-self.max_len // bs)
            else:
                assert len(seq.block_table) == -(-seq.num_computed_tokens // bs)
            hashes = chain_hashes(seq.token_ids, bs, self.scopes[seq.seq_id])
            assert seq.block_hashes == hashes[: len(seq.block_hashes)]
            for i, block in enumerate(seq.block_table):
                if block.block_hash is not None:
                    assert block.block_hash == seq.block_hashes[i]
            kv.assert_computed_positions_intact(seq)
        for seq in self.running:
            assert all(b.tier is Tier.DEVICE for b in seq.block_table), "running off-device"

        # Every handle that still holds content (in use, or cached under a hash) has a slot
        # of its own, and a cached block holds exactly the K/V of the tokens it is hashed by.
        holders: dict[tuple[Tier, int], Block] = {}
        for key, block in list(self.seen.items()):
            if block.ref_count == 0 and block.block_hash is None:
                del self.seen[key]  # released: its slot means nothing now
                continue
            assert holders.setdefault((block.tier, block.slot), block) is block, "slot shared"
            if block.block_hash is not None:
                tokens = self.hash_tokens[block.block_hash]
                assert kv.read(block) == kv_values(tokens)[-bs:], "cached block content"
                assert bm.tier_of(block.block_hash) is block.tier

        stats = bm.stats()
        for tier, usage in ((Tier.DEVICE, stats.device), (Tier.CPU, stats.cpu)):
            assert usage.free + usage.cached + usage.in_use == usage.total
            in_use = {id(b) for s in self.live for b in s.block_table if b.tier is tier}
            assert usage.in_use == len(in_use)
            cached = sum(
                b.tier is tier and b.ref_count == 0 and b.block_hash is not None
                for b in self.seen.values()
            )
            assert usage.cached == cached
        # Free slots mean nothing: a later read of one must not find the old content.
        kv.poison_all_but(set(holders))

    def teardown(self) -> None:
        if not hasattr(self, "bm"):
            return
        try:
            self.bm.check_invariants(self.live)
        except KVInvariantError:
            return  # a rule or an invariant has already failed: that is the report
        for seq in self.live:
            self.bm.free(seq)
            self.kv.run_ops()
        assert self.bm.is_idle_balanced()
        assert self.bm.stats().device.in_use == self.bm.stats().cpu.in_use == 0


BlockManagerMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=40,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestBlockManagerStateMachine = BlockManagerMachine.TestCase
