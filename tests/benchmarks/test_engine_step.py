"""benchmarks/engine_step.py on synthetic models, at a tiny scale on the CPU: the figures a GPU
run will report are all there and consistent with one another."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.engine_step import main


def test_synthetic_decode_steps_with_graphs_on_and_off_against_the_weight_bound(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "engine_step.json"
    argv = ["--synthetic", "tiny", "--batch", "1", "3", "--steps", "3", "--prompt-len", "12",
            "--max-model-len", "128", "--dtype", "float32", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0  # every engine's pools are checked balanced before it returns
    result = json.loads(out.read_text())
    rows = result["rows"]
    runs = [(r["graphs"], r["batch"]) for r in rows]
    assert runs == [("on", 1), ("on", 3), ("off", 1), ("off", 3)]
    for r in rows:
        assert r["decoded_per_step"] == r["batch"]
        # Batch 3 pads to the captured 4: the bound counts the real rows' context only.
        assert r["mean_context"] == 12 + 1 + 1 + (3 - 1) / 2
        assert r["weight_bound_ms"] == pytest.approx(r["weight_bytes"] / result["copy_gbps"] / 1e6)
        assert r["weight_kv_bound_ms"] > r["weight_bound_ms"]
    assert {r["decode_path"] for r in rows} == {"static buffers, eager (no CUDA)", "eager"}
    table = capsys.readouterr().out
    assert "RANDOM weights" in table
    assert "| tiny | on | static buffers, eager (no CUDA) | 3 |" in table


def test_batch_one_sets_the_weight_bytes_a_step_reads_against_the_read_bandwidth(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "engine_step.json"
    argv = ["--batch", "1", "--steps", "2", "--prompt-len", "8", "--kv-cache-mb", "32",
            "--matmul-inputs", "fp32", "int8", "--bandwidth-mib", "64",
            "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    rows = json.loads(out.read_text())
    assert set(rows) == {"auto fp32", "auto int8"}
    for (row,) in rows.values():
        # the bundled model's 30 layers of Q4_1 and its tied Q8_0 table as the LM head
        assert row["read_bytes"] == pytest.approx(95e6, rel=0.05)
        assert row["read_gbps"] == pytest.approx(row["read_bytes"] / row["step_ms"] / 1e6)
        assert row["bandwidth_gbps"] > 0
    table = capsys.readouterr().out
    assert "Batch 1 against the read bandwidth" in table
    assert "| auto int8 | " in table
