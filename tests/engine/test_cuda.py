"""The engine on a CUDA GPU: the tiny random model's greedy tokens against the CPU fp32
reference, decode steps replayed from CUDA graphs against eager ones, and block moves (swaps,
copy-on-write) bit for bit.

Skipped without a GPU, and where tests/conftest.py turned the Triton interpreter on (it does
unless TRITON_INTERPRET is set): benchmarks/gpu_check.sh runs this module with
TRITON_INTERPRET=0, so the kernels are compiled for the card.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from kernels.triton_cache_ops import INTERPRETER
from service.engine.blocks import BlockOp, OpKind
from service.engine.cuda_graphs import CudaDecodeGraphs
from service.engine.engine import LLMEngine
from service.engine.loader import LoadedModel, load_model
from service.engine.params import SamplingParams
from tests.engine.conftest import EngineFactory
from tests.engine.families.test_families import CASES as FAMILY_CASES
from tests.engine.families.test_families import IDS as FAMILY_IDS
from tests.engine.families.test_families import SHAPE, Case
from tests.engine.greedy import BF16_NEAR_TIE, NEAR_TIE, Generated, assert_same_greedy, greedy, run
from tests.tiny_model import make_tiny_family

pytestmark = [
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA GPU (benchmarks/gpu_check.sh runs these on one)",
    ),
    pytest.mark.skipif(
        INTERPRETER, reason="TRITON_INTERPRET=1: run with TRITON_INTERPRET=0 to compile kernels"
    ),
]

CUDA = torch.device("cuda")
MAX_TOKENS = 8
# Same settings as the CPU reference engines (tests/engine/conftest.py), on the GPU.
ON_CUDA = {"device": "cuda", "attention_backend": "triton", "max_num_seqs": 8}


def prompts(n: int, seed: int, lengths: tuple[int, int] = (5, 60)) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {
        f"r{i}": [rng.randrange(17, 49152) for _ in range(rng.randint(*lengths))] for i in range(n)
    }


@pytest.fixture(scope="module")
def cuda_models(tiny_model_dir: Path) -> dict[torch.dtype, LoadedModel]:
    return {
        dtype: load_model(tiny_model_dir, dtype=dtype, device=CUDA)
        for dtype in (torch.float32, torch.bfloat16)
    }


def cpu_reference(make_engine: EngineFactory, requests: dict[str, list[int]]) -> dict:
    """Each request alone on a fresh fp32 CPU engine (torch backend, no prefix cache)."""
    results: dict[str, Generated] = {}
    for rid, prompt in requests.items():
        engine = make_engine(attention_backend="torch", enable_prefix_caching=False)
        results |= run(engine, {rid: prompt}, greedy(MAX_TOKENS))
    return results


def record_logits(engine: LLMEngine, seen: list[torch.Tensor]) -> None:
    """Keep a copy of every step's logits as the engine's step runner returns them."""
    execute = engine.step_runner.execute

    def record(inputs: object) -> torch.Tensor:
        out = execute(inputs)
        seen.append(out.clone())
        return out

    engine.step_runner.execute = record  # type: ignore[method-assign]


def graphs_of(engine: LLMEngine) -> CudaDecodeGraphs:
    graphs = engine.step_runner
    assert isinstance(graphs, CudaDecodeGraphs), "the CUDA engine captured no graphs"
    return graphs


@pytest.mark.parametrize(
    ("dtype", "near_tie"), [(torch.float32, NEAR_TIE), (torch.bfloat16, BF16_NEAR_TIE)]
)
def test_cuda_greedy_tokens_match_the_cpu_fp32_reference(
    make_engine: EngineFactory,
    cuda_models: dict[torch.dtype, LoadedModel],
    dtype: torch.dtype,
    near_tie: float,
) -> None:
    requests = prompts(6, seed=1)
    join_at = {"r1": 1, "r2": 2, "r3": 4, "r4": 4, "r5": 7}
    engine = make_engine(loaded=cuda_models[dtype], dtype=str(dtype).removeprefix("torch."),
                         max_num_batched_tokens=64, **ON_CUDA)  # fmt: skip
    got = run(engine, requests, greedy(MAX_TOKENS), join_at=join_at)
    assert_same_greedy(cpu_reference(make_engine, requests), got, near_tie=near_tie)
    assert graphs_of(engine).replays > 0


def test_cuda_graph_replay_matches_eager_decode_steps(
    make_engine: EngineFactory, cuda_models: dict[torch.dtype, LoadedModel]
) -> None:
    requests = prompts(5, seed=2)
    join_at = {"r1": 1, "r2": 3, "r3": 3, "r4": 6}  # batches of 1 to 5: sizes 1, 2, 4, 8
    logits: dict[bool, list[torch.Tensor]] = {True: [], False: []}
    outputs = {}
    for graphs in (True, False):
        engine = make_engine(loaded=cuda_models[torch.float32], dtype="float32",
                             cuda_graphs=graphs, **ON_CUDA)  # fmt: skip
        record_logits(engine, logits[graphs])
        outputs[graphs] = run(engine, requests, greedy(MAX_TOKENS), join_at=join_at)
        if graphs:
            replayed = graphs_of(engine)
            assert replayed.replays > 0 and replayed.padding_rows > 0
        else:
            assert engine.step_runner is engine.runner
    assert_same_greedy(outputs[False], outputs[True])
    assert len(logits[True]) == len(logits[False])
    for step, (replayed, eager) in enumerate(zip(logits[True], logits[False], strict=True)):
        if replayed.shape != eager.shape:  # the schedules parted at a forgiven near-tie
            break
        rel = float((replayed - eager).norm() / eager.norm())
        assert rel <= 1e-4, f"step {step}: relative error {rel:.1e}"


def test_cuda_swap_out_and_in_and_copy_on_write_are_bit_exact(
    make_engine: EngineFactory, cuda_models: dict[torch.dtype, LoadedModel]
) -> None:
    engine = make_engine(loaded=cuda_models[torch.bfloat16], dtype="bfloat16",
                         num_device_blocks=32, num_cpu_blocks=16, **ON_CUDA)  # fmt: skip
    runner = engine.runner
    gen = torch.Generator(device=CUDA).manual_seed(5)
    pool = runner.device_pool
    pool.copy_(torch.randn(pool.shape, generator=gen, device=CUDA, dtype=pool.dtype))
    before = pool.clone()
    out_of, into = [3, 17, 9, 30], [0, 5, 11, 2]
    swaps = zip(out_of, into, strict=True)
    runner.apply_block_ops([BlockOp(OpKind.SWAP_OUT, d, c) for d, c in swaps], [])
    assert torch.equal(runner.cpu_pool[:, :, into], before[:, :, out_of].cpu())
    back = [20, 21, 1, 8]
    swaps = zip(into, back, strict=True)
    runner.apply_block_ops([BlockOp(OpKind.SWAP_IN, c, d) for c, d in swaps], [])
    assert torch.equal(pool[:, :, back], before[:, :, out_of])
    runner.apply_block_ops([BlockOp(OpKind.COPY, 4, 12), BlockOp(OpKind.COPY, 12, 13)], [])
    assert torch.equal(pool[:, :, 12], before[:, :, 4])
    assert torch.equal(pool[:, :, 13], before[:, :, 4])
    untouched = [b for b in range(pool.shape[2]) if b not in {*back, 12, 13}]
    assert torch.equal(pool[:, :, untouched], before[:, :, untouched])


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_cuda_preemption_keeps_the_tokens(
    make_engine: EngineFactory, cuda_models: dict[torch.dtype, LoadedModel], mode: str
) -> None:
    requests = prompts(3, seed=3, lengths=(14, 20))
    engine = make_engine(loaded=cuda_models[torch.float32], dtype="float32", block_size=8,
                         num_device_blocks=7, num_cpu_blocks=16, preemption_mode=mode,
                         **ON_CUDA)  # fmt: skip
    got = run(engine, requests, greedy(MAX_TOKENS))
    stats = engine.stats()
    assert stats.preemptions_swap + stats.preemptions_recompute > 0
    if mode == "swap":
        assert stats.preemptions_swap > 0
    assert_same_greedy(cpu_reference(make_engine, requests), got)


def test_cuda_parallel_samples_share_the_prompt_then_copy_on_write(
    make_engine: EngineFactory, cuda_models: dict[torch.dtype, LoadedModel]
) -> None:
    requests = prompts(1, seed=6, lengths=(20, 20))
    single = cpu_reference(make_engine, requests)["r0"]
    engine = make_engine(loaded=cuda_models[torch.float32], dtype="float32", **ON_CUDA)
    params = SamplingParams(temperature=0.0, n=2, max_tokens=MAX_TOKENS, logprobs=2)
    engine.add_request("r0", requests["r0"], params)
    samples: dict[int, Generated] = {0: Generated(), 1: Generated()}
    while engine.has_unfinished_requests():
        for out in engine.step():
            samples[out.index].token_ids += out.new_token_ids
            samples[out.index].margins += [p[1][1] - p[2][1] for p in out.logprobs or []]
    assert engine.stats().blocks.blocks_copied == 1
    assert samples[0].token_ids == samples[1].token_ids
    assert_same_greedy({"r0": single}, {"r0": samples[0]})


@pytest.mark.parametrize("case", FAMILY_CASES, ids=FAMILY_IDS)
def test_cuda_runs_every_family_as_the_cpu_does(
    make_engine: EngineFactory, tmp_path: Path, case: Case
) -> None:
    """Each family's tiny model (tests/engine/families) on the GPU through the Triton kernels
    and CUDA graphs, fp32: its greedy tokens batched, with prefix-cache hits, in a small pool,
    equal to the CPU fp32 engine's, each request alone."""
    directory = make_tiny_family(tmp_path / "m", case.model_type, SHAPE | case.config)
    on_cpu = load_model(directory, dtype=torch.float32, device=torch.device("cpu"))
    on_gpu = load_model(directory, dtype=torch.float32, device=CUDA)
    shared = [17 + i for i in range(32)]
    requests = prompts(3, seed=5) | {"s0": [*shared, 99], "s1": [*shared, 100, 101]}
    reference: dict[str, Generated] = {}
    for rid, prompt in requests.items():
        engine = make_engine(loaded=on_cpu, attention_backend="torch", enable_prefix_caching=False)
        reference |= run(engine, {rid: prompt}, greedy(MAX_TOKENS))
    engine = make_engine(loaded=on_gpu, dtype="float32", block_size=8, num_device_blocks=24,
                         num_cpu_blocks=32, preemption_mode="swap", **ON_CUDA)  # fmt: skip
    got = run(engine, requests, greedy(MAX_TOKENS), join_at={"s1": 3})
    assert engine.stats().blocks.prefix_hits > 0
    assert_same_greedy(reference, got)
    assert graphs_of(engine).replays > 0
