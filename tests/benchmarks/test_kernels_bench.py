"""benchmarks/kernels.py must be ready for a GPU session: its CPU path runs the correctness
checks under the interpreter, and its sweep covers the launch the backend picks today."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from benchmarks.kernels import SWEEP_POINTS, SweepPoint, sweep_grid
from kernels.attention_launch import choose_launch
from tests.benchmarks.scripts import run_script


@pytest.mark.server
def test_without_cuda_the_script_checks_correctness_under_the_interpreter(
    tmp_path: Path,
) -> None:
    out = tmp_path / "kernels.md"
    result = run_script(sys.executable, "-m", "benchmarks.kernels", "--out", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    report = out.read_text()
    assert "No CUDA device" in report
    assert "all checks passed" in report
    assert "FAIL" not in report
    # Every attention case and cache op made it into the tables.
    for row in ("decode, ragged", "prefill, fresh + chunk", "mixed fp32", "write_kv", "swap in"):
        assert f"| {row}" in report


@pytest.mark.parametrize("point", SWEEP_POINTS, ids=lambda p: f"{p.shape.name}-{p.batch}x{p.ctx}")
def test_sweep_times_the_launch_picked_today(point: SweepPoint) -> None:
    """So the sweep's table says how far the default is from the best configuration."""
    picked = choose_launch(
        num_tokens=point.batch, num_seqs=point.batch, max_query_len=1, max_seq_len=point.ctx,
        num_q_heads=point.shape.q_heads, num_kv_heads=point.shape.kv_heads,
        head_dim=point.shape.head_dim, dtype=point.shape.dtype, num_sms=132,
    )  # fmt: skip
    tuned = [(tuning.apply(picked), layout) for tuning, layout in sweep_grid(point)]
    assert (picked, "nhd") in tuned
    assert (picked, "hnd") in tuned
    assert len(set(tuned)) == len(tuned)  # no configuration is timed twice
