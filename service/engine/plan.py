"""What an EngineConfig comes to on this machine, resolved once: the plan the engine is built by.

`EngineConfig` holds the options as given ("auto" included) and runs nothing when read.
`plan_engine` is the one place that turns them into decisions: the device, the CPU kernel set
(built, loaded and probed: kernels/cpu/dispatch.py), whether a GGUF's blocks are served as
stored, the dtypes (running the start-up trial, service/engine/dtype_trial.py, only where an
"auto" dtype on the CPU needs it) and the native stack's threads. LLMEngine takes the plan
(or makes it from its config) and hands its values down; nothing below it reads the config's
"auto"s again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.cpu import dispatch, topology
from kernels.cpu.dispatch import KernelSet
from service.engine.config import PACKED_FORMATS, EngineConfig
from service.engine.dtype_trial import fastest_cpu_dtypes

# --weights names -> the dtype the loader and quant.py (`INT4`, `QUANTIZE_TO`) take them by.
WEIGHT_FORMATS: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "int8": torch.int8,
    "int4": torch.uint4,  # type: ignore[attr-defined]  # (missing from torch's stubs)
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class EnginePlan:
    """One engine's resolved choices (`plan_engine` says how each is made)."""

    device: torch.device
    cpu_kernels: KernelSet | None  # None off the CPU or without the kernel library
    serve_stored: bool  # a GGUF's quantized blocks served as the file stores them
    activation_dtype: torch.dtype
    # the matmul weights': a dense dtype, or torch.int8 / torch.uint4 naming a packed format
    weight_dtype: torch.dtype
    dense_dtype: torch.dtype  # what dense matmuls run in
    kv_cache_dtype: torch.dtype | None  # None: the loaded model's activations'
    native_threads: int  # the native decode stack's threads

    def kv_cache_for(self, activations: torch.dtype) -> torch.dtype:
        """The KV cache's dtype for a model with these activations."""
        return self.kv_cache_dtype or activations


def plan_engine(config: EngineConfig) -> EnginePlan:
    """Resolve `config` on this machine: every probe and trial an engine needs runs here."""
    device = _device(config.device)
    kernels = None
    if device.type == "cpu":
        inputs = "fp32" if config.matmul_inputs == "auto" else config.matmul_inputs
        kernels = dispatch.select(config.cpu_isa, inputs)
    all_auto = config.weights == config.weight_dtype == config.dtype == "auto"
    serve_stored = all_auto and kernels is not None
    packed = config.weights in PACKED_FORMATS
    if config.batch_invariant:
        if kernels is None or not (packed or serve_stored):
            raise ValueError(
                "batch_invariant needs the CPU kernels serving packed weights (a GGUF's blocks as"
                " stored, or weights int8 / int4) on the CPU"
            )
        kernels = kernels.with_batch_invariance()
    if packed and device.type != "cpu":
        raise ValueError(f"weights {config.weights} runs on the CPU only")
    if packed and kernels is None:
        raise ValueError(f"weights {config.weights} needs the CPU kernels (a C compiler)")
    activations = _activation_dtype(config, device, packed or serve_stored)
    dense = _dense_dtype(config, device, activations, packed or serve_stored)
    return EnginePlan(
        device=device,
        cpu_kernels=kernels,
        serve_stored=serve_stored,
        activation_dtype=activations,
        weight_dtype=WEIGHT_FORMATS[config.weights] if config.weights != "auto" else dense,
        dense_dtype=dense,
        kv_cache_dtype=_kv_cache_dtype(config, device, kernels),
        native_threads=native_threads(config.decode_threads),
    )


def native_threads(decode_threads: int) -> int:
    """The native decode stack's threads: `decode_threads`, or with 0 the physical cores this
    process may run on, never more than the CPUs it may run on (on one CPU a helper thread
    would only take turns with the thread waiting for it)."""
    cpus = topology.usable_cpus()
    wanted = decode_threads or topology.physical_cores(cpus)
    return min(wanted, len(cpus), topology.MAX_THREADS)


def dtype_name(dtype: torch.dtype) -> str:
    """The name the options take: "bfloat16" for torch.bfloat16."""
    return str(dtype).removeprefix("torch.")


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _activation_dtype(config: EngineConfig, device: torch.device, packed: bool) -> torch.dtype:
    if config.dtype != "auto":
        return DTYPES[config.dtype]
    if device.type == "cuda":
        return torch.bfloat16
    if packed:
        # The CPU kernels take fp32 inputs and compute in fp32 through: the bf16-activation
        # trial's win does not apply.
        return torch.float32
    return fastest_cpu_dtypes().activations


def _dense_dtype(
    config: EngineConfig, device: torch.device, activations: torch.dtype, packed: bool
) -> torch.dtype:
    """The weights' dtype when they are dense; fp32 for packed weights above their crossover
    (prefill, mixed steps), which dequantize each weight exactly and multiply in fp32, so that
    a prompt's K/V are the fp32 model's as the decode steps' are (bf16 there moved the bundled
    model's logits by 0.25)."""
    if config.weights in ("fp32", "bf16"):
        return WEIGHT_FORMATS[config.weights]
    if packed:
        return torch.float32
    if config.weight_dtype != "auto":
        return DTYPES[config.weight_dtype]
    if config.dtype == "auto" and device.type == "cpu":
        return fastest_cpu_dtypes().weights
    return activations


def _kv_cache_dtype(
    config: EngineConfig, device: torch.device, kernels: KernelSet | None
) -> torch.dtype | None:
    if config.kv_cache_dtype != "auto":
        return DTYPES[config.kv_cache_dtype]
    if (
        device.type == "cpu"
        and config.attention_backend in ("auto", "torch")
        and kernels is not None
    ):
        # fp16, not bf16: three more bits of mantissa, the same bytes, and every version
        # widens it fast (F16C, NEON in hardware; the generic one a whole row at a time)
        return torch.float16
    return None
