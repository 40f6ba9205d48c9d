"""The runner's paged forward against transformers, and the batching of block moves."""

from __future__ import annotations

import random
from pathlib import Path

import torch
from transformers import LlamaForCausalLM

from service.engine.blocks import BlockOp, OpKind
from service.engine.runner import group_block_ops, host_zeros
from tests.engine.conftest import EngineFactory
from tests.engine.greedy import greedy


def test_engine_logits_match_transformers_through_chunked_prefill_and_paged_decode(
    make_engine: EngineFactory, tiny_model_dir: Path
) -> None:
    # Block size 4 and an 8-token budget: the 22-token prompt is prefilled in three chunks
    # across six blocks, then every decode step reads the context through the block table.
    engine = make_engine(block_size=4, max_num_batched_tokens=8, max_num_seqs=2)
    captured: list[torch.Tensor] = []
    execute = engine.runner.execute

    def capture(inputs):  # type: ignore[no-untyped-def]
        logits = execute(inputs)
        captured.append(logits.clone())
        return logits

    engine.runner.execute = capture  # type: ignore[method-assign]
    rng = random.Random(0)
    prompt = [rng.randrange(17, 49152) for _ in range(22)]
    engine.add_request("a", prompt, greedy(8))
    generated: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            generated += out.new_token_ids
    sampled = [t for t in captured if t.shape[0]]  # prefill chunks before the last sample nothing
    assert len(sampled) == 8

    hf = LlamaForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
    hf.eval()
    with torch.no_grad():
        ids = torch.tensor([prompt + generated[:-1]])
        reference = hf(ids).logits[0, len(prompt) - 1 :]  # [8, V]: positions 21..28
    for i, (ours, ref) in enumerate(zip(sampled, reference, strict=True)):
        rel = (ours[0] - ref).norm() / ref.norm()
        assert rel <= 1e-4, f"step {i}: relative error {rel:.2e}"


def test_block_ops_batch_until_a_slot_is_reused() -> None:
    ops = [
        BlockOp(OpKind.SWAP_OUT, 1, 0),
        BlockOp(OpKind.SWAP_OUT, 2, 1),
        BlockOp(OpKind.SWAP_IN, 5, 1),  # a new kind starts a new group
        BlockOp(OpKind.SWAP_IN, 6, 2),
        BlockOp(OpKind.SWAP_IN, 7, 1),  # writes device slot 1 again: must follow the first
        BlockOp(OpKind.COPY, 1, 3),
        BlockOp(OpKind.COPY, 3, 4),  # reads what the previous copy wrote
    ]
    groups = group_block_ops(ops)
    assert [(g.kind, g.src, g.dst) for g in groups] == [
        (OpKind.SWAP_OUT, [1, 2], [0, 1]),
        (OpKind.SWAP_IN, [5, 6], [1, 2]),
        (OpKind.SWAP_IN, [7], [1]),
        (OpKind.COPY, [1], [3]),
        (OpKind.COPY, [3], [4]),
    ]


def test_save_ops_write_no_slot_and_carry_their_hashes() -> None:
    ops = [
        BlockOp(OpKind.SAVE_CPU, 3, -1, 0xAA),
        BlockOp(OpKind.SAVE_CPU, 4, -1, 0xBB),  # -1 twice does not cut the group
        BlockOp(OpKind.SWAP_OUT, 1, 3),  # then slot 3 is reused
        BlockOp(OpKind.LOAD, 0, 1),
        BlockOp(OpKind.LOAD, 1, 2),
    ]
    groups = group_block_ops(ops)
    assert [(g.kind, g.src, g.dst, g.hashes) for g in groups] == [
        (OpKind.SAVE_CPU, [3, 4], [-1, -1], [0xAA, 0xBB]),
        (OpKind.SWAP_OUT, [1], [3], []),
        (OpKind.LOAD, [0, 1], [1, 2], []),
    ]


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_a_host_kv_pool_takes_memory_only_as_its_blocks_are_written() -> None:
    # 256 MiB of float16 zeros: calloc's fresh pages, held once written (a pool of a KV
    # cache's size at start-up costs nothing until sequences use its blocks).
    before = _rss_mib()
    pool = host_zeros((2, 64, 1024, 1024), torch.float16)
    assert pool.shape == (2, 64, 1024, 1024) and pool.dtype == torch.float16
    assert _rss_mib() - before < 32
    pool[0, :16] = 1.0  # 32 MiB written
    grown = _rss_mib() - before
    assert 28 < grown < 64
    assert float(pool[1].abs().max()) == 0.0  # the rest reads as zeros
    assert host_zeros((0, 3), torch.bfloat16).shape == (0, 3)
