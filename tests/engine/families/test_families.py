"""Every family against transformers: a tiny random-weight model built from the family's own
config class, its fp32 log-probabilities at every position of a prompt longer than its sliding
window (through the paged cache), and its greedy tokens through the engine alone, batched, on
prefix-cache hits and under preemption."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from kernels.cpu import dispatch
from kernels.cpu.formats import WeightType
from service.engine.families import FAMILIES
from service.engine.loader import load_model
from tests.engine.conftest import EngineFactory
from tests.engine.greedy import Generated, assert_same_greedy, greedy, run
from tests.tiny_model import (
    ContiguousAttention,
    PagedAttention,
    dequantized_reference,
    make_tiny_family,
)

CPU = torch.device("cpu")
SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
)


@dataclass(frozen=True)
class Case:
    family: str  # ours, service/engine/families
    model_type: str  # transformers'
    config: dict[str, Any]


# Llama 3.1's scaling over a 64-token original context, so that positions here reach every
# regime: kept, blended and stretched frequencies.
LLAMA3_ROPE = {
    "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
}  # fmt: skip
CASES = [
    Case("llama", "llama", {}),
    Case("llama", "llama", {"attention_bias": True}),
    Case("llama", "llama", {"rope_parameters": LLAMA3_ROPE, "tie_word_embeddings": True}),
    Case("qwen2", "qwen2", {"tie_word_embeddings": True}),
    Case("qwen3", "qwen3", {}),
    Case("qwen3", "qwen3", {"attention_bias": True}),
    # Windows far shorter than the prompts here (100 tokens; 41 to 73 for greedy decoding),
    # and not multiples of the blocks (8 or 16 tokens).
    Case("mistral", "mistral", {"sliding_window": 20}),
    Case("phi3", "phi3", {"sliding_window": 27}),
    # One local and one global layer, each with its RoPE base; an attention scale that is
    # not head_dim ** -0.5.
    Case(
        "gemma3",
        "gemma3_text",
        {
            "layer_types": ["sliding_attention", "full_attention"],
            "sliding_window": 24,
            "query_pre_attn_scalar": 32,
        },
    ),
]
IDS = [
    "llama",
    "llama-bias",
    "llama3-rope",
    "qwen2",
    "qwen3",
    "qwen3-bias",
    "mistral",
    "phi3",
    "gemma3",
]


@pytest.fixture(scope="module", params=CASES, ids=IDS)
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    case: Case = request.param
    directory = make_tiny_family(
        tmp_path_factory.mktemp(case.model_type) / "model", case.model_type, SHAPE | case.config
    )
    return case, directory, load_model(directory, torch.float32, CPU)


def _reference(directory: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def _prompt(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(17, 49152, (n,), generator=g).tolist()


def test_every_family_has_a_case_here() -> None:
    assert {f.name for f in FAMILIES} == {c.family for c in CASES}


@torch.inference_mode()
def test_log_probabilities_match_transformers_at_every_position(case: Any) -> None:
    """Max |difference| of log-probabilities over transformers' top 20, at each of 100
    positions: a 60-token prefill, then one token a step, through the paged cache."""
    spec, directory, loaded = case
    assert loaded.family == spec.family
    window = loaded.args.window
    assert (window.size if window else None) == spec.config.get("sliding_window")
    ids = torch.tensor(_prompt(100))
    expected = torch.log_softmax(_reference(directory)(ids[None]).logits[0], -1)  # [S, V]
    model = loaded.model
    attention = PagedAttention(loaded.args)
    rows = [model.compute_logits(model(ids[:60], torch.arange(60), attention))]
    for pos in range(60, len(ids)):
        rows.append(model.compute_logits(model(ids[pos : pos + 1], torch.tensor([pos]), attention)))
    ours = torch.log_softmax(torch.cat(rows), -1)
    top = expected.topk(20, dim=-1).indices  # [S, 20]
    worst = (ours.gather(1, top) - expected.gather(1, top)).abs().max(dim=1).values  # [S]
    assert float(worst.max()) <= 1e-3, f"position {int(worst.argmax())}: {float(worst.max())}"


def _transformers_greedy(directory: Path, prompt: list[int], n: int) -> list[int]:
    out = _reference(directory).generate(
        torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n
    )
    tokens: list[int] = out[0, len(prompt) :].tolist()
    return tokens


def _as_generated(tokens: list[int]) -> Generated:
    # transformers gives no margins: any difference fails, as a margin of infinity would.
    return Generated(token_ids=tokens, margins=[float("inf")] * len(tokens))


def test_greedy_tokens_match_transformers_batched_cached_and_preempted(
    case: Any, make_engine: EngineFactory
) -> None:
    """32 greedy tokens per prompt, equal to transformers' own: four prompts joining a batch
    at different steps in chunked prefills, two of them sharing a 32-token prefix (cache
    hits), then all four under a KV budget that preempts (swap and recompute)."""
    _, directory, loaded = case
    shared = _prompt(32, seed=9)
    prompts = {
        "a": _prompt(40, seed=1),
        "b": _prompt(7, seed=2),
        "c": [*shared, *_prompt(5, seed=3)],
        "d": [*shared, *_prompt(9, seed=4)],
    }
    expected = {
        rid: _as_generated(_transformers_greedy(directory, p, 32)) for rid, p in prompts.items()
    }
    batched = make_engine(loaded, max_num_batched_tokens=24, max_num_seqs=4)
    got = run(batched, prompts, greedy(32), join_at={"b": 1, "c": 3, "d": 5})
    assert batched.stats().blocks.prefix_hits >= 32
    assert_same_greedy(expected, got)
    for mode in ("swap", "recompute"):
        tight = make_engine(loaded, block_size=8, num_device_blocks=12, preemption_mode=mode)
        got = run(tight, prompts, greedy(32))
        stats = tight.stats()
        assert stats.preemptions_swap + stats.preemptions_recompute > 0
        assert_same_greedy(expected, got)


def test_parallel_samples_and_the_third_tier_keep_transformers_tokens(
    case: Any, make_engine: EngineFactory, tmp_path: Path
) -> None:
    """n = 2 greedy samples sharing the prompt's blocks (copy-on-write at the first token), and
    a history stored in the third KV tier by one engine and loaded by a fresh one (the blocks'
    K/V of every layer, windowed or not, read back instead of recomputed): both answer with
    transformers' greedy tokens."""
    from service.engine.kvtier.config import KVTierConfig
    from service.engine.params import SamplingParams

    _, directory, loaded = case
    history = _prompt(
        80, seed=21
    )  # five blocks of 16 (the tier loads from four), past every window
    turn = [*history, *_prompt(6, seed=22)]
    expected = _as_generated(_transformers_greedy(directory, turn, 16))
    engine = make_engine(loaded)
    engine.add_request("pair", turn, SamplingParams(temperature=0.0, max_tokens=16, n=2))
    samples: dict[int, list[int]] = {0: [], 1: []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            samples[out.index] += out.new_token_ids
    for tokens in samples.values():
        assert_same_greedy({"t": expected}, {"t": _as_generated(tokens)})
    tier = KVTierConfig(directory=tmp_path)
    writer = make_engine(loaded, kv_tier=tier)
    writer.add_request("store", history, SamplingParams(max_tokens=0), persist=True)
    while writer.has_unfinished_requests():
        writer.step()
    assert writer.kv_tier is not None and writer.kv_tier.flush()
    reader = make_engine(loaded, kv_tier=tier)
    loaded_turn = run(reader, {"t": turn}, greedy(16))
    assert reader.stats().blocks.prefix_tier_hits == 80
    assert_same_greedy({"t": expected}, loaded_turn)


@torch.inference_mode()
def test_packed_weights_run_every_family_as_its_dequantized_weights(case: Any) -> None:
    """Quantized at load time (Q8_0 through the CPU kernels, as `--weights int8` does), each
    family's features (biases, q/k norms, RoPE divisors) stay around the packed projections:
    the logits are those of the fp32 model over the same weights dequantized. Every family
    runs on the one-call native stack too (tests/engine/test_native_decode.py)."""
    _, directory, loaded = case
    kernels = dispatch.select("auto")
    packed = load_model(directory, torch.float32, CPU, weight_dtype=torch.int8, kernels=kernels)
    args = packed.args
    caches = [(torch.zeros(4, 16, args.num_kv_heads, args.head_dim),) * 2] * args.num_layers
    assert packed.model.native_decoder_stack(caches) is not None
    reference = dequantized_reference(loaded, WeightType.Q8_0)
    ids = torch.tensor(_prompt(20, seed=5))
    low = packed.model.compute_logits(packed.model(ids, torch.arange(20), ContiguousAttention(2)))
    high = reference.compute_logits(reference(ids, torch.arange(20), ContiguousAttention(2)))
    assert float((low - high).abs().max() / high.abs().max()) <= 1e-4


def test_a_sliding_window_leaves_the_whole_context_served(tmp_path: Path) -> None:
    """The window is applied in the paged attention, so it no longer caps the context."""
    from service.engine.config import EngineConfig
    from service.engine.engine import LLMEngine

    directory = make_tiny_family(tmp_path / "m", "mistral", SHAPE | {"sliding_window": 48})
    loaded = load_model(directory, torch.float32, CPU)
    assert loaded.args.layer_windows == (48, 48)
    engine = LLMEngine(
        EngineConfig(dtype="float32", device="cpu", max_model_len=512), loaded=loaded
    )
    assert engine.max_model_len == 512
    engine.close()


GEMMA3 = CASES[IDS.index("gemma3")]


def test_gemma3s_window_layers_keep_only_their_window_and_answer_as_one_pool(
    tmp_path: Path, make_engine: EngineFactory
) -> None:
    """Gemma 3's sliding-window layers in pools of their own (service/engine/window_blocks.py):
    through 60-token prompts and 150-token answers, two sharing a prefix, the window pool holds
    at most the blocks the window sees per sequence while the full pool holds every position;
    the tokens equal the one-pool engine's, through the eager decode buffers too, and both
    engines end balanced (make_engine checks)."""
    from service.engine.window_blocks import WindowedBlockManager
    from tests.engine.test_cuda_graphs import with_eager_graphs

    directory = make_tiny_family(tmp_path / "m", GEMMA3.model_type, SHAPE | GEMMA3.config)
    loaded = load_model(directory, torch.float32, CPU)
    shared = _prompt(40, seed=31)
    prompts = {
        "a": [*shared, *_prompt(20, seed=32)],
        "b": [*shared, *_prompt(20, seed=33)],
        "c": _prompt(60, seed=34),
    }
    one_pool = make_engine(loaded, block_size=8, window_pools=False)
    assert not isinstance(one_pool.block_manager, WindowedBlockManager)
    expected = run(one_pool, prompts, greedy(150), join_at={"b": 2, "c": 4})
    for graphs in (False, True):
        # Pools from 1 MiB: the window pool is cut to 56 blocks, the full one grows to 456
        # (`pool_sizes`), so a slot of the wrong group's table lands outside its pool.
        engine = make_engine(
            loaded, block_size=8, max_num_seqs=4, num_device_blocks=None, kv_cache_mb=1
        )
        bm = engine.block_manager
        assert isinstance(bm, WindowedBlockManager)
        assert (bm.full.stats().device.total, bm.window.stats().device.total) == (456, 56)
        recording = with_eager_graphs(engine, max_num_seqs=4) if graphs else None
        most_window_blocks = 0

        def observe(engine: Any = engine, bm: WindowedBlockManager = bm) -> None:
            nonlocal most_window_blocks
            for seq in engine.scheduler.running:
                window = sum(b is not None for b in seq.window_block_table)
                # 24-token window over 8-token blocks: 4 blocks seen, the step's new block
                # and (while prefilling) its chunk's blocks.
                assert window <= bm.groups.blocks_seen(8) + 1 + 128 // 8
                most_window_blocks = max(most_window_blocks, window)
                assert sum(b is not None for b in seq.block_table) == len(seq.block_table)

        got = run(engine, prompts, greedy(150), join_at={"b": 2, "c": 4}, on_step=observe)
        assert_same_greedy(expected, got)
        stats = engine.stats().blocks
        assert stats.prefix_hits >= 40 and stats.window_device is not None
        # Of the 27 blocks a whole 210-token sequence fills; the full pool holds 76 at the end,
        # more than the window pool has, so a slot of the wrong group's table is out of range.
        assert 0 < most_window_blocks <= 20
        assert recording is None or recording.replays > 0
