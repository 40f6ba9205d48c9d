"""Suite-wide setup: interpreter mode for Triton, one torch thread, shared model fixtures."""

from __future__ import annotations

import collections
import os

import pytest

# Must be set before any @triton.jit runs: this machine has no GPU.
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

torch.set_num_threads(1)


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
