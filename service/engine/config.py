"""Engine configuration: one validated dataclass, documented defaults.

Defaults were chosen by measuring on the 2-core CPU machines this project runs on (see
docs/perf.md and ../shared/FACTS.md):
- dtype "auto" is bfloat16 on CUDA. On the CPU it is whichever of bfloat16 and float32 runs a
  decode-sized slice of the model (a projection and the paged attention) faster on this very
  CPU, timed once at start-up: on an AVX2-only EPYC bf16 matmuls ran ~7x slower than fp32; on
  an EPYC with AVX512-BF16 matmuls ran 2x faster in bf16 but CPU attention 5x slower, and
  fp32 decoded faster overall (docs/perf.md).
- num_threads 1: with 2 torch threads single steps stalled for seconds; 1 thread was faster
  and leaves a core for the event loop.
- block_size 16: the vLLM default; fragmentation stays under one block per sequence.
- max_num_batched_tokens 512: a prefill chunk of 512 tokens takes ~0.5 s in bf16 on the CPU,
  which bounds how long decoding sessions wait behind a new prompt.
"""

from __future__ import annotations

import enum
import functools
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from service.engine.blocks import AllocationMode


class PreemptionMode(enum.Enum):
    SWAP = "swap"  # move the victim's private blocks to the CPU pool, bring them back later
    RECOMPUTE = "recompute"  # drop the victim's blocks; re-prefill prompt + output later


@dataclass(slots=True)
class EngineConfig:
    model: str | Path | None = None  # None: the bundled SmolLM2-135M-Instruct GGUF
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    attention_backend: str = "auto"  # auto (triton on CUDA, torch on CPU) | torch | triton
    block_size: int = 16
    num_device_blocks: int | None = None  # None: from kv_cache_mb
    kv_cache_mb: int = 512
    num_cpu_blocks: int | None = None  # None: from swap_space_mb
    swap_space_mb: int = 512
    max_model_len: int = 4096
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    enable_prefix_caching: bool = True
    preemption_mode: PreemptionMode = PreemptionMode.SWAP
    allocation: AllocationMode = AllocationMode.PAGED
    cache_salt: str = ""  # tenants with different salts never share KV blocks
    seed: int = 0
    num_threads: int = 1

    def __post_init__(self) -> None:
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError("block_size must be a power of two up to 128")
        if self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # Every running sequence must be able to decode in the same step.
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs")
        if self.num_device_blocks is not None and self.num_device_blocks < 1:
            raise ValueError("num_device_blocks must be >= 1")
        if self.num_cpu_blocks is not None and self.num_cpu_blocks < 0:
            raise ValueError("num_cpu_blocks must be >= 0")
        if self.num_threads < 1:
            raise ValueError("num_threads must be >= 1")
        if isinstance(self.preemption_mode, str):
            self.preemption_mode = PreemptionMode(self.preemption_mode)
        if isinstance(self.allocation, str):
            self.allocation = AllocationMode(self.allocation)

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device().type == "cuda" else fastest_cpu_dtype()
        dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
        if self.dtype not in dtypes:
            raise ValueError(f"dtype must be auto or one of {sorted(dtypes)}")
        return dtypes[self.dtype]


@functools.cache
def fastest_cpu_dtype() -> torch.dtype:
    """bfloat16 if this CPU runs a decode-sized slice of the model clearly faster in bf16.

    The slice is what a decode step is made of: a projection (32 x 576 by 576 x 1536) and the
    attention of 32 sequences over 256 cached tokens (SDPA with a mask and GQA, as the torch
    backend runs it). A matmul alone misleads: on an EPYC with AVX512-BF16 the projection ran
    2x faster in bf16 but the attention 5x slower, and the engine decoded 25% slower in bf16
    at batch 32 (docs/perf.md).

    Trials alternate between the dtypes and the best of each counts, so a neighbour's load
    on a shared machine does not decide the choice. With one torch thread (the engine's
    default) the trials count this thread's CPU time, which time spent descheduled does not
    inflate at all.
    """
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(32, 576, generator=gen)  # [B, hidden]
    w = torch.randn(1536, 576, generator=gen)  # [intermediate, hidden]
    q = torch.randn(32, 9, 1, 64, generator=gen)  # [B, Hq, 1, D]
    kv = torch.randn(32, 3, 256, 64, generator=gen)  # [B, Hkv, C, D]
    mask = torch.ones(32, 1, 1, 256, dtype=torch.bool)

    def step(x: torch.Tensor, w: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> None:
        torch.nn.functional.linear(x, w)
        torch.nn.functional.scaled_dot_product_attention(q, kv, kv, attn_mask=mask, enable_gqa=True)

    best = {torch.float32: float("inf"), torch.bfloat16: float("inf")}
    for _ in range(3):
        for dtype in best:
            args = tuple(t.to(dtype) for t in (x, w, q, kv))
            step(*args)
            start = clock()
            for _ in range(2):
                step(*args)
            best[dtype] = min(best[dtype], clock() - start)
    return torch.bfloat16 if best[torch.bfloat16] < 0.8 * best[torch.float32] else torch.float32
