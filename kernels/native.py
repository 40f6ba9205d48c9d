"""native.c, compiled once per machine and called through ctypes: the CPU kernels torch has
no op for.

- The packed weights' dense path (`quant.QuantLinear` above its crossover) dequantizes a
  layer's weight into a scratch buffer, then runs a dense GEMM: eager torch takes ~17 ms per
  decoder layer for what the C loop does in ~1 ms (docs/perf.md).
- `int8_gemv`: the int8 LM head at decode with fp32 logits.
- `paged_decode`: decode attention read in place through the paged cache (the CPU
  attention backend's decode path, kernels/backend.py).
- `int4_vnni_gemv` / `pack_int4_vnni` / `dequantize_int4_vnni`: int4 weights in the VNNI
  layout on CPUs with AVX512-VNNI (`has_vnni`), their input as two int8 digits per group.
- `DecoderStack`: every decoder layer of a decode step in one call, for int4 models in the
  VNNI layout (service/engine/model.py, `native_decoder_stack`), on one or two threads.

NOTE: built with -march=native, so the library is cached under a key of the source, the
compiler command and this CPU's feature flags: a cache directory shared between machines
never hands one CPU's instructions to another. Where no C compiler is found (a slim image)
or the library disagrees with torch's packing on a probe, `library()` is None and the packed
formats run their packed kernel at every batch size (slower prefill, same results).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from kernels.metadata import AttentionMetadata

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native.c")
_FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-std=gnu11", "-pthread")


def cache_dir() -> Path:
    """Where built libraries live: $PAGECHAT_CACHE_DIR, else the user's cache directory."""
    if explicit := os.environ.get("PAGECHAT_CACHE_DIR"):
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pagechat"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def build_command(compiler: str, target: str, march: str = "native") -> list[str]:
    """How native.c is compiled: here for this CPU, or by the Dockerfile for a baseline."""
    flags = [f if f != "-march=native" else f"-march={march}" for f in _FLAGS]
    return [compiler, *flags, "-o", target, str(SOURCE)]


def _build(compiler: str) -> Path:
    source = SOURCE.read_bytes()
    key = hashlib.sha256(
        b"\0".join([source, compiler.encode(), " ".join(_FLAGS).encode(), _cpu_flags().encode()])
    ).hexdigest()[:16]
    target = cache_dir() / f"libpagechat_native-{platform.machine()}-{key}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built beside the target, then renamed: a concurrent start never loads half a file.
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        subprocess.run(
            build_command(compiler, tmp),
            check=True,
            capture_output=True,
            timeout=120,
        )
        os.replace(tmp, target)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return target


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built library, or None (logged once) where it cannot be built or fails the probe.

    $PAGECHAT_NATIVE_LIB names a library built beforehand (the Docker image builds one for
    x86-64-v3 CPUs, AVX2 and FMA, in a stage with a compiler): it is loaded as it is."""
    prebuilt = os.environ.get("PAGECHAT_NATIVE_LIB")
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if prebuilt is None and compiler is None:
        log.warning("no C compiler: packed weights run their packed kernel at every batch size")
        return None
    try:
        lib = ctypes.CDLL(prebuilt or str(_build(compiler or "cc")))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        log.warning("could not build %s (%s %s)", SOURCE.name, exc, detail.decode()[-500:])
        return None
    for fn in (lib.pagechat_dequant_int4, lib.pagechat_dequant_int8):
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 6
    lib.pagechat_int8_gemv.restype = None
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    lib.pagechat_int8_gemv.argtypes = (pointer, size, pointer, pointer, pointer, *[size] * 4)
    lib.pagechat_int8_gemv_threads.restype = None
    lib.pagechat_int8_gemv_threads.argtypes = (
        pointer,
        size,
        pointer,
        pointer,
        pointer,
        *[size] * 3,
    )
    lib.pagechat_int4_gemv.restype = ctypes.c_int
    lib.pagechat_int4_gemv.argtypes = (pointer, size, pointer, pointer, pointer, *[size] * 4)
    lib.pagechat_rms_norm.restype = None
    lib.pagechat_rms_norm.argtypes = (*[pointer] * 3, size, size, ctypes.c_float)
    lib.pagechat_paged_decode.restype = ctypes.c_int
    lib.pagechat_paged_decode.argtypes = (
        *[pointer] * 6,
        *[size] * 4,
        ctypes.c_float,
        size,
        size,
    )
    lib.pagechat_has_vnni.restype = ctypes.c_int
    lib.pagechat_has_vnni.argtypes = ()
    lib.pagechat_int4_vnni_gemv.restype = ctypes.c_int
    lib.pagechat_int4_vnni_gemv.argtypes = (pointer, size, pointer, pointer, pointer, size, size)
    lib.pagechat_dequant_int4_vnni.restype = None
    lib.pagechat_dequant_int4_vnni.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 6
    lib.pagechat_decode_layers.restype = ctypes.c_int
    lib.pagechat_decode_layers.argtypes = (
        *[pointer] * 3,
        size,
        *[pointer] * 4,
        size,
        size,
        pointer,
        size,
        pointer,
    )
    if not _probe(lib):
        log.warning("%s disagrees with torch's int4 packing: not used", SOURCE.name)
        return None
    return lib


def _probe(lib: ctypes.CDLL) -> bool:
    """Dequantize a small packed weight (a full tile and a narrow tail) and compare."""
    gen = torch.Generator().manual_seed(0)
    n, k = 80, 64
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    pairs = torch.randn(k // 32, n, 2, generator=gen).to(torch.bfloat16)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
    got = torch.empty(k, n, dtype=torch.bfloat16)  # transposed
    lib.pagechat_dequant_int4(packed.data_ptr(), pairs.data_ptr(), got.data_ptr(), n, k, 0, n, n, 0)
    scale, zero = pairs.float().unbind(-1)  # [K/32, N] each
    want = (q.float() - 8).view(n, k // 32, 32) * scale.t()[..., None] + zero.t()[..., None]
    return torch.equal(got.t(), want.view(n, k).to(torch.bfloat16))


# NOTE: every kernel runs on the calling thread, never split across threads of ours: with
# two torch threads, torch's OpenMP worker spins for a while after each op, and a thread of
# ours for the other half fought it for the second core (a batch-1 step: 35 ms, not 15).

DENSE_DTYPES = (torch.bfloat16, torch.float32)  # what the dequantizers write


def _check(
    out: Tensor, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...], *ins: Tensor
) -> None:
    if out.shape != shape or out.dtype not in dtypes:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype}, want {shape} in {dtypes}")
    for t in (out, *ins):
        if not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError("the native functions take contiguous CPU tensors")


def _library_or_raise() -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise RuntimeError("the native library is not available")
    return lib


def _check_int8(q: Tensor, scales: Tensor, rows: tuple[int, int]) -> None:
    n, k = q.shape
    if q.dtype != torch.int8 or scales.shape != (n,) or scales.dtype != torch.bfloat16:
        raise ValueError(f"int8 weight {tuple(q.shape)} {q.dtype}, scales {tuple(scales.shape)}")
    if not 0 <= rows[0] < rows[1] <= n:
        raise ValueError(f"rows {rows} of [{n}, {k}]")


def dequantize_int4(packed: Tensor, pairs: Tensor, out: Tensor, rows: tuple[int, int]) -> Tensor:
    """Rows [rows) of an int4 weight, dense: packed [N, K/2] uint8 in torch's CPU layout,
    pairs [K/32, N, 2] bf16 (scale, zero). `out` is [K, rows] bf16 or fp32 (the block
    transposed, which the C loop writes fastest); returns it as the [rows, K] view F.linear
    takes. Rows begin and end on tiles of 64 (or at N)."""
    lib = _library_or_raise()
    n, k = packed.shape[0], packed.shape[1] * 2
    first, last = rows
    if (
        packed.dtype != torch.uint8
        or pairs.shape != (k // 32, n, 2)
        or pairs.dtype != torch.bfloat16
    ):
        raise ValueError(f"packed {tuple(packed.shape)} {packed.dtype}, pairs {pairs.shape}")
    if k % 32 or n % 16 or not 0 <= first < last <= n or first % 64 or (last % 64 and last != n):
        raise ValueError(f"rows {rows} of [{n}, {k}]: needs K % 32, N % 16, tiles of 64")
    _check(out, (k, last - first), DENSE_DTYPES, packed, pairs)
    fp32 = int(out.dtype == torch.float32)

    lib.pagechat_dequant_int4(
        packed.data_ptr(), pairs.data_ptr(), out.data_ptr(), n, k, first, last, last - first, fp32
    )
    return out.t()


def dequantize_int8(q: Tensor, scales: Tensor, out: Tensor, rows: tuple[int, int]) -> Tensor:
    """Rows [rows) of an int8 weight, dense: q [N, K] int8, scales [N] bf16; out is
    [rows, K] bf16 or fp32, overwritten and returned."""
    lib = _library_or_raise()
    _check_int8(q, scales, rows)
    n, k = q.shape
    first, last = rows
    _check(out, (last - first, k), DENSE_DTYPES, q, scales)
    fp32 = int(out.dtype == torch.float32)

    lib.pagechat_dequant_int8(
        q.data_ptr(), scales.data_ptr(), out.data_ptr(), n, k, first, last, k, fp32
    )
    return out


def int8_gemv(x: Tensor, q: Tensor, scales: Tensor, threads: int = 1) -> Tensor:
    """x [M, K] fp32 times an int8 weight q [N, K] with bf16 row scales: [M, N] fp32,
    accumulated in fp32 (torch's int8 kernel rounds its output to bf16). For few rows: it
    reads the weight once but computes each row's dot products without blocking. At two
    `threads` the weight rows are split with the library's helper thread (where it is free
    and the library has it)."""
    lib = _library_or_raise()
    n, k = q.shape
    _check_int8(q, scales, (0, n))
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"input {tuple(x.shape)} {x.dtype} for a [{n}, {k}] weight")
    m = x.shape[0]
    x = x.contiguous()
    y = torch.empty(m, n, dtype=torch.float32)
    _check(y, (m, n), (torch.float32,), x, q, scales)
    lib.pagechat_int8_gemv_threads(
        x.data_ptr(), m, q.data_ptr(), scales.data_ptr(), y.data_ptr(), n, k, threads
    )
    return y


def int4_gemv(x: Tensor, packed: Tensor, pairs: Tensor) -> Tensor | None:
    """x [M, K] fp32 times an int4 weight in torch's CPU layout (packed [N, K/2] uint8, pairs
    [K/32, N, 2] bf16): [M, N] fp32, accumulated in fp32. None where the library was built
    without AVX512 or N is not whole tiles of 64: then torch's kernel is the one to run."""
    lib = _library_or_raise()
    n, k = packed.shape[0], packed.shape[1] * 2
    if (
        packed.dtype != torch.uint8
        or pairs.shape != (k // 32, n, 2)
        or pairs.dtype != torch.bfloat16
    ):
        raise ValueError(f"packed {tuple(packed.shape)} {packed.dtype}, pairs {pairs.shape}")
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"input {tuple(x.shape)} {x.dtype} for a [{n}, {k}] weight")
    if n % 64 or k % 32:
        return None
    x = x.contiguous()
    m = x.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    _check(y, (m, n), (torch.float32,), x, packed, pairs)
    declined = lib.pagechat_int4_gemv(
        x.data_ptr(), m, packed.data_ptr(), pairs.data_ptr(), y.data_ptr(), n, k, 0, n
    )
    return None if declined else y


def has_vnni() -> bool:
    """Whether int4 weights can take the VNNI layout here (built with AVX512-VNNI)."""
    lib = library()
    return lib is not None and bool(lib.pagechat_has_vnni())


VNNI_TILE = 16  # output rows per tile of the VNNI layout


def pack_int4_vnni(q: Tensor) -> Tensor:
    """q [N, K] (values 0..15) in the VNNI layout (native.c, pagechat_int4_vnni_gemv):
    [N, K/2] uint8. N a multiple of 16, K of 32."""
    n, k = q.shape
    if n % VNNI_TILE or k % 32:
        raise ValueError(f"the VNNI layout takes N % 16 and K % 32, not [{n}, {k}]")
    # k = 32 g + 8 s + 4 h + i; byte 4 j + i of run (t, g, s) holds h = 0 low, h = 1 high
    v = q.to(torch.uint8).view(n // VNNI_TILE, VNNI_TILE, k // 32, 4, 2, 4)  # t j g s h i
    v = v.permute(0, 2, 3, 1, 5, 4)  # t g s j i h
    packed = v[..., 0] | (v[..., 1] << 4)  # [T, G, 4, 16, 4]
    return packed.contiguous().view(n, k // 2)


def _check_int4_vnni(packed: Tensor, pairs: Tensor) -> tuple[int, int]:
    n, k = packed.shape[0], packed.shape[1] * 2
    if (
        packed.dtype != torch.uint8
        or pairs.shape != (k // 32, n, 2)
        or pairs.dtype != torch.bfloat16
        or n % VNNI_TILE
        or k % 32
    ):
        raise ValueError(f"packed {tuple(packed.shape)} {packed.dtype}, pairs {pairs.shape}")
    return n, k


def int4_vnni_gemv(x: Tensor, packed: Tensor, pairs: Tensor) -> Tensor:
    """x [M, K] fp32 times an int4 weight in the VNNI layout: [M, N] fp32. The input goes in
    as two int8 digits per group of 32 (native.c says how), the products summed in int32."""
    lib = _library_or_raise()
    n, k = _check_int4_vnni(packed, pairs)
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"input {tuple(x.shape)} {x.dtype} for a [{n}, {k}] weight")
    x = x.contiguous()
    m = x.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    _check(y, (m, n), (torch.float32,), x, packed, pairs)
    status = lib.pagechat_int4_vnni_gemv(
        x.data_ptr(), m, packed.data_ptr(), pairs.data_ptr(), y.data_ptr(), n, k
    )
    if status == 2:
        raise MemoryError("pagechat_int4_vnni_gemv could not allocate")
    if status:
        raise RuntimeError("the library was built without AVX512-VNNI")
    return y


def dequantize_int4_vnni(
    packed: Tensor, pairs: Tensor, out: Tensor, rows: tuple[int, int]
) -> Tensor:
    """`dequantize_int4` for the VNNI layout: rows on tiles of 16."""
    lib = _library_or_raise()
    n, k = _check_int4_vnni(packed, pairs)
    first, last = rows
    if not 0 <= first < last <= n or first % VNNI_TILE or last % VNNI_TILE:
        raise ValueError(f"rows {rows} of [{n}, {k}]: tiles of 16")
    _check(out, (k, last - first), DENSE_DTYPES, packed, pairs)
    fp32 = int(out.dtype == torch.float32)
    lib.pagechat_dequant_int4_vnni(
        packed.data_ptr(), pairs.data_ptr(), out.data_ptr(), n, k, first, last, last - first, fp32
    )
    return out.t()


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm of each row of x [..., D] scaled by weight [D], fp32 in and out: one call where
    torch's CPU rms_norm is six ops. Not checked beyond dtype and shape: it runs twice a
    layer, and the caller (model.RMSNorm) passes its own contiguous CPU tensors."""
    lib = _library_or_raise()
    d = weight.shape[0]
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or x.shape[-1] != d:
        raise ValueError(f"rms_norm of {tuple(x.shape)} {x.dtype} by {tuple(weight.shape)}")
    x = x.contiguous()
    out = torch.empty_like(x)
    lib.pagechat_rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // d, d, eps)
    return out


def paged_decode(
    query: Tensor,  # [B, Hq, D] fp32
    key_cache: Tensor,  # [N, bs, Hkv, D] fp32, contiguous
    value_cache: Tensor,  # [N, bs, Hkv, D] fp32, contiguous
    slots: Tensor,  # [B, C] int64: row b's first seq_lens[b] entries are its context slots
    seq_lens: Tensor,  # [B] int64, each in 1..C
    scale: float,
) -> Tensor:  # [B, Hq, D] fp32
    """Each sequence's one new query over its whole context, read in place through its cache
    slots (no gathered K/V copy, no padding computed). The caller guarantees the slots were
    written (the plan's); their values are not checked here, only shapes, dtypes, layout."""
    lib = _library_or_raise()
    b, hq, d = query.shape
    hkv = key_cache.shape[2]
    if query.dtype != torch.float32 or key_cache.dtype != torch.float32:
        raise ValueError(f"paged_decode runs in fp32, got {query.dtype} and {key_cache.dtype}")
    if key_cache.shape != value_cache.shape or key_cache.shape[3] != d or hq % hkv:
        raise ValueError(f"query {tuple(query.shape)} against caches {tuple(key_cache.shape)}")
    if slots.dtype != torch.int64 or slots.dim() != 2 or slots.shape[0] != b:
        raise ValueError(f"slots {tuple(slots.shape)} {slots.dtype} for {b} sequences")
    if seq_lens.dtype != torch.int64 or seq_lens.shape != (b,):
        raise ValueError(f"seq_lens {tuple(seq_lens.shape)} {seq_lens.dtype}")
    query = query.contiguous()
    out = torch.empty_like(query)
    _check(out, (b, hq, d), (torch.float32,), query, key_cache, value_cache, slots, seq_lens)
    context = slots.shape[1]

    failed = lib.pagechat_paged_decode(
        query.data_ptr(),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        slots.data_ptr(),
        seq_lens.data_ptr(),
        out.data_ptr(),
        hq,
        hkv,
        d,
        context,
        scale,
        0,
        b,
    )
    if failed:
        raise MemoryError("paged_decode could not allocate its scores")
    return out


class DecoderLayer(ctypes.Structure):
    """One decoder layer's weights and caches as pagechat_decode_layers reads them."""

    _fields_ = [
        ("packed", ctypes.c_void_p * 4),  # qkv, o_proj, gate_up, down: int4, VNNI layout
        ("pairs", ctypes.c_void_p * 4),  # their (scale, zero) pairs [K/32, N, 2] bf16
        ("attn_norm", ctypes.c_void_p),
        ("mlp_norm", ctypes.c_void_p),
        ("k_cache", ctypes.c_void_p),  # [slots, Hkv, D] fp32
        ("v_cache", ctypes.c_void_p),
    ]


class DecoderShape(ctypes.Structure):
    _fields_ = [
        ("num_layers", ctypes.c_int64),
        ("hidden", ctypes.c_int64),
        ("intermediate", ctypes.c_int64),
        ("num_q_heads", ctypes.c_int64),
        ("num_kv_heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("rms_norm_eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("cache_blocks", ctypes.c_int64),  # the KV pool's (set by DecoderStack)
        ("block_size", ctypes.c_int64),
    ]


@dataclass(frozen=True, slots=True)
class StackLayer:
    """The tensors of one layer the stack reads: each must outlive the stack (it keeps
    their addresses, not references the caller could drop)."""

    projections: tuple[tuple[Tensor, Tensor], ...]  # (packed, pairs) of qkv, o, gate_up, down
    attn_norm: Tensor  # [hidden] fp32
    mlp_norm: Tensor
    key_cache: Tensor  # [N, bs, Hkv, D] fp32, contiguous
    value_cache: Tensor


class DecoderStack:
    """Every decoder layer of a decode step in one native call (pagechat_decode_layers).

    Built once per model and KV pool: the layers' addresses go into a C array here, and
    each step passes only its rows. Holds references to every tensor it points at."""

    def __init__(self, shape: DecoderShape, layers: list[StackLayer], threads: int = 1) -> None:
        self._lib = _library_or_raise()
        if threads not in (1, 2):
            raise ValueError(f"the stack runs on one or two threads, not {threads}")
        if len(layers) != shape.num_layers:
            raise ValueError(f"{len(layers)} layers for a shape of {shape.num_layers}")
        table = (DecoderLayer * len(layers))()
        for entry, layer in zip(table, layers, strict=True):
            if len(layer.projections) != 4:
                raise ValueError("a layer has four projections: qkv, o_proj, gate_up, down")
            for i, (packed, pairs) in enumerate(layer.projections):
                if packed.dtype != torch.uint8 or pairs.dtype != torch.bfloat16:
                    raise ValueError(f"projection {i}: {packed.dtype} / {pairs.dtype}")
                _check(packed, tuple(packed.shape), (torch.uint8,), pairs)
                entry.packed[i], entry.pairs[i] = packed.data_ptr(), pairs.data_ptr()
            for t in (layer.attn_norm, layer.mlp_norm, layer.key_cache, layer.value_cache):
                _check(t, tuple(t.shape), (torch.float32,))
            entry.attn_norm, entry.mlp_norm = layer.attn_norm.data_ptr(), layer.mlp_norm.data_ptr()
            entry.k_cache, entry.v_cache = layer.key_cache.data_ptr(), layer.value_cache.data_ptr()
        pool = layers[0].key_cache  # [N, bs, Hkv, D]: every layer's alike
        if any(c.shape != pool.shape for lay in layers for c in (lay.key_cache, lay.value_cache)):
            raise ValueError("the layers' caches differ in shape")
        shape.cache_blocks, shape.block_size = pool.shape[0], pool.shape[1]
        self.shape = shape
        self._table = table
        self._layers = layers  # keeps what the table points at alive
        # Two: each projection split with the library's helper thread (pagechat_decode_layers).
        self.threads = threads
        # Set to a ctypes.c_int64 to have each call add its GEMVs' nanoseconds to it.
        self.matmul_ns: ctypes.c_int64 | None = None

    def __call__(self, x: Tensor, cos: Tensor, sin: Tensor, meta: AttentionMetadata) -> Tensor:
        """x [M, hidden] fp32 (the residual stream, updated in place and returned), cos and
        sin [M, D] (each row's RoPE rows, sin signed for rotate_half), `meta` a decode
        step's: one new token per sequence, its K/V written to `meta.slot_mapping`."""
        m = x.shape[0]
        if meta.num_tokens != m or meta.num_seqs != m or meta.max_query_len > 1:
            raise ValueError(f"{m} rows for a step of {meta.query_lens_host} tokens")
        if x.shape != (m, self.shape.hidden) or x.dtype != torch.float32:
            raise ValueError(f"x {tuple(x.shape)} {x.dtype}")
        _check(cos, (m, self.shape.head_dim), (torch.float32,), sin, x)
        _check(sin, (m, self.shape.head_dim), (torch.float32,))
        slots, tables, lens = meta.slot_mapping, meta.block_tables, meta.seq_lens
        _check(slots, (m,), (torch.int64,), tables, lens)
        if tables.dtype != torch.int32 or lens.dtype != torch.int32:
            raise ValueError("block tables and seq_lens are int32")
        # Write slots, blocks and lengths are checked against the pool in C (status 3).
        status = self._lib.pagechat_decode_layers(
            ctypes.addressof(self._table),
            ctypes.addressof(self.shape),
            x.data_ptr(),
            m,
            cos.data_ptr(),
            sin.data_ptr(),
            slots.data_ptr(),
            tables.data_ptr(),
            tables.shape[1],
            meta.block_size,
            lens.data_ptr(),
            self.threads,
            None if self.matmul_ns is None else ctypes.byref(self.matmul_ns),
        )
        if status == 1:
            raise MemoryError("pagechat_decode_layers could not allocate its work area")
        if status == 3:
            raise ValueError("a write slot, block or length outside the KV pool")
        if status:
            raise ValueError("pagechat_decode_layers declined these shapes (tiles of 16, VNNI)")
        return x
