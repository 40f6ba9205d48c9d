"""Tests for `service/engine/window_blocks.py`: the window layers' pool releases blocks as the
window passes, prefix hits need the window they end in, and under any sequence of the engine's
calls (a stateful property test) every position a layer still reads holds its own K/V.

The KV store is a miniature of the runner's pools, one per layer group and tier: the "K/V" at
position p is a function of the tokens up to p (`kv_values`, shared with test_blocks.py).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from service.engine.blocks import Block, BlockManager, OpKind
from service.engine.sequence import Sequence
from service.engine.values import Tier
from service.engine.window_blocks import (
    KVGroup,
    LayerGroups,
    PoolSizes,
    WindowedBlockManager,
    WindowTable,
    pool_sizes,
)
from tests.engine.test_blocks import NAMESPACE, POISON, kv_values, make_seq

GEMMA3_270M = (512, 512, 512, 512, 512, None) * 3  # its 18 layers: every 6th global


def windowed(
    window: int, block_size: int, device: int, cpu: int = 0, window_device: int | None = None
) -> WindowedBlockManager:
    groups = LayerGroups.of((window, None))
    assert groups is not None

    def manager(num_device: int) -> BlockManager:
        return BlockManager(num_device, cpu, block_size, namespace=NAMESPACE)

    return WindowedBlockManager(manager(device), manager(window_device or device), groups)


class GroupedKVStore:
    """The runner's pools in miniature: one int per token slot, per (group, tier)."""

    def __init__(self, bm: WindowedBlockManager, device: int, window_device: int, cpu: int):
        bs = bm.block_size
        self.bm = bm
        self.slots = {
            (KVGroup.FULL, Tier.DEVICE): np.full((device, bs), POISON, dtype=np.int64),
            (KVGroup.WINDOW, Tier.DEVICE): np.full((window_device, bs), POISON, dtype=np.int64),
            (KVGroup.FULL, Tier.CPU): np.full((cpu, bs), POISON, dtype=np.int64),
            (KVGroup.WINDOW, Tier.CPU): np.full((cpu, bs), POISON, dtype=np.int64),
        }

    def run_ops(self) -> None:
        for op in self.bm.take_ops():
            group = KVGroup(op.group)
            device, cpu = self.slots[group, Tier.DEVICE], self.slots[group, Tier.CPU]
            if op.kind is OpKind.SWAP_OUT:
                cpu[op.dst] = device[op.src]
            elif op.kind is OpKind.SWAP_IN:
                device[op.dst] = cpu[op.src]
            else:
                assert op.kind is OpKind.COPY, "no third tier with window pools"
                device[op.dst] = device[op.src]

    def compute(self, seq: Sequence, n: int) -> None:
        """The forward: both groups' K/V of the `n` scheduled tokens."""
        bs, start = self.bm.block_size, seq.num_computed_tokens
        values = kv_values(seq.token_ids[: start + n])
        for group, table in (
            (KVGroup.FULL, seq.block_table),
            (KVGroup.WINDOW, seq.window_block_table),
        ):
            for pos in range(start, start + n):
                block = table[pos // bs]
                assert block is not None, "a scheduled position's block was passed"
                assert block.tier is Tier.DEVICE
                self.slots[group, Tier.DEVICE][block.slot, pos % bs] = values[pos]
        seq.num_computed_tokens += n

    def read(self, group: KVGroup, block: Block, offset: int) -> int:
        return int(self.slots[group, block.tier][block.slot, offset])

    def assert_readable(self, seq: Sequence, window: int) -> None:
        """Every computed position for the full layers, and for the window layers every one
        the next token's window sees, reads back its own K/V."""
        bs, computed = self.bm.block_size, seq.num_computed_tokens
        expected = kv_values(seq.token_ids[:computed])
        for pos in range(computed):
            block = seq.block_table[pos // bs]
            assert block is not None and self.read(KVGroup.FULL, block, pos % bs) == expected[pos]
        for pos in range(max(0, computed - window + 1), computed):
            block = seq.window_block_table[pos // bs]
            assert block is not None, f"position {pos} is still in the window"
            assert self.read(KVGroup.WINDOW, block, pos % bs) == expected[pos]


def admit(bm: WindowedBlockManager, seq: Sequence, chunk: int) -> int | None:
    hit = bm.find_prefix(seq)
    n = min(seq.num_tokens - hit.num_tokens, chunk)
    if not bm.can_allocate(seq, hit, n):
        return None
    bm.allocate(seq, hit, n)
    return n


def prefill(
    bm: WindowedBlockManager,
    kv: GroupedKVStore,
    seq: Sequence,
    chunk: int,
    after_step: Callable[[], None] = lambda: None,
) -> None:
    """Admit `seq` and compute its prompt `chunk` tokens a step, as the scheduler would."""
    n = admit(bm, seq, chunk)
    assert n == min(chunk, seq.num_tokens)
    kv.run_ops()
    kv.compute(seq, n)
    while seq.num_uncomputed_tokens:
        n = min(chunk, seq.num_uncomputed_tokens)
        assert bm.can_append(seq, n)
        bm.append_slots(seq, n)
        kv.run_ops()
        kv.compute(seq, n)
        after_step()


def held(table: list[Block | None]) -> int:
    return sum(b is not None for b in table)


# ---------------------------------------------------------------------- behaviours


def test_layer_groups_split_gemma3_and_leave_all_windowed_or_all_full_models_whole() -> None:
    groups = LayerGroups.of(GEMMA3_270M)
    assert groups is not None
    assert groups.full == (5, 11, 17) and len(groups.window) == 15 and groups.window_size == 512
    assert groups.group_of(11) == (KVGroup.FULL, 1) and groups.group_of(12) == (KVGroup.WINDOW, 10)
    assert LayerGroups.of((4096,) * 32) is None  # Mistral: every layer windowed
    assert LayerGroups.of((None,) * 30) is None


def test_window_blocks_are_released_as_the_window_passes_and_full_blocks_are_kept() -> None:
    bm = windowed(window=8, block_size=4, device=32)
    kv = GroupedKVStore(bm, 32, 32, 0)
    seq = make_seq(list(range(100, 160)))  # 60 tokens

    def check() -> None:
        kv.assert_readable(seq, window=8)
        # The step from position p released every block before p - 7: 3 blocks stay at most.
        assert held(seq.window_block_table) <= 3

    prefill(bm, kv, seq, 4, check)
    assert held(seq.block_table) == 15 and len(seq.window_block_table) == 15
    bm.check_invariants([seq])
    bm.free(seq)
    assert bm.is_idle_balanced()


def test_a_prefix_hit_needs_the_window_blocks_its_end_still_sees() -> None:
    """The window pool (4 blocks) keeps only the last window of a finished prompt: a prompt
    sharing all of it hits all of it, but one that diverges earlier hits only up to where
    the window blocks it would need are still cached, i.e. nothing in the middle."""
    bm = windowed(window=8, block_size=4, device=32, window_device=4)
    kv = GroupedKVStore(bm, 32, 4, 0)
    first = make_seq(list(range(40)))
    prefill(bm, kv, first, 4)
    bm.free(first)
    same = make_seq([*range(40), 99])
    hit = bm.find_prefix(same)
    assert hit.num_tokens == 40 and hit.window is not None
    assert hit.window.passed == (40 - 8 + 1) // 4  # blocks 0..7 are not needed
    diverging = make_seq([*range(20), 77, 78, 79])
    assert bm.find_prefix(diverging).num_tokens == 0, "blocks 3-4's window copies are gone"
    bm.check_invariants([])
    assert bm.is_idle_balanced()


def test_a_forked_sample_shares_both_groups_and_copies_the_partial_blocks_on_write() -> None:
    bm = windowed(window=6, block_size=4, device=16, cpu=8)
    kv = GroupedKVStore(bm, 16, 16, 8)
    parent = make_seq(list(range(10)))
    assert admit(bm, parent, 10) == 10
    kv.run_ops()
    kv.compute(parent, 10)
    parent.token_ids.append(50)
    child = parent.fork(1, None)
    bm.fork(parent, child)
    child.token_ids[-1] = 51
    for seq in (parent, child):
        bm.append_slots(seq, 1)
    kv.run_ops()
    for seq in (parent, child):
        kv.compute(seq, 1)
        kv.assert_readable(seq, window=6)
    assert parent.window_block_table[2] is not child.window_block_table[2]
    bm.check_invariants([parent, child])
    bm.swap_out(child)
    kv.run_ops()
    bm.swap_in(child)
    kv.run_ops()
    kv.assert_readable(child, window=6)
    for seq in (parent, child):
        bm.free(seq)
    assert bm.is_idle_balanced()


def test_pool_sizes_keep_equal_counts_until_the_window_pool_is_plenty() -> None:
    groups = LayerGroups.of(GEMMA3_270M)
    layer = 16 * 256 * 2 * 2  # a 16-token block of one layer: 1 head of 256, K and V, fp16
    kwargs = dict(layer_bytes=layer, num_layers=18, groups=groups, block_size=16)
    small = pool_sizes(
        **kwargs, device_bytes=512 << 20, cpu_bytes=0, max_num_seqs=64, max_num_batched_tokens=512
    )
    assert small == PoolSizes(1820, 0, 1820, 0)  # 64 windows twice over do not fit: as one pool
    big = pool_sizes(
        **kwargs, device_bytes=4 << 30, cpu_bytes=0, max_num_seqs=8, max_num_batched_tokens=512
    )
    window = 2 * 8 * (32 + 1 + 1) + 32
    assert big.window_device == window
    assert big.device == ((4 << 30) - window * 15 * layer) // (3 * layer)
    assert big.device * 3 * layer + big.window_device * 15 * layer <= 4 << 30
    assert pool_sizes(
        **kwargs | {"groups": None},
        device_bytes=4 << 30,
        cpu_bytes=0,
        max_num_seqs=8,
        max_num_batched_tokens=512,
    ) == PoolSizes(14563, 0)


# ---------------------------------------------------------------------- the state machine

INDEX = st.integers(0, 1 << 16)
TOKENS = st.integers(0, 3)  # few token values: prompts repeat, so prefixes are shared


class WindowedManagerMachine(RuleBasedStateMachine):
    """The engine's calls at random: admit (with prefix hits), steps of a chunk, forks,
    swaps, recompute preemption and finishing, on small pools and windows."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.histories: list[list[int]] = []

    @property
    def live(self) -> list[Sequence]:
        return self.waiting + self.running + self.swapped

    @initialize(
        block_size=st.integers(1, 4),
        window=st.integers(1, 9),
        device=st.integers(6, 16),
        window_device=st.integers(4, 16),
        cpu=st.integers(0, 8),
    )
    def setup(self, block_size: int, window: int, device: int, window_device: int, cpu: int):
        self.window = window
        self.bm = windowed(window, block_size, device, cpu, window_device)
        self.kv = GroupedKVStore(self.bm, device, window_device, cpu)

    @precondition(lambda self: len(self.live) < 5)
    @rule(suffix=st.lists(TOKENS, min_size=1, max_size=10), index=INDEX, resume=st.booleans())
    def new_request(self, suffix: list[int], index: int, resume: bool) -> None:
        prefix = self.histories[index % len(self.histories)] if resume and self.histories else []
        self.waiting.append(make_seq((prefix + suffix)[:40]))

    @precondition(lambda self: self.waiting)
    @rule(index=INDEX, chunk=st.integers(1, 8), token=TOKENS)
    def admit(self, index: int, chunk: int, token: int) -> None:
        seq = self.waiting[index % len(self.waiting)]
        n = admit(self.bm, seq, chunk)
        if n is None:
            return
        self.kv.run_ops()
        self.kv.compute(seq, n)
        self.waiting.remove(seq)
        self.running.append(seq)
        self._sample(seq, token)

    @precondition(lambda self: self.running)
    @rule(index=INDEX, chunk=st.integers(1, 8), token=TOKENS)
    def step(self, index: int, chunk: int, token: int) -> None:
        seq = self.running[index % len(self.running)]
        n = min(chunk, seq.num_uncomputed_tokens)
        if n == 0 or not self.bm.can_append(seq, n):
            return
        self.bm.append_slots(seq, n)
        self.kv.run_ops()
        self.kv.compute(seq, n)
        self._sample(seq, token)

    @precondition(lambda self: self.running and len(self.live) < 5)
    @rule(index=INDEX, token=TOKENS)
    def fork(self, index: int, token: int) -> None:
        parent = self.running[index % len(self.running)]
        child = parent.fork(parent.sample_index + 1, None)
        self.bm.fork(parent, child)
        if child.num_uncomputed_tokens == 1 and child.num_output_tokens > 0:
            child.token_ids[-1] = token
        self.running.append(child)

    @precondition(lambda self: self.running)
    @rule(index=INDEX)
    def swap_out(self, index: int) -> None:
        seq = self.running[index % len(self.running)]
        if self.bm.can_swap_out(seq):
            self.bm.swap_out(seq)
            self.kv.run_ops()
            self.running.remove(seq)
            self.swapped.append(seq)

    @precondition(lambda self: self.swapped)
    @rule(index=INDEX)
    def swap_in(self, index: int) -> None:
        seq = self.swapped[index % len(self.swapped)]
        if self.bm.can_swap_in(seq, 1):
            self.bm.swap_in(seq)
            self.kv.run_ops()
            self.swapped.remove(seq)
            self.running.append(seq)

    @precondition(lambda self: self.running or self.swapped)
    @rule(index=INDEX)
    def recompute(self, index: int) -> None:
        seq = (self.running + self.swapped)[index % len(self.running + self.swapped)]
        self.bm.free(seq)
        self.kv.run_ops()
        seq.num_computed_tokens = 0
        (self.running if seq in self.running else self.swapped).remove(seq)
        self.waiting.append(seq)

    @precondition(lambda self: self.live)
    @rule(index=INDEX)
    def finish(self, index: int) -> None:
        seq = self.live[index % len(self.live)]
        self.bm.free(seq)
        self.kv.run_ops()
        for queue in (self.waiting, self.running, self.swapped):
            if seq in queue:
                queue.remove(seq)
        self.histories.append(seq.token_ids[: seq.num_computed_tokens])

    def _sample(self, seq: Sequence, token: int) -> None:
        if seq.num_uncomputed_tokens == 0 and seq.num_tokens < 40:
            seq.token_ids.append(token)

    @invariant()
    def every_position_a_layer_reads_holds_its_own_kv(self) -> None:
        self.bm.check_invariants(self.live)
        bs = self.bm.block_size
        for seq in self.waiting:
            assert not seq.block_table and not seq.window_block_table
        for seq in self.running + self.swapped:
            assert len(seq.block_table) == len(seq.window_block_table)
            assert len(seq.block_table) == -(-seq.num_computed_tokens // bs)
            self.kv.assert_readable(seq, self.window)
            # Held: what the last step's first row saw, and the blocks that step filled.
            assert held(seq.window_block_table) <= self.bm.groups.blocks_seen(bs) + 8 // bs + 2
        if not self.live:
            assert self.bm.is_idle_balanced()


TestWindowedManagerMachine = WindowedManagerMachine.TestCase
TestWindowedManagerMachine.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_a_window_table_is_the_sequences_window_half() -> None:
    seq = make_seq([1, 2, 3])
    table = WindowTable(seq)
    table.num_registered_blocks = 2
    table.num_computed_tokens = 1
    assert seq.num_window_registered_blocks == 2 and seq.num_computed_tokens == 1
    assert table.block_table is seq.window_block_table and table.block_hashes is seq.block_hashes
    with pytest.raises(AttributeError):
        table.block_table = []  # type: ignore[misc]
