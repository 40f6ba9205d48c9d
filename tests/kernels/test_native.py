"""The native CPU kernels: torch's int4 layout read back exactly, the fp32 int8 GEMV, paged
decode attention in place, and the library's build."""

from __future__ import annotations

import multiprocessing
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import native, reference
from kernels.metadata import AttentionMetadata
from tests.quant_bounds import int8_input_bound

pytestmark = pytest.mark.skipif(native.library() is None, reason="no C compiler on this machine")
REPO = Path(__file__).resolve().parents[2]


def _int4(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed q, its (scale, zero) pairs, and the dense weight they stand for, in bf16."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    pairs = torch.randn(k // 32, n, 2, generator=gen).to(torch.bfloat16)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
    scale, zero = pairs.float().unbind(-1)  # [K/32, N]
    w = (q.float() - 8).view(n, k // 32, 32) * scale.t()[..., None] + zero.t()[..., None]
    return packed, pairs, w.view(n, k).to(torch.bfloat16)


# Whole tiles of 64 rows, a narrow tail (N % 64), and the default model's shapes.
@pytest.mark.parametrize(("n", "k"), [(64, 32), (80, 64), (112, 96), (960, 576), (576, 1536)])
@pytest.mark.parametrize("threads", [1, 2])
def test_int4_in_torchs_cpu_layout_dequantizes_exactly(n: int, k: int, threads: int) -> None:
    packed, pairs, want = _int4(n, k, seed=n + k)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = native.dequantize_int4(packed, pairs, torch.empty(k, n, dtype=torch.bfloat16), (0, n))
    finally:
        torch.set_num_threads(before)
    assert got.shape == (n, k)
    assert torch.equal(got, want)


def test_a_block_of_int4_rows_dequantizes_as_those_rows() -> None:
    packed, pairs, want = _int4(208, 64, seed=1)  # 3 tiles and a 16-row tail
    block = native.dequantize_int4(
        packed, pairs, torch.empty(64, 80, dtype=torch.bfloat16), (128, 208)
    )
    assert torch.equal(block, want[128:208])


def test_int8_rows_dequantize_to_q_times_their_scale() -> None:
    gen = torch.Generator().manual_seed(2)
    q = torch.randint(-127, 128, (96, 40), generator=gen, dtype=torch.int8)
    scales = torch.rand(96, generator=gen).to(torch.bfloat16)
    want = (q.float() * scales.float()[:, None]).to(torch.bfloat16)
    whole = native.dequantize_int8(q, scales, torch.empty(96, 40, dtype=torch.bfloat16), (0, 96))
    assert torch.equal(whole, want)
    part = native.dequantize_int8(q, scales, torch.empty(30, 40, dtype=torch.bfloat16), (10, 40))
    assert torch.equal(part, want[10:40])


def test_shapes_that_do_not_fit_are_refused_before_any_memory_is_touched() -> None:
    packed, pairs, _ = _int4(128, 64, seed=3)
    out = torch.empty(64, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="rows"):
        native.dequantize_int4(packed, pairs, out, (32, 128))  # not on a tile
    with pytest.raises(ValueError, match="out"):
        native.dequantize_int4(packed, pairs, torch.empty(64, 64, dtype=torch.bfloat16), (0, 128))
    with pytest.raises(ValueError, match="contiguous"):
        native.dequantize_int4(
            packed, pairs, torch.empty(128, 64, dtype=torch.bfloat16).t(), (0, 128)
        )
    with pytest.raises(ValueError, match="scales"):
        native.dequantize_int8(
            torch.zeros(4, 8, dtype=torch.int8), torch.ones(4), torch.empty(4, 8), (0, 4)
        )


def test_the_library_is_built_once_per_cpu_into_the_cache(tmp_path: Path) -> None:
    code = "from kernels import native; lib = native.library(); print(lib is not None)"
    env = {**os.environ, "PAGECHAT_CACHE_DIR": str(tmp_path)}
    for _ in range(2):
        out = subprocess.run(
            [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True
        )
        assert out.stdout.strip() == "True", out.stderr
    built = list(tmp_path.glob("libpagechat_native-*.so"))
    assert len(built) == 1  # the second start found the first one's library
    assert not list(tmp_path.glob("*.tmp"))


def test_without_a_compiler_there_is_no_library_and_packed_layers_keep_their_kernel(
    tmp_path: Path,
) -> None:
    code = (
        "import torch\n"
        "from kernels import native\nfrom service.engine import quant\n"
        "print(native.library())\n"
        "w = quant.quantize_int4(torch.randn(64, 64))\n"
        "layer = quant.QuantLinear(w, torch.device('cpu'), scratch=quant.DequantScratch())\n"
        "print(layer.scratch, quant.measured_max_packed_tokens(4) == quant.NO_CROSSOVER)\n"
        "print(tuple(layer(torch.randn(300, 64)).shape))\n"
    )
    env = {**os.environ, "PAGECHAT_CACHE_DIR": str(tmp_path), "CC": str(tmp_path / "no-cc")}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:3] == ["None", "None True", "(300, 64)"]
    assert "could not build native.c" in out.stderr


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_the_int8_matrix_vector_product_stays_in_fp32(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    q = torch.randint(-127, 128, (200, 72), generator=gen, dtype=torch.int8)  # k % 32 != 0
    scales = torch.rand(200, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, 72, generator=gen)
    y = native.int8_gemv(x, q, scales)
    w = q.double() * scales.double()[:, None]
    want = x.double() @ w.T
    assert y.dtype == torch.float32 and y.shape == (rows, 200)
    # fp32 accumulation of 72 products: within 72 * 2^-24 of the sum of their magnitudes.
    bound = 72 * 2.0**-24 * (x.double().abs() @ w.abs().T)
    assert bool(((y.double() - want).abs() <= bound).all())
    with pytest.raises(ValueError, match="input"):
        native.int8_gemv(x.bfloat16(), q, scales)


@pytest.mark.skipif(
    platform.machine() != "x86_64" or "avx2" not in Path("/proc/cpuinfo").read_text(),
    reason="the image's baseline library is for x86-64-v3 (AVX2, FMA) CPUs",
)
def test_a_library_built_beforehand_is_loaded_without_a_compiler(tmp_path: Path) -> None:
    """What the Dockerfile does: build for x86-64-v3 in a stage with gcc, run without one."""
    target = tmp_path / "libpagechat_native.so"
    subprocess.run(native.build_command("cc", str(target), march="x86-64-v3"), check=True)
    code = "from kernels import native; print(native.library() is not None)"
    env = {
        **os.environ,
        "PAGECHAT_NATIVE_LIB": str(target),
        "CC": str(tmp_path / "no-cc"),
        "PAGECHAT_CACHE_DIR": str(tmp_path / "cache"),
    }
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True)
    assert out.stdout.decode().strip() == "True", out.stderr.decode()
    assert not (tmp_path / "cache").exists()  # nothing was built


def test_the_dockerfile_builds_the_library_as_native_py_would() -> None:
    text = (REPO / "Dockerfile").read_text().replace("\\\n", " ")
    line = next(part for part in text.splitlines() if "native.c" in part and "gcc" in part)
    command = line.split("RUN", 1)[1].split()
    want = native.build_command("gcc", "/src/libpagechat_native.so", march="x86-64-v3")
    assert command[:-1] == want[:-1]  # the same flags; the source path is the image's
    assert command[-1].endswith("native.c")


@pytest.mark.parametrize(
    ("lens", "heads"), [([300], (9, 3)), ([37, 1, 129, 16, 5], (4, 2)), ([64] * 6, (8, 8))]
)
def test_paged_decode_reads_the_cache_in_place_as_the_padded_sdpa_does(
    lens: list[int], heads: tuple[int, int]
) -> None:
    hq, hkv = heads
    gen = torch.Generator().manual_seed(len(lens))
    num_blocks, bs, d = 64, 16, 64
    # NaN in every slot no sequence owns: a read of a wrong slot poisons the output.
    k_cache = torch.full((num_blocks, bs, hkv, d), float("nan"))
    v_cache = torch.full((num_blocks, bs, hkv, d), float("nan"))
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for n in lens:
        blocks = order[used : used + -(-n // bs)]
        used += len(blocks)
        tables.append(blocks)
        for p in range(n):
            k_cache[blocks[p // bs], p % bs] = torch.randn(hkv, d, generator=gen)
            v_cache[blocks[p // bs], p % bs] = torch.randn(hkv, d, generator=gen)
    width = max(map(len, tables))
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(len(lens), dtype=torch.int64),
        query_start_loc=torch.arange(len(lens) + 1, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        block_size=bs,
        query_lens_host=[1] * len(lens),
        seq_lens_host=lens,
    )
    plan = reference.plan_attention(meta)
    assert plan.decode is not None
    query = torch.randn(len(lens), hq, d, generator=gen)
    want = reference.decode_sdpa(query, k_cache, v_cache, plan.decode, 0.125)
    slots = plan.decode.slots.view(len(lens), -1)
    got = native.paged_decode(query, k_cache, v_cache, slots, plan.decode.seq_lens, 0.125)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="fp32"):
        native.paged_decode(query.double(), k_cache, v_cache, slots, plan.decode.seq_lens, 0.1)


@pytest.mark.parametrize("rows", [1, 3, 6])
def test_the_int4_matrix_vector_product_reads_torchs_layout_in_fp32(rows: int) -> None:
    packed, pairs, want_bf16 = _int4(192, 96, seed=rows)
    w = native.dequantize_int4(packed, pairs, torch.empty(96, 192, dtype=torch.float32), (0, 192))
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
    y = native.int4_gemv(x, packed, pairs)
    if y is None:
        pytest.skip("the library was built without AVX512: torch's kernel runs instead")
    want = x.double() @ w.double().T
    bound = 96 * 2.0**-24 * (x.double().abs() @ w.double().abs().T) + 1e-6
    assert y.shape == (rows, 192) and bool(((y.double() - want).abs() <= bound).all())
    assert torch.equal(w.to(torch.bfloat16), want_bf16)  # the fp32 dequantization agrees
    tail, tail_pairs, _ = _int4(80, 64, seed=9)  # a narrow tile: left to torch's kernel
    assert native.int4_gemv(torch.randn(1, 64), tail, tail_pairs) is None


@pytest.mark.parametrize("shape", [(1, 576), (5, 64), (2, 3, 100)])
def test_rms_norm_matches_torchs_in_fp32(shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(len(shape))
    x = torch.randn(*shape, generator=gen) * 3
    weight = torch.randn(shape[-1], generator=gen)
    got = native.rms_norm(x, weight, 1e-5)
    want = torch.nn.functional.rms_norm(x.double(), (shape[-1],), weight.double(), 1e-5)
    # Summation order differs from torch's: a few fp32 roundings of each output.
    assert got.shape == x.shape and torch.allclose(got.double(), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="rms_norm"):
        native.rms_norm(x.double(), weight, 1e-5)


needs_vnni = pytest.mark.skipif(not native.has_vnni(), reason="built without AVX512-VNNI")


def _int4_values(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, K] in 0..15 and (scale, zero) pairs [K/32, N, 2] bf16."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    return q, torch.randn(k // 32, n, 2, generator=gen).to(torch.bfloat16)


# One tile, several, and the default model's shapes.
@needs_vnni
@pytest.mark.parametrize(("n", "k"), [(16, 32), (48, 96), (960, 576), (576, 1536)])
def test_the_vnni_layout_holds_the_same_weights_as_torchs(n: int, k: int) -> None:
    q, pairs = _int4_values(n, k, seed=n + k)
    torch_layout = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 2)
    vnni = native.pack_int4_vnni(q)
    assert vnni.shape == torch_layout.shape == (n, k // 2)
    if n % 64 == 0:  # torch's dequantizer takes whole tiles of 64
        want = native.dequantize_int4(torch_layout, pairs, torch.empty(k, n), (0, n))
    else:
        scale, zero = pairs.float().unbind(-1)  # [K/32, N]
        w = (q.float() - 8).view(n, k // 32, 32) * scale.t()[..., None] + zero.t()[..., None]
        want = w.view(n, k)
    got = native.dequantize_int4_vnni(vnni, pairs, torch.empty(k, n), (0, n))
    assert torch.equal(got, want)
    block = native.dequantize_int4_vnni(vnni, pairs, torch.empty(k, 16), (n - 16, n))
    assert torch.equal(block, want[n - 16 :])


@needs_vnni
@pytest.mark.parametrize("rows", [1, 3, 4, 9])
def test_the_vnni_product_is_within_its_two_digit_input_rounding(rows: int) -> None:
    q, pairs = _int4_values(192, 96, seed=rows)
    vnni = native.pack_int4_vnni(q)
    w = native.dequantize_int4_vnni(vnni, pairs, torch.empty(96, 192), (0, 192))
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
    x[0, :32] = 0.0  # a group of zeros: step 0, nothing divided by it
    y = native.int4_vnni_gemv(x, vnni, pairs)
    want = x.double() @ w.double().T
    bound = int8_input_bound(x, w)
    assert y.shape == (rows, 192) and bool(((y.double() - want).abs() <= bound).all())
    assert not torch.equal(y, want.float())  # the inputs were rounded: not the fp32 product
    with pytest.raises(ValueError, match="VNNI layout"):
        native.pack_int4_vnni(torch.zeros(24, 32, dtype=torch.uint8))


@pytest.mark.parametrize("threads", [1, 2])
def test_the_int8_product_split_over_two_threads_is_the_same_product(threads: int) -> None:
    gen = torch.Generator().manual_seed(threads)
    q = torch.randint(-127, 128, (1000, 64), generator=gen, dtype=torch.int8)
    scales = torch.rand(1000, generator=gen).to(torch.bfloat16)
    x = torch.randn(3, 64, generator=gen)
    assert torch.equal(native.int8_gemv(x, q, scales, threads), native.int8_gemv(x, q, scales))


def _split_product_in_a_child(queue: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    gen = torch.Generator().manual_seed(5)
    q = torch.randint(-127, 128, (256, 64), generator=gen, dtype=torch.int8)
    scales = torch.rand(256, generator=gen).to(torch.bfloat16)
    x = torch.randn(2, 64, generator=gen)
    queue.put(torch.equal(native.int8_gemv(x, q, scales, 2), native.int8_gemv(x, q, scales)))


def test_a_forked_child_starts_its_own_helper_thread() -> None:
    # The parent's helper is running (a split call); the child has none until it starts one.
    test_the_int8_product_split_over_two_threads_is_the_same_product(2)
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_split_product_in_a_child, args=(queue,))
    child.start()
    child.join(timeout=60)
    if child.is_alive():
        child.kill()
        pytest.fail("the forked child hung in the split call")
    assert child.exitcode == 0 and queue.get(timeout=5) is True
