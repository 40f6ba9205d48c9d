"""The process's heap after loading: returned to the system instead of kept by the allocator.

Loading a model allocates and frees several times its size (the file's tensors copied, fused,
permuted; the kernel crossover trial's buffers). glibc keeps freed heap memory resident, and
after the first large free it raises its mmap threshold (up to 32 MiB), so later buffers of
that size come from the heap as well and stay resident when freed. On the bundled model that
held RSS nobody used (how much is not measured in docs/perf.md). Elsewhere than glibc these
are no-ops.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import logging

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_THRESHOLD = 1 << 20  # buffers of 1 MiB and more: their own mapping, unmapped when freed


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    if libc is None or not hasattr(libc, "malloc_trim") or not hasattr(libc, "mallopt"):
        return None
    return libc


@functools.cache
def tune_allocator() -> None:
    """Fixed thresholds (glibc's dynamic mmap threshold off), once per process."""
    libc = _glibc()
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, _THRESHOLD)
        libc.mallopt(_M_TRIM_THRESHOLD, _THRESHOLD)


def release_freed() -> None:
    """Collect garbage and hand the heap's free pages back to the system."""
    gc.collect()
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
