"""Fixtures shared by the modules that run a real server: `balanced`, the after-test check a
module opts into (`pytest.mark.usefixtures("balanced")`, for its own `server`), and the Redis
prefix and client for the tests that read what the server stored there."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
import redis

from tests.api.server import REDIS_URL, ServerProcess, delete_prefix, unique_prefix, wait_balanced


@pytest.fixture
async def balanced(server: ServerProcess) -> AsyncIterator[None]:
    """After the test: the module's server holds no block, runs and queues nothing, and has
    no connection open."""
    yield
    await wait_balanced(server)


@pytest.fixture(scope="module")
def prefix() -> Iterator[str]:
    """A fresh key prefix for the module's server; its keys are deleted at the end."""
    prefix = unique_prefix()
    yield prefix
    delete_prefix(prefix)


@pytest.fixture
def redis_client() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(REDIS_URL)
    yield client
    client.close()
