"""Decode steps through the static buffers of `service/engine/cuda_graphs.py`, on the CPU.

No graph can be captured here, so `EagerDecodeGraphs` runs the padded forward eagerly over the
same buffers a CUDA graph reads: the ladder, the padding, the buffer filling, the routing of
prefill and mixed steps and the output slicing are what these tests pin. The capture itself
and its replay are tested on a GPU (tests/engine/test_cuda.py).
"""

from __future__ import annotations

import random

import pytest
import torch

from kernels.attention_launch import choose_launch
from kernels.triton_backend import TritonAttentionPlan
from service.engine.config import EngineConfig
from service.engine.cuda_graphs import (
    DecodeBuffers,
    DecodeRows,
    DecodeStep,
    EagerDecodeGraphs,
    graph_batch_sizes,
    make_step_runner,
    padded_batch_size,
)
from service.engine.engine import LLMEngine
from service.engine.scheduler import StepBatch
from tests.engine.conftest import EngineFactory
from tests.engine.greedy import assert_same_greedy, greedy, run


def prompts(n: int, seed: int, lengths: tuple[int, int] = (3, 40)) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {
        f"r{i}": [rng.randrange(17, 49152) for _ in range(rng.randint(*lengths))] for i in range(n)
    }


class RecordingGraphs(EagerDecodeGraphs):
    """Eager decode graphs that note which path each step took, and its chunks."""

    def __init__(self, engine: LLMEngine, max_num_seqs: int) -> None:
        sizes = graph_batch_sizes(max_num_seqs)
        super().__init__(engine.runner, sizes=sizes, max_model_len=engine.max_model_len)
        self.steps: list[tuple[bool, list[tuple[int, bool]]]] = []

    def prepare(self, batch: StepBatch) -> object:
        inputs = super().prepare(batch)
        chunks = [(c.num_tokens, c.samples) for c in batch.chunks]
        self.steps.append((isinstance(inputs, DecodeStep), chunks))
        return inputs


def with_eager_graphs(engine: LLMEngine, max_num_seqs: int) -> RecordingGraphs:
    graphs = RecordingGraphs(engine, max_num_seqs)
    graphs.capture()
    engine.step_runner = graphs
    return graphs


def test_the_ladder_is_1_2_4_8_then_steps_of_8_up_to_max_num_seqs() -> None:
    assert graph_batch_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert graph_batch_sizes(20) == (1, 2, 4, 8, 16, 20)
    assert graph_batch_sizes(8) == (1, 2, 4, 8)
    assert graph_batch_sizes(3) == (1, 2, 3)
    assert graph_batch_sizes(1) == (1,)
    with pytest.raises(ValueError):
        graph_batch_sizes(0)


def test_a_batch_is_padded_up_to_the_next_captured_size() -> None:
    sizes = graph_batch_sizes(20)
    assert [padded_batch_size(n, sizes) for n in (1, 2, 3, 5, 8, 9, 17, 20)] == [
        1, 2, 4, 8, 8, 16, 20, 20,
    ]  # fmt: skip
    assert padded_batch_size(21, sizes) is None


def test_a_fill_writes_the_rows_then_padding_rows_on_the_scratch_block() -> None:
    buffers = DecodeBuffers(8, 4, scratch_block=9, block_size=4, device=torch.device("cpu"))
    rows = DecodeRows(
        input_ids=[11, 12, 13],
        positions=[5, 0, 8],
        slots=[6 * 4 + 1, 2 * 4, 7 * 4],
        seq_lens=[6, 1, 9],
        tables=[[3, 6], [2], [1, 5, 7]],
    )
    # An earlier, wider step left its rows behind: they must not leak into this one.
    buffers.fill(DecodeRows([1] * 8, [1] * 8, [1] * 8, [16] * 8, [[0, 1, 2, 3]] * 8), size=8)
    seq_lens = buffers.fill(rows, size=4)
    assert seq_lens == [6, 1, 9, 1]
    assert buffers.input_ids[:4].tolist() == [11, 12, 13, 0]
    assert buffers.positions[:4].tolist() == [5, 0, 8, 0]
    assert buffers.slot_mapping[:4].tolist() == [25, 8, 28, 9 * 4]
    assert buffers.seq_lens[:4].tolist() == [6, 1, 9, 1]
    assert buffers.query_start_loc[:5].tolist() == [0, 1, 2, 3, 4]
    # Each row as wide as the widest, the short ones topped up with the scratch block; the
    # columns past that keep the earlier step's ids, which no context reaches.
    assert buffers.block_tables[:4, :3].tolist() == [[3, 6, 9], [2, 9, 9], [1, 5, 7], [9, 9, 9]]
    assert buffers.block_tables[:4, 3].tolist() == [3, 3, 3, 3]
    with pytest.raises(ValueError):
        buffers.fill(rows, size=2)


def test_greedy_tokens_through_the_padded_buffers_match_the_plain_path(
    make_engine: EngineFactory,
) -> None:
    requests = prompts(6, seed=1)
    join_at = {"r1": 1, "r2": 3, "r3": 3, "r4": 6, "r5": 9}
    plain_engine = make_engine(max_num_batched_tokens=32, max_num_seqs=6, block_size=4)
    plain = run(plain_engine, requests, greedy(10), join_at=join_at)
    engine = make_engine(max_num_batched_tokens=32, max_num_seqs=6, block_size=4)
    graphs = with_eager_graphs(engine, max_num_seqs=6)
    padded = run(engine, requests, greedy(10), join_at=join_at)
    assert_same_greedy(plain, padded)
    assert graphs.replays > 0 and graphs.padding_rows > 0
    # Padding rows wrote into the scratch block alone: every block the manager hands out
    # holds what the plain engine wrote there (to the rounding of other batch shapes).
    managed = plain_engine.runner.scratch_block
    assert torch.allclose(
        engine.runner.device_pool[:, :, :managed],
        plain_engine.runner.device_pool[:, :, :managed],
        atol=1e-5,
        rtol=1e-4,
    )
    assert engine.runner.device_pool[:, :, managed].abs().sum() > 0
    assert plain_engine.runner.device_pool[:, :, managed].abs().sum() == 0


def test_prefill_and_mixed_steps_run_eagerly_and_pure_decodes_through_the_buffers(
    make_engine: EngineFactory,
) -> None:
    # A 4-token budget: once r0-r2 decode, r3's prompt is prefilled one token a step beside
    # them, in chunks of one token that do not sample: those steps must stay eager too.
    engine = make_engine(max_num_batched_tokens=4, max_num_seqs=4, block_size=4)
    graphs = with_eager_graphs(engine, max_num_seqs=4)
    requests = {f"r{i}": [100 + i] * 3 for i in range(3)} | {"r3": list(range(300, 320))}
    run(engine, requests, greedy(12), join_at={"r3": 4})
    decode, eager = 0, 0
    for through_buffers, chunks in graphs.steps:
        pure_decode = all(n == 1 and samples for n, samples in chunks)
        assert through_buffers == pure_decode, chunks
        decode += through_buffers
        eager += not through_buffers
    assert decode == graphs.replays > 0 and eager > 0
    one_token_prefills = [c for _, chunks in graphs.steps for c in chunks if c == (1, False)]
    assert len(one_token_prefills) > 5


@pytest.mark.interpreter
def test_triton_greedy_tokens_through_the_padded_buffers_match_the_plain_path(
    make_engine: EngineFactory,
) -> None:
    requests = prompts(3, seed=3, lengths=(5, 30))
    join_at = {"r1": 1, "r2": 2}
    settings = {"attention_backend": "triton", "max_num_seqs": 3, "block_size": 8}
    plain = run(make_engine(**settings), requests, greedy(4), join_at=join_at)
    engine = make_engine(**settings)
    graphs = with_eager_graphs(engine, max_num_seqs=3)
    assert_same_greedy(plain, run(engine, requests, greedy(4), join_at=join_at))
    assert graphs.replays > 0


def test_capture_plans_each_size_for_the_longest_context(make_engine: EngineFactory) -> None:
    engine = make_engine(attention_backend="triton", max_model_len=300, block_size=16)
    graphs = EagerDecodeGraphs(engine.runner, sizes=(1, 4), max_model_len=300)
    args = engine.runner.model.args
    for size in graphs.sizes:
        # On the CPU the plan checks the lengths on the "device" against the host's: give the
        # buffers rows at the longest context, as a capture's host lengths say.
        graphs.buffers.fill(DecodeRows([0] * size, [299] * size, [0] * size, [300] * size,
                                       [[0] * 19] * size), size)  # fmt: skip
        inputs = graphs.capture_inputs(size)
        assert inputs.meta.seq_lens_host == [300] * size
        assert inputs.meta.block_tables.shape == (size, 19)  # ceil(300 / 16) blocks per row
        plan = inputs.plan
        assert isinstance(plan, TritonAttentionPlan)
        launch, _ = plan.launch_for(args.num_heads, args.num_kv_heads, args.head_dim, torch.float32)
        assert launch == choose_launch(
            num_tokens=size, num_seqs=size, max_query_len=1, max_seq_len=300,
            num_q_heads=args.num_heads, num_kv_heads=args.num_kv_heads, head_dim=args.head_dim,
            dtype=torch.float32, num_sms=plan.num_sms,
        )  # fmt: skip


def test_off_cuda_or_turned_off_the_engine_steps_through_the_runner(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()
    assert engine.step_runner is engine.runner
    off = EngineConfig(device="cpu", cuda_graphs=False)
    assert make_step_runner(engine.runner, off, engine.max_model_len) is engine.runner


def test_the_scratch_block_is_in_no_block_table(make_engine: EngineFactory) -> None:
    # Eight blocks of 4 tokens: after the first step the two requests hold every one.
    engine = make_engine(num_device_blocks=8, num_cpu_blocks=0, block_size=4, max_num_seqs=2)
    assert engine.runner.device_pool.shape[2] == 9
    engine.add_request("a", list(range(100, 115)), greedy(2))
    engine.add_request("b", list(range(200, 215)), greedy(2))
    engine.step()
    tables = [b.slot for s in engine.scheduler.running for b in s.block_table]
    assert sorted(tables) == list(range(8))
    while engine.has_unfinished_requests():
        engine.step()
