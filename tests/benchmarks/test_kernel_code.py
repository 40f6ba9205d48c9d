"""What the attention kernel compiles to for an H200 (sm_90), checked without a GPU.

benchmarks/kernel_code.py compiles the launches the backend makes with Triton's compiler and
reads the SASS (in a subprocess: the kernels must not be defined under the interpreter there).
These tests pin what the issue's target batch (decode 64 x 4096, 32/8/128 bf16) rests on: K/V
arrive as 16-byte asynchronous copies, nothing spills, and the two shortcuts (unmasked whole
tiles, int32 offsets) make the loop shorter.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import triton

from tests.benchmarks.scripts import run_script

pytestmark = pytest.mark.server

NVIDIA_TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
if not (NVIDIA_TOOLS / "ptxas").exists() or not (NVIDIA_TOOLS / "cuobjdump").exists():
    pytest.skip("this Triton wheel ships no ptxas/cuobjdump", allow_module_level=True)

TARGET = "decode 64 x 4096, 32/8/128 bf16"


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    out = tmp_path_factory.mktemp("kernel_code") / "code.json"
    result = run_script(sys.executable, "-m", "benchmarks.kernel_code", "--json", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    return {record["case"].strip(): record for record in json.loads(out.read_text())}


def count(ops: dict[str, int], prefix: str) -> int:
    return sum(n for op, n in ops.items() if op.startswith(prefix))


def test_nothing_spills_to_local_memory(compiled: dict[str, dict[str, Any]]) -> None:
    assert compiled[TARGET]["grid"] == [64, 8, 1]
    assert {case: code["local_bytes"] for case, code in compiled.items()} == dict.fromkeys(
        compiled, 0
    )


def test_kv_tiles_arrive_as_16_byte_async_copies(compiled: dict[str, dict[str, Any]]) -> None:
    """A 64-token tile of K and V at head_dim 128 in bf16 is 32 KiB: over 128 threads that is
    16 copies of 16 bytes each, and no narrow loads are left in the loop."""
    unmasked = compiled[TARGET]["loops"][0]["ops"]
    assert count(unmasked, "LDGSTS.E.BYPASS.128") == 16
    assert count(unmasked, "LDG.E") == 0


def test_whole_tiles_skip_the_masks(compiled: dict[str, dict[str, Any]]) -> None:
    """Two loops, unmasked then masked; the unmasked one is shorter than the single loop of
    the same launch with masks on every tile."""
    unmasked, masked = compiled[TARGET]["loops"]
    (everywhere,) = compiled["same, masks on every tile"]["loops"]
    assert unmasked["instructions"] < min(masked["instructions"], everywhere["instructions"])


def test_int32_offsets_shorten_the_loop(compiled: dict[str, dict[str, Any]]) -> None:
    wide = compiled["same, int64 offsets"]["loops"][0]
    assert compiled[TARGET]["loops"][0]["instructions"] < wide["instructions"]


def test_the_interpreter_refuses_to_compile() -> None:
    result = run_script(sys.executable, "-m", "benchmarks.kernel_code", TRITON_INTERPRET="1")
    assert result.returncode == 2
    assert "unset TRITON_INTERPRET" in result.stderr
