"""The engine's outputs do not depend on how requests were batched, cached, paged or preempted."""

from __future__ import annotations

import random

import pytest

from service.engine.params import SamplingParams
from service.engine.values import CacheScope, RequestError, Tier
from tests.engine.conftest import EngineFactory
from tests.engine.greedy import assert_same_greedy, greedy, run


def random_prompts(n: int, *, seed: int, lengths: tuple[int, int]) -> dict[str, list[int]]:
    rng = random.Random(seed)
    # ids from 17 up: 0-16 are control tokens of the SmolLM2 vocabulary
    return {
        f"r{i}": [rng.randrange(17, 49152) for _ in range(rng.randint(*lengths))] for i in range(n)
    }


def shared_prefix_prompts(n: int, *, seed: int, prefix_len: int) -> dict[str, list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(17, 49152) for _ in range(prefix_len)]
    return {
        f"r{i}": prefix + [rng.randrange(17, 49152) for _ in range(rng.randint(1, 20))]
        for i in range(n)
    }


def run_alone(make_engine: EngineFactory, prompts: dict[str, list[int]], max_tokens: int) -> dict:
    """Each request on its own fresh engine: the reference for every equality test."""
    results = {}
    for rid, prompt in prompts.items():
        engine = make_engine(enable_prefix_caching=False)
        results |= run(engine, {rid: prompt}, greedy(max_tokens))
    return results


def test_request_alone_matches_batch_of_32_joining_at_different_steps(
    make_engine: EngineFactory,
) -> None:
    prompts = random_prompts(32, seed=1, lengths=(3, 150))
    rng = random.Random(2)
    join_at = {rid: rng.randrange(0, 24) for rid in prompts}
    alone = run_alone(make_engine, prompts, max_tokens=12)
    # A budget of 64 tokens forces chunked prefills mixed with decodes.
    engine = make_engine(max_num_batched_tokens=64, max_num_seqs=32)
    batched = run(engine, prompts, greedy(12), join_at=join_at)
    assert_same_greedy(alone, batched)
    assert engine.stats().steps < sum(len(p) for p in prompts.values()) / 4


def test_prefix_cache_on_and_off_give_the_same_tokens(make_engine: EngineFactory) -> None:
    prompts = shared_prefix_prompts(12, seed=3, prefix_len=70)
    first = {"warm": prompts.pop("r0")}
    results = {}
    for caching in (False, True):
        engine = make_engine(enable_prefix_caching=caching, block_size=16)
        out = run(engine, first, greedy(8))
        out |= run(engine, prompts, greedy(8))
        results[caching] = out
        hits = engine.stats().blocks.prefix_hits
        # 70 shared tokens = 4 full blocks of 16, found by each of the 11 later prompts
        assert hits == (11 * 64 if caching else 0)
    assert_same_greedy(results[False], results[True])


def test_prompts_sharing_a_prefix_sent_at_once_compute_it_once(
    make_engine: EngineFactory,
) -> None:
    """Users opening with the same system prompt in the same step: the first computes its
    full blocks and the others, admitted in that very step, share them."""
    prompts = shared_prefix_prompts(4, seed=21, prefix_len=70)  # 4 full blocks of 16 shared
    engine = make_engine(block_size=16, max_num_batched_tokens=256)
    batched = run(engine, prompts, greedy(8))
    stats = engine.stats()
    assert stats.steps == 8, "all four prompts were admitted in the first step"
    assert stats.blocks.prefix_hits == 3 * 64
    total = sum(len(p) for p in prompts.values())
    assert stats.prompt_tokens == total  # every prompt token, the shared ones included
    assert stats.prompt_tokens_computed == total - 3 * 64
    assert_same_greedy(run_alone(make_engine, prompts, max_tokens=8), batched)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_under_a_tiny_kv_budget_keeps_outputs(
    make_engine: EngineFactory, mode: str
) -> None:
    prompts = random_prompts(8, seed=4, lengths=(20, 40))
    ample = run(make_engine(block_size=8), prompts, greedy(24))
    # 8 sequences of up to 64 tokens need up to 64 blocks of 8; give them 20.
    engine = make_engine(
        block_size=8, num_device_blocks=20, num_cpu_blocks=64, preemption_mode=mode
    )
    tight = run(engine, prompts, greedy(24))
    stats = engine.stats()
    if mode == "swap":
        assert stats.preemptions_swap > 0 and stats.blocks.blocks_swapped_in > 0
    else:
        assert stats.preemptions_recompute > 0
    assert_same_greedy(ample, tight)


def test_swap_preemption_falls_back_to_recompute_without_cpu_room(
    make_engine: EngineFactory,
) -> None:
    prompts = random_prompts(6, seed=5, lengths=(20, 40))
    ample = run(make_engine(block_size=8), prompts, greedy(20))
    engine = make_engine(block_size=8, num_device_blocks=16, num_cpu_blocks=0)
    tight = run(engine, prompts, greedy(20))
    assert engine.stats().preemptions_recompute > 0
    assert_same_greedy(ample, tight)


def test_paged_and_contiguous_allocation_give_the_same_tokens(make_engine: EngineFactory) -> None:
    prompts = random_prompts(10, seed=6, lengths=(5, 60))
    paged = run(make_engine(max_model_len=128), prompts, greedy(16))
    engine = make_engine(max_model_len=128, allocation="contiguous", num_device_blocks=40)
    contiguous = run(engine, prompts, greedy(16))
    assert_same_greedy(paged, contiguous)


def test_contiguous_mode_reserves_max_model_len_per_sequence(make_engine: EngineFactory) -> None:
    engine = make_engine(max_model_len=128, allocation="contiguous", num_device_blocks=40)
    engine.add_request("a", [20, 21, 22], greedy(2))
    engine.step()
    assert engine.stats().blocks.device.in_use == 128 // 16
    engine.abort("a")


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_block_size_does_not_change_tokens(make_engine: EngineFactory, block_size: int) -> None:
    prompts = random_prompts(6, seed=7, lengths=(5, 90))
    reference = run_alone(make_engine, prompts, max_tokens=10)
    got = run(make_engine(block_size=block_size), prompts, greedy(10))
    assert_same_greedy(reference, got)


def test_parallel_samples_share_prompt_blocks_and_copy_on_write(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine(block_size=16)
    prompt = random_prompts(1, seed=8, lengths=(40, 40))["r0"]  # 2.5 blocks: a partial tail
    params = SamplingParams(temperature=1.0, seed=11, n=4, max_tokens=6, ignore_eos=True)
    engine.add_request("n4", prompt, params)
    engine.step()  # prefill, then fork: 3 full blocks + 1 shared partial block
    assert engine.stats().blocks.device.in_use == 3
    samples: dict[int, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            samples.setdefault(out.index, []).extend(out.new_token_ids)
    stats = engine.stats().blocks
    assert stats.blocks_copied == 3  # three writers copied the shared tail; the last wrote in place
    assert sorted(samples) == [0, 1, 2, 3]
    assert len({tuple(s) for s in samples.values()}) > 1, "seeded samples should differ"


def test_greedy_parallel_samples_equal_the_single_answer(make_engine: EngineFactory) -> None:
    prompts = random_prompts(1, seed=9, lengths=(30, 30))
    single = run(make_engine(), prompts, greedy(8))["r0"].token_ids
    engine = make_engine()
    params = SamplingParams(temperature=0.0, n=3, max_tokens=8, ignore_eos=True)
    engine.add_request("r0", prompts["r0"], params)
    samples: dict[int, list[int]] = {0: [], 1: [], 2: []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            samples[out.index] += out.new_token_ids
    assert all(s == single for s in samples.values())


def test_seeded_sampling_is_reproducible(make_engine: EngineFactory) -> None:
    prompts = random_prompts(3, seed=10, lengths=(10, 30))
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=123, max_tokens=10)
    a = run(make_engine(), prompts, params)
    b = run(make_engine(max_num_batched_tokens=16, max_num_seqs=16), prompts, params)
    assert {k: v.token_ids for k, v in a.items()} == {k: v.token_ids for k, v in b.items()}
    other = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=124, max_tokens=10)
    c = run(make_engine(), prompts, other)
    assert {k: v.token_ids for k, v in a.items()} != {k: v.token_ids for k, v in c.items()}


def test_max_tokens_and_stop_token_ids_end_a_request(make_engine: EngineFactory) -> None:
    engine = make_engine()
    prompt = random_prompts(1, seed=12, lengths=(10, 10))["r0"]
    first = run(engine, {"a": prompt}, greedy(5))["a"]
    assert len(first.token_ids) == 5 and first.finish_reason == "length"
    stop_at = first.token_ids[2]
    params = SamplingParams(temperature=0.0, max_tokens=5, stop_token_ids=(stop_at,))
    stopped = run(engine, {"b": prompt}, params)["b"]
    assert stopped.token_ids == first.token_ids[:3] and stopped.finish_reason == "stop"


def test_min_tokens_holds_back_stop_tokens_and_stop_strings(make_engine: EngineFactory) -> None:
    """Before min_tokens the sampler may not pick a stop token (the next likeliest comes
    instead) and no stop string ends the answer; after it both stop as usual."""
    engine = make_engine()
    prompt = random_prompts(1, seed=12, lengths=(10, 10))["r0"]
    free = run(engine, {"a": prompt}, greedy(6))["a"]
    stop_at = free.token_ids[0]
    params = SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=(stop_at,), min_tokens=3)
    held = run(engine, {"b": prompt}, params)["b"]
    assert stop_at not in held.token_ids[:3] and len(held.token_ids) >= 3
    assert held.finish_reason == "length" or held.token_ids[-1] == stop_at
    text = engine.tokenizer.decode(free.token_ids)
    by_string = SamplingParams(temperature=0.0, max_tokens=6, stop=(text[:1],), min_tokens=4)
    late = run(engine, {"c": prompt}, by_string)["c"]
    assert len(late.token_ids) >= 4


def test_abort_releases_every_block(make_engine: EngineFactory) -> None:
    engine = make_engine()
    for rid, prompt in random_prompts(4, seed=13, lengths=(30, 60)).items():
        engine.add_request(rid, prompt, greedy(50))
    for _ in range(3):
        engine.step()
    assert engine.stats().blocks.device.in_use > 0
    for rid in ("r0", "r1", "r2", "r3"):
        assert engine.abort(rid)
    assert engine.stats().blocks.device.in_use == 0
    assert not engine.abort("r0")


def test_prompts_that_cannot_fit_are_rejected_clearly(make_engine: EngineFactory) -> None:
    engine = make_engine(max_model_len=64, num_device_blocks=8, block_size=4)
    with pytest.raises(RequestError, match="context holds 64"):
        engine.add_request("long", list(range(20, 84)), greedy(1))
    with pytest.raises(RequestError, match="KV blocks"):
        engine.add_request("big", list(range(20, 60)), greedy(1))
    with pytest.raises(RequestError, match="empty"):
        engine.add_request("empty", [], greedy(1))
    engine.add_request("ok", [20, 21], greedy(1))
    with pytest.raises(RequestError, match="already running"):
        engine.add_request("ok", [20, 21], greedy(1))
    engine.abort("ok")


def test_stats_report_pools_queues_and_hits(make_engine: EngineFactory) -> None:
    engine = make_engine(block_size=16)
    prompt = random_prompts(1, seed=14, lengths=(50, 50))["r0"]
    run(engine, {"a": prompt}, greedy(4))
    run(engine, {"b": prompt}, greedy(4))
    stats = engine.stats()
    assert stats.blocks.prefix_hits == 48  # 3 full blocks of the 50-token prompt
    assert stats.blocks.device.in_use == 0 and stats.blocks.device.cached >= 3
    assert stats.num_running == stats.num_waiting == stats.num_swapped == 0
    assert stats.tokens_generated == 8


def test_prefill_only_request_caches_the_whole_prompt(make_engine: EngineFactory) -> None:
    engine = make_engine(block_size=16)
    prompt = random_prompts(1, seed=15, lengths=(48, 48))["r0"]  # exactly 3 blocks
    done = run(engine, {"warm": prompt}, SamplingParams(max_tokens=0))["warm"]
    assert done.token_ids == [] and done.finish_reason == "length"
    stats = engine.stats()
    assert stats.blocks.device.cached == 3 and stats.tokens_generated == 0
    assert stats.blocks.prefix_queries == 0, "cache completion is not counted as user traffic"
    assert stats.prompt_tokens == 0
    # A conversation that continues the prompt finds all three blocks, the last one included.
    run(engine, {"next": [*prompt, 300, 301]}, greedy(2))
    assert engine.stats().blocks.prefix_hits == 48
    assert engine.stats().prompt_tokens == 50  # an answer's prompt counts, cached or not


def test_parallel_samples_never_exceed_max_num_seqs(make_engine: EngineFactory) -> None:
    engine = make_engine(max_num_seqs=2, max_num_batched_tokens=64)
    prompt = random_prompts(1, seed=16, lengths=(20, 20))["r0"]
    params = SamplingParams(temperature=0.0, n=4, max_tokens=3, ignore_eos=True)
    engine.add_request("n4", prompt, params)
    samples: dict[int, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            samples.setdefault(out.index, []).extend(out.new_token_ids)
        assert engine.stats().num_running <= 2
    assert sorted(samples) == [0, 1, 2, 3]
    assert len({tuple(s) for s in samples.values()}) == 1  # greedy: all alike


def test_a_kv_snapshot_shows_every_live_table_and_the_slots_they_hold(
    make_engine: EngineFactory,
) -> None:
    """Forked samples share their prompt's full blocks: the snapshot shows them shared, each
    sample's own last block in use, and nothing left but cached blocks once they finish."""
    from service.engine.values import SlotState

    engine = make_engine(block_size=4, max_num_batched_tokens=64)
    prompt = random_prompts(1, seed=17, lengths=(10, 10))["r0"]  # 2 full blocks + 2 tokens
    params = SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=4, ignore_eos=True)
    engine.add_request("fork", prompt, params)
    engine.step()  # prefill, then the samples fork
    engine.step()
    snapshot = engine.kv_snapshot()
    assert snapshot.block_size == 4
    assert snapshot.num_sequences == len(snapshot.sequences) == 3
    assert sorted(s.sample_index for s in snapshot.sequences) == [0, 1, 2]
    holders: dict[tuple[Tier, int], int] = {}
    for seq in snapshot.sequences:
        assert seq.request_id == "fork" and seq.status == "running"
        # The newest token has no K/V yet: the blocks hold the computed tokens.
        assert len(seq.blocks) == -(-seq.num_computed_tokens // 4)
        for block in seq.blocks:
            holders[block] = holders.get(block, 0) + 1
    for (tier, slot), count in holders.items():
        states = snapshot.device if tier is Tier.DEVICE else snapshot.cpu
        assert states[slot] is (SlotState.SHARED if count > 1 else SlotState.IN_USE)
    held = sum(s in (SlotState.IN_USE, SlotState.SHARED) for s in snapshot.device)
    assert held == len(holders)
    assert engine.kv_snapshot(max_sequences=1).sequences == snapshot.sequences[:1]

    while engine.has_unfinished_requests():
        engine.step()
    idle = engine.kv_snapshot()
    assert idle.sequences == [] and idle.num_sequences == 0
    assert set(idle.device) <= {SlotState.FREE, SlotState.CACHED}
    assert SlotState.CACHED in idle.device


def test_sessions_with_private_scopes_share_only_the_system_prompts_blocks(
    make_engine: EngineFactory,
) -> None:
    """Two sessions send the same 70 tokens, of which a 32-token system prompt (2 blocks of
    16): the second finds only those 2 blocks, the first's next turn all 4, an unscoped
    request the shared 2, another tenant none; the tokens are the same as alone."""
    prompt = random_prompts(1, seed=22, lengths=(70, 70))["r0"]
    alice = CacheScope(private="alice", shared_tokens=32)
    bob = CacheScope(private="bob", shared_tokens=32)
    reference = run_alone(make_engine, {"r": prompt}, max_tokens=8)["r"].token_ids
    engine = make_engine(block_size=16)
    turns = [
        ("alice", alice),
        ("bob", bob),
        ("alice-again", alice),
        ("unscoped", None),
        ("tenant", CacheScope(salt="t2", private="alice", shared_tokens=32)),
    ]
    cached = {}
    for rid, scope in turns:
        engine.add_request(rid, prompt, greedy(8), cache_scope=scope)
        tokens: list[int] = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens += out.new_token_ids
                cached[rid] = out.num_cached_tokens
        assert tokens == reference, rid
    assert cached == {"alice": 0, "bob": 32, "alice-again": 64, "unscoped": 32, "tenant": 0}
    bobs, alices = engine.pages_of(prompt, bob), engine.pages_of(prompt, alice)
    assert bobs.block_hashes[:2] == alices.block_hashes[:2]
    assert bobs.block_hashes[2:] != alices.block_hashes[2:]
    # Both sessions' blocks stay cached on the device; a third's were never computed.
    assert alices.tiers == bobs.tiers == [Tier.DEVICE] * 4
    assert engine.pages_of(prompt, CacheScope(private="carol", shared_tokens=32)).tiers == [
        *([Tier.DEVICE] * 2),
        None,
        None,
    ]
