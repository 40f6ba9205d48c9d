"""Benchmark scripts run as a GPU session runs them: from the repository root, in a process of
their own, with Triton compiling for real (without TRITON_INTERPRET, which tests/conftest.py
sets for the suite)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_script(*command: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`command`'s exit status and output, `env` added to the environment."""
    environ = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | env
    return subprocess.run(
        list(command), cwd=ROOT, env=environ, capture_output=True, text=True, timeout=600
    )
