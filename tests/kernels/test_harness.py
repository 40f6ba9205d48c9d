"""The CPU kernels through kernels/cpu/src/harness.c, each kernel on the same kind of inputs
and references as tests/kernels/test_cpu_ops.py checks through the library:

- arm64: the generic and neon versions cross-compiled with Debian's gcc-aarch64-linux-gnu and
  run under qemu-user (`make test` installs both where it runs as root; elsewhere these skip,
  saying which tool is missing);
- this CPU's versions under AddressSanitizer and UBSan: every load and store of every kernel
  checked (an overrun of a stack array showed only as a crash elsewhere)."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kernels.cpu import build, dispatch, ops
from kernels.cpu.formats import Blocks, WeightType, random_blocks
from service.engine.model import apply_rope
from tests.kernels.sampling_cases import check_picks, sample_case
from tests.kernels.test_products_q8 import _dequantized_inputs

pytestmark = pytest.mark.server

COMPILER = "aarch64-linux-gnu-gcc"
QEMU = "qemu-aarch64"
ARM_VERSIONS = [isa.name for isa in build.isas("aarch64")]
ARM64, SANITIZED = "arm64 under qemu", "this CPU under ASan"
TARGETS = [(ARM64, isa) for isa in ARM_VERSIONS] + [
    (SANITIZED, isa.name) for isa in build.isas(build.machine())
]


@dataclass(frozen=True, slots=True)
class Out:
    """An output file of the harness: its dtype and shape, read back after the run."""

    dtype: torch.dtype
    shape: tuple[int, ...]


Run = Callable[..., list[torch.Tensor]]


@pytest.fixture(scope="module")
def harnesses(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    """The command that runs each target's harness, built once (a target whose tools are
    missing is absent)."""
    out = tmp_path_factory.mktemp("harness")
    commands = {
        SANITIZED: [str(build.build_harness("cc", out / "asan", build.machine(), sanitize=True))]
    }
    if shutil.which(COMPILER) and shutil.which(QEMU):
        commands[ARM64] = [QEMU, str(build.build_harness(COMPILER, out / "arm64", "aarch64"))]
    return commands


@pytest.fixture(params=TARGETS, ids=[f"{t}-{isa}" for t, isa in TARGETS])
def target(
    request: pytest.FixtureRequest, harnesses: dict[str, list[str]]
) -> tuple[list[str], str]:
    """(the harness command, a version it runs), where this machine can run it."""
    name, isa = request.param
    if name not in harnesses:
        pytest.skip(
            f"needs {COMPILER} and {QEMU} (apt-get install gcc-aarch64-linux-gnu qemu-user)"
        )
    runs = subprocess.run([*harnesses[name], "runs"], capture_output=True, text=True, timeout=60)
    if isa not in runs.stdout.split():
        pytest.skip(f"this CPU cannot execute the {isa} kernels")
    request.node.user_properties.append(("cpu_isa", f"{isa} ({name})"))
    return harnesses[name], isa


@pytest.fixture
def run(target: tuple[list[str], str], tmp_path: Path) -> Run:
    """run(op, *args): tensors are written to files passed as inputs, each `Out` is an output
    file; returns the outputs, read back, in order."""
    command, isa = target

    def call(op: str, *args: object) -> list[torch.Tensor]:
        argv: list[str] = []
        outputs: list[tuple[Path, Out]] = []
        for i, arg in enumerate(args):
            path = tmp_path / f"arg{i}.bin"
            if isinstance(arg, torch.Tensor):
                raw = arg.contiguous().view(torch.uint8) if arg.dim() else arg  # bf16 too
                path.write_bytes(raw.numpy().tobytes())
            elif isinstance(arg, Out):
                outputs.append((path, arg))
            else:
                argv.append(str(arg))
                continue
            argv.append(str(path))
        done = subprocess.run(
            [*command, isa, op, *argv], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        return [
            torch.frombuffer(bytearray(path.read_bytes()), dtype=out.dtype).view(out.shape)
            for path, out in outputs
        ]

    return call


def test_qemus_cpu_runs_every_arm64_version(harnesses: dict[str, list[str]]) -> None:
    if ARM64 not in harnesses:
        pytest.skip(
            f"needs {COMPILER} and {QEMU} (apt-get install gcc-aarch64-linux-gnu qemu-user)"
        )
    runs = subprocess.run([*harnesses[ARM64], "runs"], capture_output=True, text=True, timeout=60)
    assert runs.stdout.split() == ARM_VERSIONS


def _gguf(weight: Blocks) -> torch.Tensor:
    kind = gguf.GGMLQuantizationType(int(weight.kind))
    return torch.from_numpy(np.array(gguf.quants.dequantize(weight.data.numpy(), kind)))


@pytest.mark.parametrize("kind", list(WeightType))
def test_the_harness_dequantizes_exactly_and_multiplies_in_fp32(
    run: Run, target: tuple[list[str], str], kind: WeightType
) -> None:
    gen = torch.Generator().manual_seed(int(kind))
    k = 512 if kind >= WeightType.Q4_K else 64
    weight = random_blocks(kind, 20, k, gen)
    want_w = _gguf(weight)
    (dense,) = run("dequant", int(kind), 20, k, weight.data, Out(torch.float32, (20, k)))
    assert torch.equal(dense, want_w)
    # in registers, two rows at once, tiles of dequantized rows (a full one and a rest), split
    # with the helper threads (shares of 16 rows: 16 + 4), and steps of 32 rows and more (amx:
    # the tile unit, its bound)
    for rows, threads in ((1, 1), (2, 1), (5, 1), (11, 1), (3, 2), (40, 1), (33, 2), (9, 3)):
        x = torch.randn(rows, k, generator=gen)
        (y,) = run(
            "gemv", int(kind), rows, 20, k, threads, weight.data, x,
            Out(torch.float32, (rows, 20)),
        )  # fmt: skip
        per_term = 2.0**-15 if target[1] == "amx" and rows >= 32 else k * 2.0**-24
        bound = per_term * (x.double().abs() @ want_w.double().abs().t()) + 1e-30
        assert ((y.double() - x.double() @ want_w.double().t()).abs() <= bound).all()


@pytest.mark.parametrize("kind", list(WeightType))
def test_the_harness_products_of_int8_inputs_are_their_dot_products_same_at_any_row_count(
    run: Run, kind: WeightType
) -> None:
    # tests/kernels/test_products_q8.py's checks through the harness: the inputs quantized as
    # ggml's Q8_0 (q8_reference), one to four rows from the blocks, more side by side in
    # vector lanes (NEON's 4, AVX512's 16, others' 8: 21 rows end in a part vector of each),
    # split with the helper threads; legacy types' rows ending in a part chunk of sub-blocks.
    gen = torch.Generator().manual_seed(50 + int(kind))
    k = 256 if kind >= WeightType.Q4_K else 352
    weight = random_blocks(kind, 40, k, gen)  # shares of 16 rows: 16 + 24, 16 + 16 + 8
    w = _gguf(weight).double()
    x = torch.randn(17, k, generator=gen)
    xq = _dequantized_inputs(x)
    outputs = {}
    for rows, threads in ((3, 2), (17, 3)):
        (y,) = run(
            "gemv_q8", int(kind), rows, 40, k, threads, weight.data, x[:rows],
            Out(torch.float32, (rows, 40)),
        )  # fmt: skip
        bound = k * 2.0**-24 * (xq[:rows].abs() @ w.abs().t()) + 1e-30
        assert ((y.double() - xq[:rows] @ w.t()).abs() <= bound).all()
        outputs[rows] = y
    assert torch.equal(outputs[3], outputs[17][:3])


@pytest.mark.parametrize("kind", [t for t in WeightType if t != WeightType.Q5_0])
def test_the_harness_reads_rows_regrouped_eight_at_a_time_with_the_same_bits(
    run: Run, kind: WeightType
) -> None:
    # tests/kernels/test_rows_x8.py's checks through the harness (NEON's lanes under qemu):
    # eight rows in the lanes for up to 16 input rows, side by side beyond, split with
    # the helper threads, and the rows dequantized back as stored.
    gen = torch.Generator().manual_seed(60)
    weight = random_blocks(kind, 40, 512, gen)
    local = dispatch.select("generic")
    assert local is not None
    x8 = ops.regroup_rows_x8(local, Blocks(weight.kind, weight.data.clone(), weight.k))
    x = torch.randn(17, 512, generator=gen)
    for rows, threads in ((1, 1), (4, 2), (9, 2), (17, 3)):
        stored, regrouped = (
            run(
                "gemv_q8", code, rows, 40, 512, threads, data, x[:rows],
                Out(torch.float32, (rows, 40)),
            )[0]
            for code, data in ((weight.code, weight.data), (x8.code, x8.data))
        )  # fmt: skip
        assert torch.equal(regrouped, stored)
    dense = [
        run("dequant", code, 40, 512, data, Out(torch.float32, (40, 512)))[0]
        for code, data in ((weight.code, weight.data), (x8.code, x8.data))
    ]
    assert torch.equal(dense[0], dense[1])


@pytest.mark.parametrize("dtype", list(ops.ELEMENT_TYPES))
def test_the_harness_attention_and_rope_match_torch(run: Run, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(21)
    hq, hkv, d, slots_total = 6, 2, 64, 48
    k, v = (torch.randn(slots_total, hkv, d, generator=gen).to(dtype) for _ in range(2))
    query = torch.randn(2, hq, d, generator=gen)
    lens = torch.tensor([40, 9])
    slots = torch.stack([torch.randperm(slots_total, generator=gen)[:40] for _ in range(2)])
    code = ops.ELEMENT_TYPES[dtype]
    (got,) = run(
        "attend", code, 2, hq, hkv, d, 40, 0.125, query, k, v, slots, lens,
        Out(torch.float32, (2, hq, d)),
    )  # fmt: skip
    for b in range(2):
        ctx = slots[b, : lens[b]]
        want = F.scaled_dot_product_attention(
            query[b][None, :, None],
            k[ctx].float().transpose(0, 1)[None],
            v[ctx].float().transpose(0, 1)[None],
            scale=0.125,
            enable_gqa=True,
        )[0, :, 0]
        assert torch.allclose(got[b], want, rtol=1e-5, atol=1e-5)

    qkv = torch.randn(3, (hq + 2 * hkv) * d, generator=gen)
    angles = torch.rand(3, d // 2, generator=gen) * 6
    cos = torch.cat([angles.cos(), angles.cos()], -1)
    sin = torch.cat([-angles.sin(), angles.sin()], -1)
    write = torch.tensor([7, 0, 22])
    empty = torch.zeros(24, hkv, d, dtype=dtype)
    rotated, key_cache, value_cache = run(
        "rope_write", code, 3, hq, hkv, d, 24, qkv, cos, sin, write, empty, empty,
        Out(torch.float32, (3, hq + 2 * hkv, d)), Out(dtype, (24, hkv, d)),
        Out(dtype, (24, hkv, d)),
    )  # fmt: skip
    heads = qkv.view(3, hq + 2 * hkv, d)
    want = apply_rope(heads[:, : hq + hkv], cos[:, None], sin[:, None])
    assert torch.allclose(rotated[:, : hq + hkv], want, rtol=1e-6, atol=1e-6)
    assert torch.allclose(key_cache[write].float(), want[:, hq:].to(dtype).float(), rtol=1e-2)
    assert torch.equal(value_cache[write], heads[:, hq + hkv :].to(dtype))


def test_the_harness_rms_norm_silu_and_gelu_match_torch(run: Run) -> None:
    gen = torch.Generator().manual_seed(22)
    x, w = torch.randn(5, 101, generator=gen) * 3, torch.randn(101, generator=gen)
    (normed,) = run("rms_norm", 5, 101, 1e-5, x, w, Out(torch.float32, (5, 101)))
    want = F.rms_norm(x, (101,), w, 1e-5)
    assert torch.allclose(normed, want, rtol=1e-5, atol=1e-6)
    gate_up = torch.randn(4, 2 * 96, generator=gen) * 8
    (gated,) = run("silu_mul", 4, 96, gate_up, Out(torch.float32, (4, 96)))
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.allclose(gated, F.silu(gate) * up, rtol=1e-5, atol=1e-6)
    (gelu,) = run("gelu_tanh_mul", 4, 96, gate_up, Out(torch.float32, (4, 96)))
    want = _gelu_tanh(gate) * up
    assert torch.allclose(gelu.double(), want, rtol=1e-5, atol=1e-6)


def _gelu_tanh(gate: torch.Tensor) -> torch.Tensor:
    """GELU's tanh approximation in float64 (torch's fp32 one cancels to 0 far below 0)."""
    g = gate.double()
    return g * torch.sigmoid(2 * (2 / torch.pi) ** 0.5 * (g + 0.044715 * g**3))


@pytest.mark.parametrize("seed", range(3))
def test_the_harness_samples_what_a_float64_reference_picks(run: Run, seed: int) -> None:
    case = sample_case(seed)
    rows, vocab = case.logits.shape
    (picks,) = run(
        "sample", rows, vocab, case.allowed.shape[1], case.logits, case.allowed,
        case.temperatures, case.min_p, case.uniforms, Out(torch.int64, (rows,)),
    )  # fmt: skip
    check_picks(case, picks)
