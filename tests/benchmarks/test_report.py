"""Tests for `benchmarks/report.py`: tables land between their markers only; plots are written."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import kv_memory, report
from benchmarks.workload import WorkloadConfig

DOC = """# Performance

Hand-written text.

<!-- bench:kv_memory -->
old figures
<!-- /bench:kv_memory -->

More hand-written text.
"""


def test_a_section_is_replaced_and_nothing_else() -> None:
    out = report.replace_section(DOC, "kv_memory", "new figures")
    assert out == DOC.replace("old figures", "new figures")
    assert report.replace_section(out, "kv_memory", "new figures") == out


def test_a_missing_section_is_an_error() -> None:
    with pytest.raises(ValueError, match="bench:throughput"):
        report.replace_section(DOC, "throughput", "x")


def test_kv_memory_tables_and_plots_render(tmp_path: Path) -> None:
    kv = kv_memory.run(WorkloadConfig(num_conversations=12), budget_tokens=8192, users=[1, 4])
    text = report.kv_memory_markdown(kv)
    assert "| paged-16 (block 16) |" in text and "| contiguous |" in text
    report.plot_kv_memory(kv, tmp_path / "kv.png")
    report.plot_shared_prompt(kv, tmp_path / "shared.png")
    for name in ("kv.png", "shared.png"):
        assert (tmp_path / name).read_bytes().startswith(b"\x89PNG")
