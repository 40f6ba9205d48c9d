"""EngineConfig's dtypes: the activations' (and KV cache's) and the matmul weights'."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernels.cpu import build
from service.engine.config import PACKED_FORMATS, WEIGHT_FORMATS, EngineConfig
from service.engine.dtype_trial import CPU_CHOICES, CpuDtypes, fastest_cpu_dtypes
from service.engine.engine import LLMEngine
from service.engine.params import SamplingParams
from service.engine.quant import QUANTIZE_TO
from tests.engine.greedy import run


def engine_that_decoded(model: Path, **options: str) -> LLMEngine:
    """An engine on `model` as `options` load it (float32 activations, on the CPU, small
    pools) once it has decoded 6 tokens for two prompts and released every block."""
    config = EngineConfig(
        model=model,
        dtype="float32",
        device="cpu",
        num_device_blocks=64,
        num_cpu_blocks=16,
        max_model_len=256,
        max_num_batched_tokens=64,
        **options,
    )
    engine = LLMEngine(config)
    prompts = {"a": list(range(100, 130)), "b": list(range(200, 211))}
    out = run(engine, prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert {rid: len(g.token_ids) for rid, g in out.items()} == {"a": 6, "b": 6}
    engine.check_balanced()
    return engine


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_weights_follow_an_explicit_dtype(dtype: str) -> None:
    config = EngineConfig(dtype=dtype, device="cpu")
    assert config.torch_weight_dtype() == config.torch_dtype() == getattr(torch, dtype)


def test_an_explicit_weight_dtype_wins() -> None:
    config = EngineConfig(dtype="float32", weight_dtype="bfloat16", device="cpu")
    assert (config.torch_dtype(), config.torch_weight_dtype()) == (torch.float32, torch.bfloat16)


def test_auto_on_the_cpu_takes_one_of_the_timed_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(EngineConfig, "serve_stored", lambda self: False)  # dense weights
    config = EngineConfig(device="cpu")
    chosen = CpuDtypes(config.torch_dtype(), config.torch_weight_dtype())
    assert chosen in CPU_CHOICES
    assert chosen == fastest_cpu_dtypes()  # timed once per process


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_packed_weights_run_with_fp32_activations_whatever_the_trial_says(weights: str) -> None:
    # The native kernels and decoder stack take fp32 and the CPU attention reads an fp32
    # cache in place: a bf16 win in the dense trial says nothing about them.
    assert EngineConfig(device="cpu", weights=weights).torch_dtype() == torch.float32


def test_the_packed_weight_formats_are_the_dtypes_quant_packs() -> None:
    # config names them without importing quant.py: the two must agree.
    assert {WEIGHT_FORMATS[name] for name in PACKED_FORMATS} == set(QUANTIZE_TO)


@pytest.mark.parametrize("option", ["dtype", "weight_dtype"])
def test_an_unknown_dtype_name_is_refused_by_its_option(option: str) -> None:
    config = EngineConfig(device="cpu", **{option: "float8"})
    with pytest.raises(ValueError, match=f"^{option} must be auto or one of"):
        config.torch_dtype() if option == "dtype" else config.torch_weight_dtype()


@pytest.mark.parametrize(
    ("kv_cache_dtype", "pools"), [("auto", torch.float16), ("float32", torch.float32)]
)
def test_the_kv_cache_is_float16_on_the_cpu_unless_told_otherwise(
    tiny_model_dir: Path, kv_cache_dtype: str, pools: torch.dtype
) -> None:
    engine = engine_that_decoded(
        tiny_model_dir, weight_dtype="bfloat16", kv_cache_dtype=kv_cache_dtype
    )
    assert (engine.activation_dtype, engine.weight_dtype) == (torch.float32, torch.bfloat16)
    assert engine.runner.device_pool.dtype == engine.runner.cpu_pool.dtype == pools


@pytest.mark.parametrize(
    ("weights", "dtype"),
    [
        ("fp32", torch.float32),
        ("bf16", torch.bfloat16),
        ("int8", torch.int8),
        ("int4", torch.uint4),
    ],
)
def test_the_weights_option_names_a_dense_dtype_or_a_packed_format(
    weights: str, dtype: torch.dtype
) -> None:
    config = EngineConfig(dtype="float32", weights=weights, device="cpu")
    assert config.torch_weight_dtype() == dtype


def test_a_cpu_kernel_version_is_checked_by_name_then_against_this_cpu() -> None:
    with pytest.raises(ValueError, match="cpu_isa must be auto or one of"):
        EngineConfig(cpu_isa="sse2")
    with pytest.raises(ValueError, match="kv_cache_dtype must be auto or one of"):
        EngineConfig(kv_cache_dtype="int8")
    other = "neon" if build.machine() == "x86_64" else "avx2"
    with pytest.raises(ValueError, match="unknown CPU kernel version"):
        EngineConfig(cpu_isa=other).cpu_kernels()
    chosen = EngineConfig(cpu_isa="generic").cpu_kernels()
    assert chosen is not None and chosen.isa == "generic"
    assert EngineConfig(device="cuda").cpu_kernels() is None


def test_weights_is_refused_unknown_beside_weight_dtype_or_packed_off_the_cpu() -> None:
    with pytest.raises(ValueError, match=r"^weights must be auto or one of"):
        EngineConfig(weights="q4_k")
    with pytest.raises(ValueError, match="not both"):
        EngineConfig(weights="int4", weight_dtype="bfloat16")
    with pytest.raises(ValueError, match="CPU only"):
        EngineConfig(weights="int4", device="cuda").torch_weight_dtype()


def test_an_engine_with_int4_weights_decodes_and_releases_its_blocks(tiny_model_dir: Path) -> None:
    engine = engine_that_decoded(tiny_model_dir, weights="int4")
    assert engine.runner.model.weights_name == "Q4_1"  # what a dense weight quantizes to
    assert engine.runner.device_pool.dtype == torch.float16


def test_kv_pool_pages_is_lazy_or_eager() -> None:
    assert EngineConfig().kv_pool_pages == "lazy"
    assert EngineConfig(kv_pool_pages="eager").kv_pool_pages == "eager"
    with pytest.raises(ValueError, match="kv_pool_pages"):
        EngineConfig(kv_pool_pages="now")
