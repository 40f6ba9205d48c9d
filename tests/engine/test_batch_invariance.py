"""Batch-invariant decoding (`EngineConfig.batch_invariant`): a seeded request's tokens are the
same alone and among other requests joining, prefilling and decoding around it, on every CPU
kernel version this CPU runs; and the kernels' rows are each computed as if alone."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu import ops
from kernels.cpu.dispatch import KernelSet
from kernels.cpu.formats import WeightType, random_blocks
from service.engine.config import MAX_INVARIANT_STEP_TOKENS, EngineConfig
from service.engine.engine import LLMEngine
from service.engine.params import SamplingParams
from service.engine.runner import MAX_NATIVE_ROWS
from tests.cpu_isa import cpu, cpu_isa
from tests.engine.greedy import run
from tests.tiny_model import gguf_tokenizer

__all__ = ["cpu", "cpu_isa"]  # fixtures

SEEDED = SamplingParams(temperature=1.0, seed=1234, max_tokens=48, ignore_eos=True)


def seeded_prompt() -> list[int]:
    return gguf_tokenizer().encode("Write a short poem about the sea and the wind.")


def others(count: int = 8) -> dict[str, list[int]]:
    """Eight other requests, prompts of 100 to 520 tokens: steps of up to 512 rows, prefill
    chunks beside the seeded request's decode steps. (Without batch invariance the seeded answer
    parted from its idle one at its 11th token here, on an AMD EPYC Zen 4.)"""
    words = "the river runs to the sea under a grey sky and the wind sings over the hills "
    return {f"other{i}": gguf_tokenizer().encode(words * (3 + 4 * i))[: 60 * i + 100]
            for i in range(count)}  # fmt: skip


def engine(cpu_isa: str, matmul_inputs: str = "auto") -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            batch_invariant=True, cpu_isa=cpu_isa, matmul_inputs=matmul_inputs,
            # No prefix cache: the seeded prompt is computed afresh in each run, among others.
            enable_prefix_caching=False, num_device_blocks=512, num_cpu_blocks=16,
            max_model_len=1024, max_num_batched_tokens=512,
        )
    )  # fmt: skip


def alone_and_among_others(engine: LLMEngine, count: int = 8) -> tuple[list[int], list[int]]:
    alone = run(engine, {"seeded": seeded_prompt()}, SEEDED)["seeded"].token_ids
    prompts = {**others(count), "seeded": seeded_prompt()}
    # The others join over the first steps, the seeded request third, so that its prefill
    # and its decode steps share steps with prefill chunks and decodes of every size.
    join_at = {**{f"other{i}": i // 2 for i in range(count)}, "seeded": 2}
    among = run(engine, prompts, SEEDED, join_at=join_at)["seeded"].token_ids
    engine.check_balanced()
    return alone, among


def test_a_seeded_answer_is_the_same_alone_and_among_other_requests(cpu_isa: str) -> None:
    # The generic version (plain C, 5x slower) among fewer: its rows are held to the same
    # bits by the kernel test below.
    alone, among = alone_and_among_others(engine(cpu_isa), 3 if cpu_isa == "generic" else 8)
    assert len(alone) == SEEDED.max_tokens and among == alone


def test_with_int8_inputs_too() -> None:
    alone, among = alone_and_among_others(engine("auto", matmul_inputs="int8"))
    assert among == alone


def test_a_rows_products_are_the_same_bits_at_any_number_of_rows(cpu: KernelSet) -> None:
    invariant = cpu.with_batch_invariance()
    gen = torch.Generator().manual_seed(11)
    for kind in WeightType:
        k = 2 * (256 if kind >= WeightType.Q4_K else 32)
        weight = random_blocks(kind, 24, k, gen)
        x = torch.randn(37, k, generator=gen)
        together = ops.gemv(invariant, weight, x)
        for r in (0, 5, 36):
            assert torch.equal(together[r], ops.gemv(invariant, weight, x[r : r + 1])[0]), kind


def test_the_invariant_step_limit_is_the_native_stacks() -> None:
    assert MAX_INVARIANT_STEP_TOKENS == MAX_NATIVE_ROWS
    with pytest.raises(ValueError, match="batch_invariant takes max_num_batched_tokens"):
        EngineConfig(batch_invariant=True, max_num_batched_tokens=MAX_NATIVE_ROWS + 1)
