"""connector.py's worker side on real pools and a real tier: blocks leave either pool as a
copy under their hashes, and loaded runs land in the device slots the LOAD ops name."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from service.engine.blocks import Block
from service.engine.kvtier.connector import BlocksToSave, KVTierConnector
from service.engine.kvtier.dir_backend import DirBackend
from service.engine.kvtier.tier import KVTier, LoadedRun
from service.engine.values import Tier
from tests.engine.kvtier.conftest import SHAPE, blocks, layout

L, TWO, BS, HEADS, DIM = SHAPE


@pytest.fixture
def kv_tier(tmp_path: Path) -> Iterator[KVTier]:
    tier = KVTier([DirBackend(tmp_path, cap_bytes=1 << 20)], layout())
    yield tier
    tier.close()


@pytest.fixture
def connector(kv_tier: KVTier) -> KVTierConnector:
    return KVTierConnector(kv_tier)


def pools(device: int, cpu: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A device and a CPU pool [L, 2, n, bs, Hkv, D] of random K/V."""
    return blocks(device, seed=1), blocks(cpu, seed=2)


def load(kv_tier: KVTier, hashes: list[int]) -> LoadedRun:
    ticket = kv_tier.load(hashes)
    assert ticket.done.wait(10) and ticket.result is not None
    return ticket.result


def test_dropped_blocks_and_a_finished_requests_blocks_are_saved_from_either_pool(
    kv_tier: KVTier, connector: KVTierConnector
) -> None:
    device, cpu = pools(4, 3)
    connector.worker.register_pools(device, cpu)
    connector.worker.save(Tier.CPU, [2, 0], [20, 21])  # SAVE_CPU ops: slots 2 and 0
    blocks_ = [Block(Tier.DEVICE, 3), Block(Tier.CPU, 1), Block(Tier.DEVICE, 0)]
    connector.worker.save_blocks(BlocksToSave([30, 31, 32], blocks_))
    assert connector.flush()
    assert torch.equal(load(kv_tier, [20, 21]).data, cpu[:, :, [2, 0]])
    run = load(kv_tier, [30, 31, 32])
    assert torch.equal(run.data[:, :, 0], device[:, :, 3])
    assert torch.equal(run.data[:, :, 1], cpu[:, :, 1])
    assert torch.equal(run.data[:, :, 2], device[:, :, 0])


def test_loaded_runs_are_staged_in_row_order_and_copied_into_their_slots(
    connector: KVTierConnector,
) -> None:
    device, cpu = pools(6, 1)
    connector.worker.register_pools(device, cpu)
    first, second = blocks(2, seed=3), blocks(1, seed=4)
    staged = connector.worker.stage([LoadedRun([1, 2], first), LoadedRun([3], second)])
    assert staged is not None and staged.shape[2] == 3
    connector.worker.load(staged, [0, 1, 2], [5, 1, 3])  # every row, in order
    assert torch.equal(device[:, :, [5, 1, 3]], torch.cat([first, second], dim=2))
    connector.worker.load(staged, [2], [0])  # a later LOAD group: row 2 only
    assert torch.equal(device[:, :, 0], second[:, :, 0])
    assert connector.worker.stage([]) is None
