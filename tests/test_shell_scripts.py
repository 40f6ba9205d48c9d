"""Every shell script the project runs (the setup, CI, llama-server build and the GPU check
scripts) passes shellcheck: `make setup-test` installs it where apt-get can."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(
    path.relative_to(ROOT)
    for path in [*ROOT.glob("scripts/*.sh"), *ROOT.glob("benchmarks/*.sh"), ROOT / ".ci" / "run"]
)


def test_the_scripts_are_found() -> None:
    names = {path.name for path in SCRIPTS}
    assert {"setup-env.sh", "gpu_check.sh", "gpu_bundle.sh", "run"} <= names


@pytest.mark.server  # runs a process: shellcheck
@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="no shellcheck (make setup-test)")
@pytest.mark.parametrize("script", SCRIPTS, ids=str)
def test_shellcheck_finds_nothing(script: Path) -> None:
    result = subprocess.run(
        ["shellcheck", "--external-sources", str(script)],
        capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout
