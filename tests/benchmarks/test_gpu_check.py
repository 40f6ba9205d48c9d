"""benchmarks/gpu_check.sh without a GPU: the scripts parse, a dry run takes every step through
its real commands at a tiny size, and a step that cannot run shows in the report and the exit
status. What the GPU steps measure only a GPU can say."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmarks.scripts import ROOT, run_script

pytestmark = pytest.mark.server

SCRIPTS = [ROOT / "benchmarks" / "gpu_check.sh", ROOT / "benchmarks" / "gpu_bundle.sh"]
STEPS = ("tests", "engine", "kernels", "throughput", "serve", "sweep")


def gpu_check(out: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return run_script("bash", str(SCRIPTS[0]), *args, OUT=str(out), PYTHON=sys.executable, **env)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_the_script_parses(script: Path) -> None:
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_a_dry_run_takes_every_step_and_brings_back_four_files(tmp_path: Path) -> None:
    result = gpu_check(tmp_path, "--dry-run")
    assert result.returncode == 0, result.stdout + result.stderr
    folder = tmp_path / "gpu-check"
    # A device call brings back at most eight files, none deeper than two folders.
    assert sorted(p.name for p in folder.iterdir()) == [
        "env.txt", "log.txt", "report.md", "results.json",
    ]  # fmt: skip
    report = (folder / "report.md").read_text()
    for step in STEPS:
        assert f"\n## {step}\n" in report
        assert f"*{step}: passed in " in report
    assert "missing: none" in report
    assert "needs a CUDA GPU" in report  # the GPU tests ran, and said why they skipped
    assert "| tiny | on | static buffers, eager (no CUDA) | 3 |" in report
    assert "| tiny | off | eager | 1 |" in report
    assert "all checks passed" in report  # the kernels' interpreter checks
    results = json.loads((folder / "results.json").read_text())
    assert sorted(results) == ["engine_step", "serve", "throughput"]
    assert [r["allocation"] for r in results["throughput"]["runs"]] == ["paged", "contiguous"]
    assert results["throughput"]["random_weights"] is True
    assert results["serve"][0]["sessions"] == 2
    assert len(results["engine_step"]["rows"]) == 4


def test_a_step_without_time_left_is_reported_skipped_and_fails_the_run(tmp_path: Path) -> None:
    result = gpu_check(tmp_path, "--dry-run", BUDGET_S="0")
    assert result.returncode == 1
    report = (tmp_path / "gpu-check" / "report.md").read_text()
    for step in STEPS:
        assert f"*{step}: skipped, " in report
    assert "- setup: passed" in result.stdout


def test_an_unknown_argument_is_refused(tmp_path: Path) -> None:
    result = gpu_check(tmp_path, "--fast")
    assert result.returncode == 2
    assert "usage" in result.stderr
