"""The CPU dtype trial (service/engine/dtype_trial.py): what it times and how it picks."""

from __future__ import annotations

import pytest

from service.engine.dtype_trial import CPU_CHOICES, CpuDtypes, fastest_cpu_dtypes, pick_cpu_dtypes

FP32, MIXED, BF16 = CPU_CHOICES


def test_the_trial_picks_one_of_its_choices_once_per_process() -> None:
    chosen = fastest_cpu_dtypes()
    assert chosen in CPU_CHOICES
    assert fastest_cpu_dtypes() is chosen  # timed once, then remembered


@pytest.mark.parametrize(
    ("fp32", "mixed", "bf16", "chosen"),
    [
        # The first two as measured: docs/perf-history.md, "Engine: `benchmarks/engine_step.py`
        # with dense dtypes" (the trial's 1.00 / 0.65 / 2.0; bf16 matmuls ~7x fp32's on AVX2).
        (1.0, 0.65, 2.0, MIXED),  # fast bf16 matmuls, slow bf16 attention
        (1.0, 3.0, 7.0, FP32),  # slow bf16 matmuls
        (1.0, 0.85, 2.0, FP32),  # 15% faster is not worth the rounding
        (1.0, 0.7, 0.5, BF16),  # native bf16 everywhere: each step 20% faster
        (1.0, 0.9, 0.75, BF16),  # judged against fp32, still held
        (1.0, 0.7, 0.6, MIXED),  # all-bf16 must beat mixed, not only fp32
    ],
)
def test_the_trial_takes_a_less_precise_choice_only_where_it_is_20_percent_faster(
    fp32: float, mixed: float, bf16: float, chosen: CpuDtypes
) -> None:
    assert pick_cpu_dtypes({FP32: fp32, MIXED: mixed, BF16: bf16}) == chosen
