"""KV tier fixtures: a small block layout and random blocks in it, the Redis on
127.0.0.1:6379 under a unique key prefix (deleted afterwards), and a private redis-server."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from service.engine.kvtier.record import BlockLayout
from tests.api.server import REDIS_URL, delete_prefix, unique_prefix
from tests.redis_process import redis_server

SHAPE = (2, 2, 4, 2, 8)  # [layers, K/V, block_size, kv_heads, head_dim]


def layout(model_id: str = "tiny", dtype: torch.dtype = torch.float32) -> BlockLayout:
    return BlockLayout(model_id=model_id, namespace=f"{model_id}|", dtype=dtype, shape=SHAPE)


def blocks(n: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    L, two, bs, h, d = SHAPE
    return torch.randn(L, two, n, bs, h, d, generator=gen).to(dtype)  # [L, 2, n, bs, Hkv, D]


@pytest.fixture
def redis_prefix() -> Iterator[str]:
    prefix = unique_prefix() + "kv:"
    yield prefix
    delete_prefix(prefix)


@pytest.fixture
def redis_url() -> str:
    return REDIS_URL


__all__ = ["redis_server"]  # a redis-server of the test's own, on a Unix socket, to stop
