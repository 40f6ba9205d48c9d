"""The block manager: who holds which KV block, on which tier, under which content hash.

Pure Python and device-free: it hands out physical block ids and records the block moves the
runner must perform (`BlockOp`s, drained once per step); the runner owns the tensors.

A `Block` is a handle to one block's worth of KV content. It lives in exactly one tier at a
time (the device pool or the CPU pool) at a physical `slot`; moving it between tiers changes
its tier and slot, and every sequence holding the handle sees the move.

NOTE (states of a block):
  in use   ref_count > 0, listed in some sequences' block tables;
  cached   ref_count == 0 with a content hash, on its tier's LRU list, reusable by a prefix hit;
  free     no handle: the slot is on its tier's free list and its contents mean nothing.
NOTE (what a hash covers): blake2b over (parent block's hash, the block's token ids, the
  namespace); the namespace names the model and, where tenants must not share, a cache salt,
  and a request's `CacheScope` may narrow it block by block (the NOTE at `CacheScope`).
  Only full blocks are hashed. A block is registered under its hash when the step that
  fills it is scheduled (`allocate`, `append_slots`), before its K/V exist: the forward
  writes each layer's K/V for the whole batch before any of that layer's attention reads, so
  a prompt admitted later in the same step may share the block and read it in that forward.
  Between steps, every registered block's K/V are computed.
NOTE (eviction order): a device slot is taken from the free list first; failing that, the
  least recently released cached block is moved to the CPU pool (block by block, not the
  whole sequence) and its slot reused. The CPU pool takes its own free slots first, then drops
  its least recently used cached block. Blocks in use are never evicted. With `save_evicted`
  (a third tier, service/engine/kvtier), a dropped block is first saved: a SAVE op, issued
  before the op that reuses its slot, hands its K/V to the tier. The manager never asks the
  tier anything: its scheduler side drops the SAVE ops of blocks it holds already.
NOTE (blocks from the third tier): `allocate` may take, after the prefix hit, a run of
  blocks the tier returned (`loaded`): each gets a fresh device slot, a LOAD op copying its
  K/V there from the step's staged rows (in the order issued), and counts as computed. They
  are registered under their hashes like blocks the step computes.
NOTE (copy-on-write): sequences forked from one another share every block, the partial last
  one included. Writes only ever land at positions >= num_computed_tokens, so the only block a
  write can hit while shared is that partial last block: it is copied first.
NOTE (op order): ops must run in the order issued. A slot freed by one op may be the target
  of a later op in the same step.
NOTE (passed blocks): a table entry may be None: a block its sequence no longer reads, released
  early (`release_leading`; the sliding-window layers' group, service/engine/window_blocks.py).
  Every walk over a table skips those entries; positions keep their indices.
"""

from __future__ import annotations

import enum
import hashlib
import sys
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from service.engine.config import AllocationMode
from service.engine.values import (
    BlockStats,
    CacheScope,
    KVInvariantError,
    PoolUsage,
    SlotState,
    Tier,
)


class OpKind(enum.Enum):
    SWAP_OUT = "swap_out"  # device slot -> CPU slot
    SWAP_IN = "swap_in"  # CPU slot -> device slot
    COPY = "copy"  # device slot -> device slot (copy-on-write)
    SAVE_CPU = "save_cpu"  # CPU slot -> the third tier (the block is being dropped)
    SAVE_DEVICE = "save_device"  # device slot -> the third tier (no CPU room to move it to)
    LOAD = "load"  # staged row `src` (from the third tier) -> device slot


SAVE_KINDS = (OpKind.SAVE_CPU, OpKind.SAVE_DEVICE)


@dataclass(slots=True, frozen=True)
class BlockOp:
    kind: OpKind
    src: int
    dst: int  # -1 for SAVE ops: they write no slot
    block_hash: int | None = None  # SAVE ops: the key the tier stores the block under
    group: int = 0  # the layer group whose pools the op moves (KVGroup)


@dataclass(slots=True, eq=False)
class Block:
    tier: Tier
    slot: int
    ref_count: int = 0
    block_hash: int | None = None


@dataclass(slots=True, frozen=True)
class PrefixHit:
    """The cached full blocks at the start of a prompt, in order.

    NOTE: where the blocks were found is counted at lookup: `allocate` swaps the CPU ones in,
    after which every block says DEVICE, and usage reports read the hit after allocation.

    A model with sliding-window layers finds a hit per layer group (service/engine/
    window_blocks.py): `window` is the window group's part, whose first `passed` blocks the
    window no longer sees and which are not held (`blocks` holds the rest).
    """

    blocks: tuple[Block, ...] = ()
    block_size: int = 0
    num_cpu_blocks: int = 0
    passed: int = 0
    window: PrefixHit | None = None

    @property
    def num_tokens(self) -> int:
        return (self.passed + len(self.blocks)) * self.block_size

    @property
    def num_device_tokens(self) -> int:
        return (len(self.blocks) - self.num_cpu_blocks) * self.block_size

    @property
    def num_cpu_tokens(self) -> int:
        return self.num_cpu_blocks * self.block_size


def _held(table: Iterable[Block | None]) -> Iterable[Block]:
    """A table's entries that hold a block (the NOTE on passed blocks)."""
    return (block for block in table if block is not None)


def _check(holds: bool, what: str) -> None:
    if not holds:
        raise KVInvariantError(what)


def hash_block(parent: int | None, token_ids: Iterable[int], namespace: str) -> int:
    """Reproducible across processes, restarts and hosts (stored in Redis page maps).

    Fields are length-prefixed and little-endian, so no two inputs share a byte string: a
    root block (no parent) differs from a child of a block that hashed to 0.
    """
    tokens = array("q", token_ids)
    if sys.byteorder == "big":
        tokens.byteswap()
    ns = namespace.encode()
    h = hashlib.blake2b(digest_size=8, person=b"pagechat-kv-v1")
    h.update(b"\x00" if parent is None else b"\x01" + parent.to_bytes(8, "little"))
    h.update(len(tokens).to_bytes(4, "little") + tokens.tobytes())
    h.update(len(ns).to_bytes(4, "little") + ns)
    return int.from_bytes(h.digest(), "little")


def block_namespace(
    namespace: str, scope: CacheScope | None, block_index: int, block_size: int
) -> str:
    """The namespace block `block_index` of a request in `scope` is hashed in."""
    if scope is None:
        return namespace
    if scope.salt:
        namespace += f"|salt:{len(scope.salt)}:{scope.salt}"
    if scope.private is None:
        return namespace
    if (block_index + 1) * block_size <= scope.shared_tokens:
        key = scope.shared_key
        return f"{namespace}|shared:{len(key)}:{key}" if key else namespace
    return f"{namespace}|private:{len(scope.private)}:{scope.private}"


def hash_blocks(
    token_ids: list[int], block_size: int, namespace: str, scope: CacheScope | None = None
) -> list[int]:
    """The chain hashes of every full block of `token_ids` (what a page map stores)."""
    hashes: list[int] = []
    for i in range(len(token_ids) // block_size):
        parent = hashes[-1] if hashes else None
        ns = block_namespace(namespace, scope, i, block_size)
        hashes.append(hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], ns))
    return hashes


class PagedSequence(Protocol):
    """A sequence as the block manager sees it (service.engine.sequence.Sequence): its
    tokens, how many have K/V, and the block table and hashes it keeps for the manager."""

    num_computed_tokens: int
    num_registered_blocks: int

    @property
    def token_ids(self) -> list[int]: ...

    @property
    def cache_scope(self) -> CacheScope | None: ...

    @property
    def block_table(self) -> list[Block | None]: ...  # None: released early (passed blocks)

    @property
    def block_hashes(self) -> list[int]: ...

    @property
    def num_tokens(self) -> int: ...


@dataclass(slots=True)
class _Counters:
    prefix_queries: int = 0
    prefix_hits: int = 0
    prefix_cpu_hits: int = 0
    prefix_tier_hits: int = 0
    swapped_out: int = 0
    swapped_in: int = 0
    copied: int = 0
    dropped: int = 0


@dataclass(slots=True)
class _TierPool:
    """One tier's slots. `cached` is keyed by block hash, least recently released first."""

    tier: Tier
    total: int
    free: deque[int] = field(default_factory=deque)
    cached: OrderedDict[int, Block] = field(default_factory=OrderedDict)
    # Every handle on this tier, in use or cached, by slot.
    held: dict[int, Block] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.free.extend(range(self.total))

    @property
    def available(self) -> int:
        return len(self.free) + len(self.cached)

    def usage(self) -> PoolUsage:
        cached = len(self.cached)
        return PoolUsage(self.total, len(self.free), cached, len(self.held) - cached)


class BlockManager:
    def __init__(
        self,
        num_device_blocks: int,
        num_cpu_blocks: int,
        block_size: int,
        *,
        namespace: str,
        enable_prefix_caching: bool = True,
        mode: AllocationMode = AllocationMode.PAGED,
        max_model_len: int = 0,
        watermark_blocks: int = 0,
        save_evicted: bool = False,
    ) -> None:
        if num_device_blocks < 1 or num_cpu_blocks < 0 or block_size < 1:
            raise ValueError("need >= 1 device block, >= 0 CPU blocks and block_size >= 1")
        if mode is AllocationMode.CONTIGUOUS and max_model_len < 1:
            raise ValueError("contiguous mode needs max_model_len")
        self.block_size = block_size
        self.namespace = namespace
        self.mode = mode
        # Reserving max_model_len up front leaves nothing to share or cache.
        self.enable_prefix_caching = enable_prefix_caching and mode is AllocationMode.PAGED
        self.max_model_len = max_model_len
        self.watermark_blocks = watermark_blocks
        self.save_evicted = save_evicted  # issue SAVE ops for blocks about to be dropped
        self._device = _TierPool(Tier.DEVICE, num_device_blocks)
        self._cpu = _TierPool(Tier.CPU, num_cpu_blocks)
        self._by_hash: dict[int, Block] = {}
        self._ops: list[BlockOp] = []
        self._num_loaded_rows = 0  # LOAD ops issued since the last take_ops
        self._counters = _Counters()

    # ------------------------------------------------------------------ admission

    def find_prefix(self, seq: PagedSequence) -> PrefixHit:
        """Longest run of cached full blocks at the start of `seq` (no state changes).

        At least one token is left uncached: its logits are needed to sample the next token.
        """
        if not self.enable_prefix_caching:
            return PrefixHit(block_size=self.block_size)
        max_blocks = (seq.num_tokens - 1) // self.block_size
        self._extend_hashes(seq, max_blocks)
        hits: list[Block] = []
        for h in seq.block_hashes[:max_blocks]:
            block = self._by_hash.get(h)
            if block is None:
                break
            hits.append(block)
        num_cpu = sum(b.tier is Tier.CPU for b in hits)
        return PrefixHit(tuple(hits), self.block_size, num_cpu)

    def can_allocate(
        self,
        seq: PagedSequence,
        hit: PrefixHit,
        num_new_tokens: int,
        num_loaded: int = 0,
    ) -> bool:
        """Whether `seq` (holding no blocks) can take its prefix hit, `num_loaded` blocks from
        the third tier after it, and its first chunk."""
        assert not seq.block_table, "can_allocate is for sequences holding no blocks"
        loaded_tokens = num_loaded * self.block_size
        end = hit.num_tokens + loaded_tokens + num_new_tokens
        needed = self._blocks_to_cover(end) - hit.passed
        device_hits = [b for b in hit.blocks if b.tier is Tier.DEVICE]
        # Claiming a cached device hit takes it off the evictable list.
        evictable_hits = sum(b.ref_count == 0 for b in device_hits)
        available = self._device.available - evictable_hits - self.watermark_blocks
        return needed - len(device_hits) <= available

    def allocate(
        self,
        seq: PagedSequence,
        hit: PrefixHit,
        num_new_tokens: int,
        *,
        loaded: list[int] | tuple[int, ...] = (),
        count_lookup: bool = True,
    ) -> None:
        """Give `seq` its prefix hit, then the blocks `loaded` from the third tier (their
        hashes: the blocks right after the hit), and the blocks for its first `num_new_tokens`
        tokens. A hit's `passed` positions are left None in the table.

        `count_lookup=False` keeps the lookup out of the prefix-cache statistics (the engine's
        own prefill-only requests, tail prefills, are not user traffic).
        """
        assert self.can_allocate(seq, hit, num_new_tokens, len(loaded))
        assert not (loaded and hit.passed), "the third tier loads only into whole tables"
        assert list(loaded) == seq.block_hashes[len(hit.blocks) : len(hit.blocks) + len(loaded)]
        # Claim every hit before taking any slot: swapping one CPU hit in may evict a device
        # block to the CPU pool, whose LRU victim must not be a hit not yet claimed.
        for block in hit.blocks:
            self._acquire(block)
        for block in hit.blocks:
            if block.tier is Tier.CPU:
                self._move_to_device(block)
        seq.block_table.extend([None] * hit.passed)
        seq.block_table.extend(hit.blocks)
        for _ in loaded:
            block = Block(Tier.DEVICE, self._take_slot(self._device), ref_count=1)
            self._device.held[block.slot] = block
            self._ops.append(BlockOp(OpKind.LOAD, self._num_loaded_rows, block.slot))
            self._num_loaded_rows += 1
            seq.block_table.append(block)
        computed = hit.num_tokens + len(loaded) * self.block_size
        seq.num_computed_tokens = computed
        seq.num_registered_blocks = hit.passed + len(hit.blocks)
        if count_lookup:
            self._counters.prefix_queries += seq.num_tokens
            self._counters.prefix_hits += hit.num_device_tokens
            self._counters.prefix_cpu_hits += hit.num_cpu_tokens
            self._counters.prefix_tier_hits += len(loaded) * self.block_size
        self._grow(seq, computed + num_new_tokens)
        self._register_full_blocks(seq, computed + num_new_tokens)

    # ------------------------------------------------------------------ growth

    def can_append(self, seq: PagedSequence, num_new_tokens: int) -> bool:
        return self._blocks_needed_to_append(seq, num_new_tokens) <= self._device.available

    def append_slots(self, seq: PagedSequence, num_new_tokens: int) -> None:
        """Make room for tokens [num_computed, num_computed + num_new_tokens) of `seq`."""
        assert self.can_append(seq, num_new_tokens)
        if seq.num_computed_tokens % self.block_size:
            last = seq.block_table[seq.num_computed_tokens // self.block_size]
            assert last is not None, "a partial block is never passed"
            if last.ref_count > 1:
                self._copy_on_write(seq, seq.num_computed_tokens // self.block_size)
        end = seq.num_computed_tokens + num_new_tokens
        self._grow(seq, end)
        self._register_full_blocks(seq, end)

    def fork(self, parent: PagedSequence, child: PagedSequence) -> None:
        """`child` shares all of `parent`'s blocks (paged); contiguous mode copies them."""
        assert not child.block_table
        if self.mode is AllocationMode.PAGED:
            for block in _held(parent.block_table):
                block.ref_count += 1
            child.block_table.extend(parent.block_table)
            return
        self._grow(child, self.max_model_len)
        used = -(-parent.num_computed_tokens // self.block_size)  # not the whole reservation
        for src, dst in zip(parent.block_table[:used], child.block_table, strict=False):
            assert src is not None and dst is not None, "contiguous tables pass no blocks"
            self._ops.append(BlockOp(OpKind.COPY, src.slot, dst.slot))
            self._counters.copied += 1

    def can_fork(self, parent: PagedSequence) -> bool:
        if self.mode is AllocationMode.PAGED:
            return True
        return self._blocks_to_cover(self.max_model_len) <= self._device.available

    # ------------------------------------------------------------------ release

    def free(self, seq: PagedSequence) -> None:
        """Release all of `seq`'s blocks. Hashed blocks stay cached until their room is needed."""
        # Reverse order: a prompt's tail is evicted before its head, which other prompts share.
        for block in reversed(seq.block_table):
            if block is not None:
                self._release(block)
        seq.block_table.clear()
        seq.num_registered_blocks = 0

    def release_leading(self, seq: PagedSequence, num_blocks: int) -> None:
        """Release the table's first `num_blocks` entries, which `seq` reads no more; their
        positions stay, as None (the NOTE on passed blocks). Hashed ones stay cached."""
        table = seq.block_table
        for i in range(min(num_blocks, len(table))):
            block = table[i]
            if block is not None:
                self._release(block)
                table[i] = None

    # ------------------------------------------------------------------ preemption by swap

    def can_swap_out(self, seq: PagedSequence) -> bool:
        private = sum(b.ref_count == 1 and b.tier is Tier.DEVICE for b in _held(seq.block_table))
        return private <= self._cpu.available

    def swap_out(self, seq: PagedSequence) -> None:
        """Move `seq`'s private blocks to the CPU pool; blocks it shares stay on the device."""
        assert self.can_swap_out(seq)
        for block in _held(seq.block_table):
            if block.ref_count == 1 and block.tier is Tier.DEVICE:
                self._move_to_cpu(block)

    def can_swap_in(self, seq: PagedSequence, num_new_tokens: int) -> bool:
        on_cpu = sum(b.tier is Tier.CPU for b in _held(seq.block_table))
        return on_cpu + self._blocks_needed_to_append(seq, num_new_tokens) <= (
            self._device.available
        )

    def swap_in(self, seq: PagedSequence) -> None:
        for block in _held(seq.block_table):
            if block.tier is Tier.CPU:
                self._move_to_device(block)

    # ------------------------------------------------------------------ per step

    def take_ops(self) -> list[BlockOp]:
        """The block moves issued since the last call, in the order they must run."""
        ops, self._ops = self._ops, []
        self._num_loaded_rows = 0
        return ops

    def stats(self) -> BlockStats:
        c = self._counters
        return BlockStats(
            device=self._device.usage(),
            cpu=self._cpu.usage(),
            prefix_queries=c.prefix_queries,
            prefix_hits=c.prefix_hits,
            prefix_cpu_hits=c.prefix_cpu_hits,
            prefix_tier_hits=c.prefix_tier_hits,
            blocks_swapped_out=c.swapped_out,
            blocks_swapped_in=c.swapped_in,
            blocks_copied=c.copied,
            blocks_dropped=c.dropped,
        )

    def slot_states(self, tier: Tier) -> list[SlotState]:
        """The state of every slot of `tier`, indexed by slot."""
        pool = self._pool(tier)
        states = [SlotState.FREE] * pool.total
        for slot, block in pool.held.items():
            if block.ref_count == 0:
                states[slot] = SlotState.CACHED
            else:
                states[slot] = SlotState.IN_USE if block.ref_count == 1 else SlotState.SHARED
        return states

    def cached_blocks(self, hashes: Iterable[int]) -> list[Block] | None:
        """The blocks under every one of `hashes`, on either tier; None if one is missing."""
        blocks = []
        for h in hashes:
            block = self._by_hash.get(h)
            if block is None:
                return None
            blocks.append(block)
        return blocks

    def tier_of(self, block_hash: int) -> Tier | None:
        """Where the block with this content hash is now, if it is anywhere."""
        block = self._by_hash.get(block_hash)
        return None if block is None else block.tier

    @property
    def num_free_device_blocks(self) -> int:
        """Slots a new allocation could take now (free, or cached and evictable)."""
        return self._device.available

    def is_idle_balanced(self) -> bool:
        """True when nothing is in use: every slot of both tiers is free or cached."""
        self.check_invariants()
        return all(len(p.held) == len(p.cached) for p in (self._device, self._cpu))

    def check_invariants(self, live: Iterable[PagedSequence] | None = None) -> None:
        """Raise KVInvariantError if the pool's accounting is off.

        free + cached + in use == total on each tier; a slot is in one place only; ref counts
        equal the number of table entries across `live` (when given) and are never negative.
        Raised, not asserted: `python -O` must not turn the check into a silent pass.
        """
        for pool in (self._device, self._cpu):
            free = set(pool.free)
            _check(len(free) == len(pool.free), f"{pool.tier}: slot freed twice")
            _check(not free & pool.held.keys(), f"{pool.tier}: a free slot is also held")
            _check(len(free) + len(pool.held) == pool.total, f"{pool.tier}: slots leaked")
            for slot, block in pool.held.items():
                _check(block.slot == slot and block.tier is pool.tier, "handle misplaced")
                _check(block.ref_count >= 0, "negative ref count")
                if block.ref_count == 0:
                    _check(block.block_hash is not None, "unhashed block with no holder")
                    cached = block.block_hash is not None and pool.cached.get(block.block_hash)
                    _check(cached is block, "idle block not cached")
            for h, block in pool.cached.items():
                _check(block.ref_count == 0 and block.block_hash == h, "cached entry stale")
                _check(pool.held.get(block.slot) is block, "cached block not held")
        for h, block in self._by_hash.items():
            _check(block.block_hash == h, "hash index stale")
            pool = self._pool(block.tier)
            _check(pool.held.get(block.slot) is block, "hashed block not held")
        if live is not None:
            refs: dict[int, int] = {}
            for seq in live:
                for block in _held(seq.block_table):
                    refs[id(block)] = refs.get(id(block), 0) + 1
                    held = self._pool(block.tier).held.get(block.slot)
                    _check(held is block, "a table lists a released or misplaced block")
            for pool in (self._device, self._cpu):
                for block in pool.held.values():
                    _check(block.ref_count == refs.get(id(block), 0), "ref count != holders")

    # ------------------------------------------------------------------ internals

    def _pool(self, tier: Tier) -> _TierPool:
        return self._device if tier is Tier.DEVICE else self._cpu

    def _blocks_to_cover(self, num_tokens: int) -> int:
        if self.mode is AllocationMode.CONTIGUOUS:
            num_tokens = max(num_tokens, self.max_model_len)
        return -(-num_tokens // self.block_size)

    def _blocks_needed_to_append(self, seq: PagedSequence, num_new_tokens: int) -> int:
        end = seq.num_computed_tokens + num_new_tokens
        needed = max(0, self._blocks_to_cover(end) - len(seq.block_table))
        start = seq.num_computed_tokens
        if start % self.block_size:
            last = seq.block_table[start // self.block_size]
            assert last is not None, "a partial block is never passed"
            needed += last.ref_count > 1
        return needed

    def _grow(self, seq: PagedSequence, num_tokens: int) -> None:
        for _ in range(self._blocks_to_cover(num_tokens) - len(seq.block_table)):
            block = Block(Tier.DEVICE, self._take_slot(self._device), ref_count=1)
            self._device.held[block.slot] = block
            seq.block_table.append(block)

    def _copy_on_write(self, seq: PagedSequence, index: int) -> None:
        shared = seq.block_table[index]
        assert shared is not None, "a partial block is never passed"
        copy = Block(Tier.DEVICE, self._take_slot(self._device), ref_count=1)
        self._device.held[copy.slot] = copy
        self._ops.append(BlockOp(OpKind.COPY, shared.slot, copy.slot))
        self._counters.copied += 1
        shared.ref_count -= 1
        seq.block_table[index] = copy

    def _acquire(self, block: Block) -> None:
        if block.ref_count == 0:
            assert block.block_hash is not None
            del self._pool(block.tier).cached[block.block_hash]
        block.ref_count += 1

    def _release(self, block: Block) -> None:
        assert block.ref_count > 0, "released a block nobody holds"
        block.ref_count -= 1
        if block.ref_count:
            return
        pool = self._pool(block.tier)
        if block.block_hash is not None:
            pool.cached[block.block_hash] = block
        else:
            del pool.held[block.slot]
            pool.free.append(block.slot)

    def _take_slot(self, pool: _TierPool) -> int:
        """A slot of `pool` for new content, evicting its LRU cached block if none is free."""
        if pool.free:
            return pool.free.popleft()
        _, victim = pool.cached.popitem(last=False)
        slot = victim.slot
        del pool.held[slot]
        if pool.tier is Tier.DEVICE and self._cpu.available:
            # Keep the content: the victim moves to the CPU pool and stays findable.
            self._place(victim, Tier.CPU, self._take_slot(self._cpu), OpKind.SWAP_OUT, slot)
            self._cpu.cached[victim.block_hash] = victim  # type: ignore[index]
        else:
            assert victim.block_hash is not None
            if self.save_evicted:
                kind = OpKind.SAVE_CPU if pool.tier is Tier.CPU else OpKind.SAVE_DEVICE
                self._ops.append(BlockOp(kind, slot, -1, victim.block_hash))
            del self._by_hash[victim.block_hash]
            victim.block_hash = None
            self._counters.dropped += 1
        return slot

    def _move_to_cpu(self, block: Block) -> None:
        old = block.slot
        new = self._take_slot(self._cpu)
        del self._device.held[old]
        self._device.free.append(old)
        self._place(block, Tier.CPU, new, OpKind.SWAP_OUT, old)

    def _move_to_device(self, block: Block) -> None:
        """Swap an acquired CPU block back in."""
        assert block.ref_count > 0
        new = self._take_slot(self._device)
        old = block.slot
        del self._cpu.held[old]
        self._cpu.free.append(old)
        self._place(block, Tier.DEVICE, new, OpKind.SWAP_IN, old)

    def _place(self, block: Block, tier: Tier, slot: int, kind: OpKind, src: int) -> None:
        self._ops.append(BlockOp(kind, src, slot))
        if kind is OpKind.SWAP_OUT:
            self._counters.swapped_out += 1
        else:
            self._counters.swapped_in += 1
        block.tier = tier
        block.slot = slot
        self._pool(tier).held[slot] = block

    def _register_full_blocks(self, seq: PagedSequence, num_tokens: int) -> None:
        """Put the blocks that `num_tokens` tokens fill under their content hashes.

        Called as the step computing those tokens is scheduled (see the NOTE above).
        """
        num_full = num_tokens // self.block_size
        if not self.enable_prefix_caching or num_full <= seq.num_registered_blocks:
            return
        self._extend_hashes(seq, num_full)
        for i in range(seq.num_registered_blocks, num_full):
            block = seq.block_table[i]
            if block is None or block.block_hash is not None:
                continue
            h = seq.block_hashes[i]
            # Two prompts that computed the same block before either was registered (one
            # admitted in an earlier step with the shared part still to come): the first
            # copy stays the cached one and the other is freed, unhashed, when released.
            if h not in self._by_hash:
                block.block_hash = h
                self._by_hash[h] = block
        seq.num_registered_blocks = num_full

    def _extend_hashes(self, seq: PagedSequence, num_blocks: int) -> None:
        bs = self.block_size
        for i in range(len(seq.block_hashes), num_blocks):
            parent = seq.block_hashes[i - 1] if i else None
            ns = block_namespace(self.namespace, seq.cache_scope, i, bs)
            seq.block_hashes.append(hash_block(parent, seq.token_ids[i * bs : (i + 1) * bs], ns))
