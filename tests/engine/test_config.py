"""EngineConfig, plain values checked when made, and the plan it resolves to (plan_engine): the
device, the CPU kernels, the activations' (and KV cache's) and the matmul weights' dtypes."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.cpu import build, dispatch
from service.engine.config import MATMUL_INPUTS, PACKED_FORMATS, EngineConfig
from service.engine.dtype_trial import CPU_CHOICES, CpuDtypes, fastest_cpu_dtypes
from service.engine.engine import LLMEngine
from service.engine.params import SamplingParams
from service.engine.plan import WEIGHT_FORMATS, plan_engine
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


@pytest.mark.server
def test_reading_an_engine_config_runs_nothing() -> None:
    # Made and read in a fresh interpreter: no torch, no kernel library, no dtype trial is
    # imported, so none can have run (plan_engine resolves them, once).
    code = (
        "import dataclasses, sys\n"
        "from service.engine.config import EngineConfig\n"
        "config = EngineConfig(model='m.gguf', cpu_isa='generic', matmul_inputs='int8')\n"
        "values = [getattr(config, f.name) for f in dataclasses.fields(config)]\n"
        "heavy = ('torch', 'kernels.cpu.dispatch', 'kernels.cpu.library',\n"
        "         'service.engine.dtype_trial', 'service.engine.plan')\n"
        "print(sorted(m for m in heavy if m in sys.modules), len(values))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[]", str(len(dataclasses.fields(EngineConfig)))]


def test_the_config_names_the_matmul_inputs_the_kernels_take() -> None:
    # config names them without importing the kernels: the two must agree.
    assert MATMUL_INPUTS == dispatch.MATMUL_INPUTS


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_weights_follow_an_explicit_dtype(dtype: str) -> None:
    plan = plan_engine(EngineConfig(dtype=dtype, device="cpu"))
    assert plan.weight_dtype == plan.activation_dtype == getattr(torch, dtype)
    assert not plan.serve_stored


def test_an_explicit_weight_dtype_wins() -> None:
    plan = plan_engine(EngineConfig(dtype="float32", weight_dtype="bfloat16", device="cpu"))
    assert (plan.activation_dtype, plan.weight_dtype) == (torch.float32, torch.bfloat16)


def test_auto_without_the_cpu_kernels_takes_one_of_the_timed_choices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(dispatch, "select", lambda *_: None)  # as with no C compiler
    plan = plan_engine(EngineConfig(device="cpu"))
    assert not plan.serve_stored and plan.cpu_kernels is None
    chosen = CpuDtypes(plan.activation_dtype, plan.weight_dtype)
    assert chosen in CPU_CHOICES
    assert chosen == fastest_cpu_dtypes()  # timed once per process
    assert plan.kv_cache_for(plan.activation_dtype) == plan.activation_dtype


def test_auto_on_the_cpu_with_the_kernels_serves_the_blocks_stored_in_fp32() -> None:
    plan = plan_engine(EngineConfig(device="cpu"))
    assert plan.serve_stored and plan.cpu_kernels is not None
    assert plan.activation_dtype == plan.dense_dtype == torch.float32
    assert plan.kv_cache_for(torch.float32) == torch.float16


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_packed_weights_run_with_fp32_activations_whatever_the_trial_says(weights: str) -> None:
    # The native kernels and decoder stack take fp32 and the CPU attention reads an fp32
    # cache in place: a bf16 win in the dense trial says nothing about them.
    plan = plan_engine(EngineConfig(device="cpu", weights=weights))
    assert plan.activation_dtype == plan.dense_dtype == torch.float32


def test_the_packed_weight_formats_are_the_dtypes_quant_packs() -> None:
    # config names them without importing quant.py: the two must agree.
    assert {WEIGHT_FORMATS[name] for name in PACKED_FORMATS} == set(QUANTIZE_TO)


@pytest.mark.parametrize("option", ["dtype", "weight_dtype", "kv_cache_dtype"])
def test_an_unknown_dtype_name_is_refused_by_its_option_when_made(option: str) -> None:
    with pytest.raises(ValueError, match=f"^{option} must be auto or one of"):
        EngineConfig(device="cpu", **{option: "float8"})


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
    assert plan_engine(config).weight_dtype == dtype


def test_a_cpu_kernel_version_is_checked_by_name_then_against_this_cpu() -> None:
    with pytest.raises(ValueError, match="cpu_isa must be auto or one of"):
        EngineConfig(cpu_isa="sse2")
    other = "neon" if build.machine() == "x86_64" else "avx2"
    with pytest.raises(ValueError, match="unknown CPU kernel version"):
        plan_engine(EngineConfig(cpu_isa=other, device="cpu"))
    chosen = plan_engine(EngineConfig(cpu_isa="generic", device="cpu")).cpu_kernels
    assert chosen is not None and chosen.isa == "generic"


def test_weights_is_refused_unknown_beside_weight_dtype_or_packed_off_the_cpu() -> None:
    with pytest.raises(ValueError, match=r"^weights must be auto or one of"):
        EngineConfig(weights="q4_k")
    with pytest.raises(ValueError, match="not both"):
        EngineConfig(weights="int4", weight_dtype="bfloat16")
    with pytest.raises(ValueError, match="CPU only"):
        plan_engine(EngineConfig(weights="int4", device="cuda"))


def test_an_engine_with_int4_weights_decodes_and_releases_its_blocks(tiny_model_dir: Path) -> None:
    engine = engine_that_decoded(tiny_model_dir, weights="int4")
    assert engine.runner.model.weights_name == "Q4_1"  # what a dense weight quantizes to
    assert engine.runner.device_pool.dtype == torch.float16


def test_kv_pool_pages_is_lazy_or_eager() -> None:
    assert EngineConfig().kv_pool_pages == "lazy"
    assert EngineConfig(kv_pool_pages="eager").kv_pool_pages == "eager"
    with pytest.raises(ValueError, match="kv_pool_pages"):
        EngineConfig(kv_pool_pages="now")
