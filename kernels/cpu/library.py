"""The CPU kernel library on this machine: built once into a cache (kernels/cpu/build.py), or
one built beforehand ($PAGECHAT_CPU_LIB, as the Docker image ships it), loaded through ctypes
with every entry point's prototype declared.

NOTE: the library holds every version of every kernel for its architecture and nothing for
the CPU that built it, so the cache key is the sources, the flags and the compiler: a cache
directory shared between machines of one architecture shares one file.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import shutil
import subprocess
from pathlib import Path

from kernels.cpu import build, structs

log = logging.getLogger(__name__)

P = ctypes.c_void_p
I64 = ctypes.c_int64
F32 = ctypes.c_float

# Every version's entry points (pc_<name>_<isa>), as kernels/cpu/src declares them.
PER_ISA_PROTOTYPES: dict[str, tuple[type | None, tuple[type, ...]]] = {
    "gemv": (I64, (I64, P, I64, P, I64, I64, P, I64, I64, I64)),
    "gemv_rowwise": (I64, (I64, P, I64, P, I64, I64, P, I64, I64, I64)),
    "gemv_q8": (I64, (I64, P, I64, P, I64, I64, P, I64, I64, I64)),
    "quantize_q8": (None, (P, I64, I64, P)),
    "q8_prepared_bytes": (I64, (I64, I64)),
    "q8_prepare": (None, (P, I64, I64, P)),
    "gemv_q8_prepared": (I64, (I64, P, I64, P, I64, I64, P, I64, I64, I64)),
    "dequant": (I64, (I64, P, I64, I64, I64, I64, P, I64, I64)),
    "dequant_rows": (I64, (I64, P, I64, I64, P, I64, P)),
    "attend": (I64, (P, I64, I64, I64)),
    "rms_norm": (None, (P, P, P, I64, I64, F32)),
    "rope_write": (None, (P, I64, I64, I64, I64, I64, P, P, P, P, P, I64)),
    "silu_mul": (None, (P, P, I64, I64, I64)),
    "gelu_tanh_mul": (None, (P, P, I64, I64, I64)),
    "sample": (I64, (P, I64, I64, I64, P, I64, P, P, P, P)),
}
ONCE_PROTOTYPES: dict[str, tuple[type | None, tuple[type, ...]]] = {
    "pc_cpu_runs": (I64, (ctypes.c_char_p,)),
    "pc_gemv_threads": (I64, (P, P, P, I64, P, I64)),
    "pc_decode_layers": (I64, (P, P, P, P, P, I64, P)),
    "pc_rows_x8": (I64, (I64, P, I64, I64, I64)),
}


def cache_dir() -> Path:
    """Where built libraries live: $PAGECHAT_CACHE_DIR, else the user's cache directory."""
    if explicit := os.environ.get("PAGECHAT_CACHE_DIR"):
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pagechat"


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def built_library(cc: str) -> Path:
    """This architecture's library in the cache, built there first if missing."""
    arch = build.machine()
    target = cache_dir() / f"libpagechat_cpu-{arch}-{build.source_key(cc, arch)}.so"
    if not target.is_file():
        build.build(cc, target, arch)
    return target


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded library, or None (logged once) where it cannot be had: no compiler and no
    $PAGECHAT_CPU_LIB, a failed build, or an architecture with no kernel versions."""
    prebuilt = os.environ.get("PAGECHAT_CPU_LIB")
    cc = compiler()
    if build.machine() not in build.ISAS:
        log.warning("no CPU kernels for %s: dense weights only", build.machine())
        return None
    if prebuilt is None and cc is None:
        log.warning("no C compiler and no PAGECHAT_CPU_LIB: the CPU kernels are off")
        return None
    try:
        lib = ctypes.CDLL(prebuilt or str(built_library(cc or "cc")))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        log.warning("could not build the CPU kernels (%s %s)", exc, detail.decode()[-800:])
        return None
    declare(lib)
    structs.check_layouts(lib)  # a mismatch raises: never run kernels on shifted fields
    return lib


def declare(lib: ctypes.CDLL) -> None:
    """Set every entry point's prototype; a missing symbol raises AttributeError."""
    for name, (restype, argtypes) in ONCE_PROTOTYPES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    for isa in build.isas(build.machine()):
        for kernel, (restype, argtypes) in PER_ISA_PROTOTYPES.items():
            fn = getattr(lib, f"pc_{kernel}_{isa.name}")
            fn.restype, fn.argtypes = restype, argtypes
