"""kernels/triton_backend.py in the engine: its equality tests again with the Triton kernels
(interpreted on the CPU).

Small sizes: every kernel launch runs through TRITON_INTERPRET, about a second per step here.
Each test compares the Triton engine with the torch reference engine run the plain way.
"""

from __future__ import annotations

import random

import pytest
import torch

from service.engine.config import EngineConfig
from service.engine.engine import LLMEngine
from service.engine.params import SamplingParams
from tests.engine.conftest import EngineFactory
from tests.engine.greedy import Generated, assert_same_greedy, greedy, run

pytestmark = pytest.mark.interpreter

MAX_TOKENS = 5


def prompts(n: int, seed: int, lengths: tuple[int, int] = (5, 40)) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {
        f"r{i}": [rng.randrange(17, 49152) for _ in range(rng.randint(*lengths))] for i in range(n)
    }


def reference(make_engine: EngineFactory, requests: dict[str, list[int]]) -> dict[str, Generated]:
    results: dict[str, Generated] = {}
    for rid, prompt in requests.items():
        engine = make_engine(attention_backend="torch", enable_prefix_caching=False)
        results |= run(engine, {rid: prompt}, greedy(MAX_TOKENS))
    return results


def test_triton_batch_joining_at_different_steps_matches_requests_alone(
    make_engine: EngineFactory,
) -> None:
    requests = prompts(4, seed=1)
    engine = make_engine(attention_backend="triton", max_num_batched_tokens=32, max_num_seqs=4)
    got = run(engine, requests, greedy(MAX_TOKENS), join_at={"r1": 1, "r2": 2, "r3": 4})
    assert_same_greedy(reference(make_engine, requests), got)


def test_triton_prefix_cache_hits_give_the_same_tokens(make_engine: EngineFactory) -> None:
    rng = random.Random(2)
    shared = [rng.randrange(17, 49152) for _ in range(36)]
    requests = {f"r{i}": [*shared, 100 + i, 200 + i] for i in range(3)}
    engine = make_engine(attention_backend="triton", block_size=16)
    got = run(engine, {"r0": requests["r0"]}, greedy(MAX_TOKENS))
    got |= run(engine, {k: v for k, v in requests.items() if k != "r0"}, greedy(MAX_TOKENS))
    assert engine.stats().blocks.prefix_hits == 2 * 32
    assert_same_greedy(reference(make_engine, requests), got)


def test_triton_reads_shared_blocks_written_in_the_same_forward(
    make_engine: EngineFactory,
) -> None:
    """Prompts sharing a prefix, sent at once: the later ones attend over blocks that the
    same forward's cache write fills, through the kernel."""
    rng = random.Random(3)
    shared = [rng.randrange(17, 49152) for _ in range(36)]
    requests = {f"r{i}": [*shared, 100 + i, 200 + i] for i in range(3)}
    engine = make_engine(attention_backend="triton", block_size=16)
    got = run(engine, requests, greedy(MAX_TOKENS))
    assert engine.stats().blocks.prefix_hits == 2 * 32
    assert engine.stats().steps == MAX_TOKENS
    assert_same_greedy(reference(make_engine, requests), got)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_triton_preemption_keeps_outputs(make_engine: EngineFactory, mode: str) -> None:
    requests = prompts(3, seed=3, lengths=(14, 20))
    engine = make_engine(
        attention_backend="triton",
        block_size=8,
        num_device_blocks=7,
        num_cpu_blocks=16,
        preemption_mode=mode,
    )
    got = run(engine, requests, greedy(MAX_TOKENS))
    stats = engine.stats()
    assert stats.preemptions_swap + stats.preemptions_recompute > 0
    assert_same_greedy(reference(make_engine, requests), got)


def test_triton_contiguous_allocation_gives_the_same_tokens(make_engine: EngineFactory) -> None:
    requests = prompts(3, seed=4)
    engine = make_engine(
        attention_backend="triton", allocation="contiguous", max_model_len=64, num_device_blocks=16
    )
    assert_same_greedy(reference(make_engine, requests), run(engine, requests, greedy(MAX_TOKENS)))


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_triton_block_sizes_give_the_same_tokens(
    make_engine: EngineFactory, block_size: int
) -> None:
    requests = prompts(3, seed=5, lengths=(5, 70))
    engine = make_engine(attention_backend="triton", block_size=block_size)
    assert_same_greedy(reference(make_engine, requests), run(engine, requests, greedy(MAX_TOKENS)))


def test_triton_parallel_samples_copy_on_write(make_engine: EngineFactory) -> None:
    requests = prompts(1, seed=6, lengths=(20, 20))
    single = reference(make_engine, requests)["r0"].token_ids
    engine = make_engine(attention_backend="triton")
    engine.add_request("r0", requests["r0"], SamplingParams(temperature=0.0, n=2, max_tokens=4))
    samples: dict[int, list[int]] = {0: [], 1: []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            samples[out.index] += out.new_token_ids
    assert engine.stats().blocks.blocks_copied == 1
    assert samples[0] == samples[1] == single[:4]


@pytest.mark.real_model
def test_default_model_greedy_tokens_match_between_triton_and_torch() -> None:
    """The bundled model's shapes (9 query heads on 3 KV heads, head_dim 64, 30 layers)
    through the kernels: the chat prompt (32 tokens, two whole 16-token blocks) prefilled,
    then a decode step writing into a fresh block and attending over 33 positions (a whole
    32-token tile unmasked, then a masked tail of one). Every step is an interpreted launch
    per layer (the prefill about 8 s here, a decode step over 1 s), so two tokens; decode
    steps reading what earlier decode steps wrote are this file's other tests (tiny model)."""
    tokens = {}
    for backend in ("torch", "triton"):
        config = EngineConfig(
            dtype="float32", attention_backend=backend, kv_cache_mb=16, swap_space_mb=0
        )
        engine = LLMEngine(config)
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Hi!"}])
        assert len(prompt) == 32 and config.block_size == 16
        out = run(engine, {"hi": prompt}, greedy(2))
        engine.check_balanced()
        tokens[backend] = out
    assert_same_greedy(tokens["torch"], tokens["triton"])
    assert torch.get_num_threads() == 1
