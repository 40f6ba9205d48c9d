"""The engine with a third KV tier (service/engine/kvtier) on real backends: a history saved by one
engine is loaded by another instead of recomputed, with the same greedy tokens; bad blocks,
a stalled or stopped tier and aborts cost only recompute, and the pools stay balanced."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import redis
import torch

from service.engine.config import EngineConfig
from service.engine.engine import LLMEngine
from service.engine.kvtier.config import KVTierConfig
from service.engine.kvtier.dir_backend import DirBackend
from service.engine.loader import load_model
from service.engine.params import SamplingParams
from service.engine.sequence import SequenceStatus
from service.engine.values import RequestOutput
from tests.engine.conftest import EngineFactory
from tests.engine.greedy import Generated, assert_same_greedy, greedy
from tests.engine.test_cuda_graphs import with_eager_graphs
from tests.redis_process import RedisProcess, redis_server
from tests.tiny_model import make_tiny_llama

__all__ = ["redis_server"]  # the fixture: a redis-server of the test's own, to stop

BLOCK = 16


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(17, 49152) for _ in range(n)]


def answer(
    engine: LLMEngine,
    rid: str,
    ids: list[int],
    params: SamplingParams,
    *,
    persist: bool = False,
) -> tuple[Generated, RequestOutput]:
    """Run one request to the end; its tokens and its last output (the usage counts)."""
    engine.add_request(rid, ids, params, persist=persist)
    got, last = Generated(), None
    while engine.has_unfinished_requests():
        for out in engine.step():
            got.token_ids += out.new_token_ids
            got.margins += [p[1][1] - p[2][1] for p in out.logprobs or []]
            last = out
    assert last is not None
    return got, last


def store(engine: LLMEngine, ids: list[int]) -> None:
    """What the service does when a turn is stored: a prefill-only request that persists."""
    answer(engine, "store", ids, SamplingParams(max_tokens=0), persist=True)
    assert engine.kv_tier is not None and engine.kv_tier.flush()


def test_a_history_saved_by_one_engine_is_loaded_by_another_with_the_same_tokens(
    make_engine: EngineFactory, tmp_path: Path
) -> None:
    history = prompt(1, 200)  # 12 full blocks
    turn = [*history, *prompt(2, 9)]
    reference, recomputed = answer(make_engine(), "ref", turn, greedy(12))
    assert recomputed.num_loaded_tokens == 0 and recomputed.num_cached_tokens == 0

    tier = KVTierConfig(directory=tmp_path)
    store(make_engine(kv_tier=tier), history)
    restarted = make_engine(kv_tier=tier)  # a new process: empty pools, the same tier
    got, last = answer(restarted, "turn", turn, greedy(12))
    assert last.num_loaded_tokens == len(history) // BLOCK * BLOCK
    assert last.num_cached_tokens == last.num_swapped_in_tokens == 0
    assert_same_greedy({"r": reference}, {"r": got})
    stats = restarted.stats()
    assert stats.blocks.prefix_tier_hits == last.num_loaded_tokens
    assert stats.prompt_tokens_computed == len(turn) - last.num_loaded_tokens
    assert stats.kv_tier is not None and stats.kv_tier.blocks_loaded == len(history) // BLOCK


def test_blocks_dropped_from_the_cpu_pool_reach_the_tier(
    make_engine: EngineFactory, tmp_path: Path
) -> None:
    tier = KVTierConfig(directory=tmp_path)
    # Device and CPU pools of 16 blocks each: the first prompt's blocks are pushed out of both.
    engine = make_engine(kv_tier=tier, num_device_blocks=16, num_cpu_blocks=16)
    first = prompt(3, 160)
    answer(engine, "first", first, greedy(1))
    for i in range(4):
        answer(engine, f"other{i}", prompt(10 + i, 150), greedy(1))
    assert engine.kv_tier is not None and engine.kv_tier.flush()
    assert engine.block_manager.tier_of(engine.pages_of(first).block_hashes[0]) is None  # dropped
    assert engine.stats().kv_tier.blocks_written >= 9  # type: ignore[union-attr]
    # Back on the same engine, the dropped history is loaded, not recomputed.
    _, last = answer(engine, "again", [*first, *prompt(4, 5)], greedy(2))
    assert last.num_loaded_tokens >= 8 * BLOCK


def test_a_corrupted_block_is_detected_and_the_rest_recomputed(
    make_engine: EngineFactory, tmp_path: Path
) -> None:
    history = prompt(5, 200)
    turn = [*history, *prompt(6, 7)]
    reference, _ = answer(make_engine(), "ref", turn, greedy(10))
    tier = KVTierConfig(directory=tmp_path)
    writer = make_engine(kv_tier=tier)
    store(writer, history)
    assert writer.kv_tier is not None
    # Flip a byte of block 5's file, and cut block 8's short.
    hashes = writer.pages_of(history).block_hashes
    paths = {i: next(tmp_path.rglob(f"{hashes[i]:016x}.kvb")) for i in (5, 8)}
    data = bytearray(paths[5].read_bytes())
    data[len(data) // 2] ^= 0x01
    paths[5].write_bytes(bytes(data))
    paths[8].write_bytes(paths[8].read_bytes()[:-100])
    reader = make_engine(kv_tier=tier)
    got, last = answer(reader, "turn", turn, greedy(10))
    assert last.num_loaded_tokens == 5 * BLOCK  # blocks 0-4; the rest recomputed
    rejected = reader.stats().kv_tier.blocks_rejected  # type: ignore[union-attr]
    assert rejected == {"checksum": 1, "truncated": 1}  # both read in one chunk, both caught
    assert_same_greedy({"r": reference}, {"r": got})
    assert not paths[5].exists() and not paths[8].exists()  # deleted, never used


def test_a_foreign_models_blocks_under_our_keys_are_rejected(
    make_engine: EngineFactory, tmp_path: Path
) -> None:
    history = prompt(7, 120)
    turn = [*history, *prompt(8, 5)]
    reference, _ = answer(make_engine(), "ref", turn, greedy(8))
    # Another model (other random weights, the same shapes) stores the same tokens; its
    # records are then put where our engine looks for these blocks (a misconfigured copy).
    other_model = load_model(make_tiny_llama(tmp_path / "other", seed=1), dtype=torch.float32)
    settings = {"dtype": "float32", "device": "cpu", "num_device_blocks": 64, "max_model_len": 512}
    foreign = LLMEngine(
        EngineConfig(**settings, kv_tier=KVTierConfig(directory=tmp_path / "theirs")),  # type: ignore[arg-type]
        loaded=other_model,
    )
    try:
        store(foreign, history)
        theirs = DirBackend(tmp_path / "theirs", cap_bytes=1 << 30)
        assert foreign.kv_tier is not None
        ours = make_engine(kv_tier=KVTierConfig(directory=tmp_path / "ours"))
        assert ours.kv_tier is not None and foreign.model_id != ours.model_id
        mine = DirBackend(tmp_path / "ours", cap_bytes=1 << 30)
        pairs = zip(
            foreign.pages_of(history).block_hashes, ours.pages_of(history).block_hashes, strict=True
        )
        for h_theirs, h_ours in pairs:
            [data] = theirs.get_many([foreign.kv_tier.layout.key(h_theirs)])
            assert data is not None
            mine.put(ours.kv_tier.layout.key(h_ours), data)
    finally:
        foreign.close()
    got, last = answer(ours, "turn", turn, greedy(8))
    assert last.num_loaded_tokens == 0
    rejected = ours.stats().kv_tier.blocks_rejected  # type: ignore[union-attr]
    assert rejected == {"foreign": len(history) // BLOCK}  # every block read, none used
    assert_same_greedy({"r": reference}, {"r": got})


@pytest.mark.server
def test_others_keep_decoding_while_a_sequence_waits_on_a_stalled_tier(
    make_engine: EngineFactory, redis_server: RedisProcess
) -> None:
    url = f"unix://{redis_server.socket}"
    tier = KVTierConfig(redis_url=url, io_timeout_s=1.5)
    history = prompt(9, 200)
    turn = [*history, *prompt(10, 5)]
    reference, _ = answer(make_engine(), "ref", turn, greedy(6))
    store(make_engine(kv_tier=tier), history)
    engine = make_engine(kv_tier=tier)
    engine.add_request("decoding", prompt(11, 20), greedy(200))
    engine.step()  # its prefill: it decodes from now on
    admin = redis.Redis.from_url(url)
    admin.execute_command("CLIENT", "PAUSE", 2500, "ALL")
    admin.close()
    engine.add_request("turn", turn, greedy(6))
    decoded_while_loading = 0
    got = Generated()
    while engine.has_unfinished_requests():
        loading = any(s.status is SequenceStatus.LOADING for s in engine.scheduler.loading)
        for out in engine.step():
            if out.request_id == "decoding":
                decoded_while_loading += loading
            else:
                got.token_ids += out.new_token_ids
                got.margins += [p[1][1] - p[2][1] for p in out.logprobs or []]
        if got.token_ids and decoded_while_loading and "decoding" in engine._requests:
            engine.abort("decoding")
    assert decoded_while_loading > 0
    stats = engine.stats().kv_tier
    assert stats is not None and stats.read_errors == 1  # the stalled read gave up
    assert_same_greedy({"r": reference}, {"r": got})  # and the turn was recomputed


@pytest.mark.server
def test_a_stopped_redis_tier_never_fails_a_request(
    make_engine: EngineFactory, redis_server: RedisProcess
) -> None:
    tier = KVTierConfig(redis_url=f"unix://{redis_server.socket}", io_timeout_s=1.0)
    engine = make_engine(kv_tier=tier, num_device_blocks=16, num_cpu_blocks=4)
    history = prompt(12, 150)
    store(engine, history)
    redis_server.stop()
    # Saves of dropped blocks and the persisting store fail; loads fail; answers do not.
    for i in range(3):
        answer(engine, f"push{i}", prompt(20 + i, 150), greedy(2), persist=True)
    reference, _ = answer(make_engine(), "ref", [*history, 99, 98, 97], greedy(5))
    got, last = answer(engine, "turn", [*history, 99, 98, 97], greedy(5))
    assert last.num_loaded_tokens == 0
    assert_same_greedy({"r": reference}, {"r": got})
    stats = engine.stats().kv_tier
    assert stats is not None and stats.write_errors + stats.read_errors >= 1


@pytest.mark.server
def test_a_full_redis_tier_never_fails_a_request(
    make_engine: EngineFactory, redis_server: RedisProcess
) -> None:
    url = f"unix://{redis_server.socket}"
    admin = redis.Redis.from_url(url)
    used = int(admin.info("memory")["used_memory"])
    # Room for a few blocks, then every write is refused (OOM): a tier that is full.
    admin.config_set("maxmemory", used + 40_000)
    admin.config_set("maxmemory-policy", "noeviction")
    admin.close()
    engine = make_engine(kv_tier=KVTierConfig(redis_url=url, retry_after_s=0.0))
    history = prompt(14, 200)
    store(engine, history)
    stats = engine.stats().kv_tier
    assert stats is not None and stats.write_errors > 0 and stats.blocks_written < 12
    reference, _ = answer(make_engine(), "ref", [*history, 4, 5, 6], greedy(5))
    reader = make_engine(kv_tier=KVTierConfig(redis_url=url))
    got, last = answer(reader, "turn", [*history, 4, 5, 6], greedy(5))
    # The leading blocks that fit (memory comes and goes: not always the first ones).
    assert last.num_loaded_tokens <= stats.blocks_written * BLOCK
    assert_same_greedy({"r": reference}, {"r": got})


def test_aborting_a_loading_request_leaves_the_pools_balanced(
    make_engine: EngineFactory, tmp_path: Path
) -> None:
    tier = KVTierConfig(directory=tmp_path)
    history = prompt(13, 200)
    store(make_engine(kv_tier=tier), history)
    engine = make_engine(kv_tier=tier)
    engine.add_request("turn", [*history, 5, 6, 7], greedy(4))
    engine.step()
    assert [s.request_id for s in engine.scheduler.loading] == ["turn"]
    engine.check_balanced()
    assert engine.abort("turn")
    assert not engine.scheduler.loading
    engine.check_balanced()


@pytest.mark.real_model
def test_the_bundled_models_answer_is_the_same_loaded_from_the_tier_or_recomputed(
    tmp_path: Path,
) -> None:
    model = load_model(None, dtype=torch.float32)
    settings: dict[str, Any] = {"dtype": "float32", "kv_cache_mb": 64, "max_model_len": 1024}
    engines: list[LLMEngine] = []

    def engine(**overrides: Any) -> LLMEngine:
        engines.append(LLMEngine(EngineConfig(**settings, **overrides), loaded=model))
        return engines[-1]

    try:
        probe = engine()
        history = probe.tokenizer.apply_chat_template(
            [{"role": "user", "content": "Remember: " + " ".join(["river stone cloud"] * 80)}]
        )
        turn = [*history, *probe.tokenizer.encode(" Which word came first?")]
        reference, _ = answer(probe, "ref", turn, greedy(16))
        tier = KVTierConfig(directory=tmp_path)
        store(engine(kv_tier=tier), history)
        got, last = answer(engine(kv_tier=tier), "turn", turn, greedy(16))
        assert last.num_loaded_tokens == len(history) // BLOCK * BLOCK
        assert_same_greedy({"r": reference}, {"r": got})
    finally:
        for e in engines:
            e.check_balanced()
            e.close()


def test_a_loaded_prompt_admitted_in_a_pure_decode_step_runs_through_the_decode_graphs(
    make_engine: EngineFactory, tmp_path: Path
) -> None:
    # 8 whole blocks from the tier and one new token: the admitting step's only chunk is one
    # token that samples, so the step is a pure decode step carrying LOAD ops, and it takes
    # the decode graphs' path (service/engine/cuda_graphs.py), which must copy them in too.
    history = prompt(11, 8 * BLOCK)
    turn = [*history, *prompt(12, 1)]
    reference, _ = answer(make_engine(), "ref", turn, greedy(6))
    tier = KVTierConfig(directory=tmp_path)
    store(make_engine(kv_tier=tier), history)
    reader = make_engine(kv_tier=tier)
    graphs = with_eager_graphs(reader, max_num_seqs=4)
    got, last = answer(reader, "turn", turn, greedy(6))
    assert last.num_loaded_tokens == 8 * BLOCK
    assert graphs.steps[0] == (True, [(1, True)])  # the admitting step: through the graphs
    assert_same_greedy({"r": reference}, {"r": got})
