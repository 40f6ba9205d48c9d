"""pagechat's CPU kernels against ggml's, the same GGUF blocks side by side: what linking
ggml's CPU backend (its per-type dot products, llama.cpp's) would give the native GEMV.

ggml multiplies a row of blocks by the input quantized to its `vec_dot_type` (Q8_0 or Q8_1
blocks, Q8_K for the K types): `from_float` once per input, then `vec_dot` per weight row,
called here from a few lines of C compiled beside the library (no Python in the loop).
pagechat's `ops.gemv` multiplies in fp32. Both on one thread, on the default model's four
layer matrices (qkv 960x576, o_proj 576x576, gate_up 3072x576, down 576x1536) in random
blocks of each type (K types at k = 512 where 576 has no whole super-block), a batch-1 GEMV;
then each one's error against float64 over the dequantized weights, relative to sum |x w|.

ggml's library is built from the llama.cpp sources scripts/build-llama-server.sh fetches:

    src=build/llama.cpp/llama_cpp_python-0.3.36/vendor/llama.cpp
    cmake -S $src -B build/llama.cpp/ggml-shared -DCMAKE_BUILD_TYPE=Release \\
        -DBUILD_SHARED_LIBS=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \\
        -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF
    cmake --build build/llama.cpp/ggml-shared --target ggml-cpu -j2
    .venv/bin/python -m benchmarks.ggml_dot [--lib build/llama.cpp/ggml-shared/bin] \\
        [--cpu-isa auto avx2]
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import torch

from kernels.cpu import dispatch, ops
from kernels.cpu.formats import Blocks, WeightType, random_blocks

DEFAULT_LIB = Path("build/llama.cpp/ggml-shared/bin")
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
TYPES = (WeightType.Q4_0, WeightType.Q4_1, WeightType.Q8_0, WeightType.Q4_K, WeightType.Q6_K)

# y[j] = vec_dot(row j, the quantized input) for every row: ggml's GEMV at one input row.
_LOOP = r"""
#include <stddef.h>
#include <stdint.h>
typedef void (*vec_dot_t)(int, float *, size_t, const void *, size_t, const void *, size_t, int);
void ggml_rows(vec_dot_t dot, int k, const uint8_t *w, size_t row_bytes, const void *xq,
               float *y, int64_t n) {
    for (int64_t j = 0; j < n; j++) dot(k, y + j, 0, w + j * row_bytes, 0, xq, 0, 1);
}
"""


class Traits(ctypes.Structure):
    _fields_ = [
        ("from_float", ctypes.c_void_p),
        ("vec_dot", ctypes.c_void_p),
        ("vec_dot_type", ctypes.c_int),
        ("nrows", ctypes.c_int64),
    ]


class Ggml:
    """ggml's CPU dot products through ctypes and the C loop above."""

    def __init__(self, lib_dir: Path, work: Path) -> None:
        self.base = ctypes.CDLL(str(lib_dir / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
        self.cpu = ctypes.CDLL(str(lib_dir / "libggml-cpu.so"))
        self.cpu.ggml_cpu_init()
        self.cpu.ggml_get_type_traits_cpu.restype = ctypes.POINTER(Traits)
        self.base.ggml_row_size.restype = ctypes.c_size_t
        self.base.ggml_row_size.argtypes = (ctypes.c_int, ctypes.c_int64)
        source = work / "ggml_rows.c"
        source.write_text(_LOOP)
        shim = work / "ggml_rows.so"
        subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(shim), str(source)], check=True)
        self.loop = ctypes.CDLL(str(shim)).ggml_rows
        self.loop.restype = None

    def gemv(self, weight: Blocks) -> Callable[[torch.Tensor], torch.Tensor]:
        """A function of x [1, k] fp32 -> y [1, n], ggml's way."""
        traits = self.cpu.ggml_get_type_traits_cpu(int(weight.kind)).contents
        xq = ctypes.create_string_buffer(self.base.ggml_row_size(traits.vec_dot_type, weight.k))
        # the input's type quantizes the input (a type's own from_float makes weights of it)
        input_traits = self.cpu.ggml_get_type_traits_cpu(traits.vec_dot_type).contents
        from_float = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)(
            input_traits.from_float
        )
        n, k = weight.n, weight.k

        def run(x: torch.Tensor) -> torch.Tensor:
            y = torch.empty(1, n)
            from_float(x.data_ptr(), ctypes.addressof(xq), k)
            self.loop(
                ctypes.c_void_p(traits.vec_dot), ctypes.c_int(k),
                ctypes.c_void_p(weight.data.data_ptr()), ctypes.c_size_t(weight.data.shape[1]),
                xq, ctypes.c_void_p(y.data_ptr()), ctypes.c_int64(n),
            )  # fmt: skip
            return y

        return run


def _best_ms(fn: Callable[[], object], reps: int = 50) -> float:
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - start) / reps)
    return best * 1e3


def _error(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    """The largest |y - x w^T| over sum |x w|, against float64."""
    want = x.double() @ w.double().t()
    scale = x.double().abs() @ w.double().abs().t()
    return float(((y.double() - want).abs() / scale).max())


def _row(kind: WeightType, ggml: Ggml, isas: list[str], gen: torch.Generator) -> str:
    """One type's table row: each version's and ggml's milliseconds, then the errors."""
    weights = [random_blocks(kind, n, _k(kind, k), gen) for n, k in SHAPES]
    xs = {w.k: torch.randn(1, w.k, generator=gen) for w in weights}
    theirs = [(ggml.gemv(w), w) for w in weights]
    ours = [dispatch.select(isa) for isa in isas]
    times = []
    for kernels in ours:
        assert kernels is not None
        times.append(_best_ms(functools.partial(_ours, kernels, weights, xs)))
    ggml_ms = _best_ms(lambda: [fn(xs[w.k]) for fn, w in theirs])
    our_err = ggml_err = 0.0
    for (fn, w), kernels in zip(theirs, ours * len(theirs), strict=False):
        assert kernels is not None
        dense = _dequantized(w)
        our_err = max(our_err, _error(ops.gemv(kernels, w, xs[w.k]), xs[w.k], dense))
        ggml_err = max(ggml_err, _error(fn(xs[w.k]), xs[w.k], dense))
    cells = " | ".join(f"{t:.3f}" for t in times)
    return f"| {kind.name} | {cells} | {ggml_ms:.3f} | {our_err:.1e} | {ggml_err:.1e} |"


def _ours(kernels: dispatch.KernelSet, weights: list[Blocks], xs: dict[int, torch.Tensor]) -> None:
    for w in weights:
        ops.gemv(kernels, w, xs[w.k])


def _k(kind: WeightType, k: int) -> int:
    """The K types take whole super-blocks of 256: 512 where the model's 576 has none."""
    return 512 if kind >= WeightType.Q4_K and k % 256 else k


def _dequantized(weight: Blocks) -> torch.Tensor:
    kind = gguf.GGMLQuantizationType(int(weight.kind))
    return torch.from_numpy(np.array(gguf.quants.dequantize(weight.data.numpy(), kind)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lib", type=Path, default=DEFAULT_LIB)
    parser.add_argument("--cpu-isa", nargs="+", default=["auto"])
    args = parser.parse_args(argv)
    if not (args.lib / "libggml-cpu.so").is_file():
        print(
            f"SKIPPED: no libggml-cpu.so in {args.lib} (see the top of this file)", file=sys.stderr
        )
        return 0
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    print(f"ggml_dot on {dispatch.cpu_description()}: one thread, batch 1, one layer's matrices")
    print()
    print("| type | " + " | ".join(f"pagechat {i} ms" for i in args.cpu_isa) + " | ggml ms | "
          "pagechat error | ggml error |")  # fmt: skip
    print("|---|" + "---:|" * (len(args.cpu_isa) + 3))
    with tempfile.TemporaryDirectory() as work:
        ggml = Ggml(args.lib, Path(work))
        for kind in TYPES:
            print(_row(kind, ggml, args.cpu_isa, gen))
    return 0


if __name__ == "__main__":
    sys.exit(main())
