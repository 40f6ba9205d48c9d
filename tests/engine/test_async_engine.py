"""AsyncEngine: steps on the engine thread, streams on the loop, aborts on cancellation."""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading

import pytest

from service.engine.async_engine import AsyncEngine
from service.engine.params import SamplingParams
from service.engine.values import CacheScope, EngineDeadError, RequestError, RequestOutput
from tests.engine.conftest import EngineFactory
from tests.engine.greedy import greedy, run


def prompt(seed: int, length: int = 30) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(17, 49152) for _ in range(length)]


async def collect(engine: AsyncEngine, ids: list[int], params: SamplingParams) -> list[int]:
    tokens: list[int] = []
    async for out in engine.generate(ids, params):
        tokens += out.new_token_ids
    return tokens


async def test_concurrent_streams_match_the_sync_engine(make_engine: EngineFactory) -> None:
    prompts = {f"r{i}": prompt(i, 10 + 7 * i) for i in range(6)}
    expected = run(make_engine(), prompts, greedy(10))
    engine = AsyncEngine(make_engine())
    await engine.start()
    try:
        got = await asyncio.gather(*(collect(engine, p, greedy(10)) for p in prompts.values()))
    finally:
        await engine.stop()
    assert got == [expected[rid].token_ids for rid in prompts]


async def test_cancelling_a_stream_aborts_its_request_and_frees_blocks(
    make_engine: EngineFactory,
) -> None:
    sync_engine = make_engine()
    engine = AsyncEngine(sync_engine)
    await engine.start()
    started = asyncio.Event()

    async def consume() -> None:
        async for _ in engine.generate(prompt(1), greedy(10_000 // 32)):
            started.set()

    task = asyncio.create_task(consume())
    try:
        await asyncio.wait_for(started.wait(), timeout=60)
        assert engine.stats().blocks.device.in_use > 0
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        for _ in range(200):  # the engine thread aborts it before its next step
            if engine.stats().blocks.device.in_use == 0 and engine.stats().num_running == 0:
                break
            await asyncio.sleep(0.01)
        assert engine.stats().blocks.device.in_use == 0
        assert engine.num_active_requests == 0
    finally:
        await engine.stop()


async def test_leaving_a_stream_early_aborts_its_request(make_engine: EngineFactory) -> None:
    sync_engine = make_engine()
    engine = AsyncEngine(sync_engine)
    await engine.start()
    try:
        outputs: list[RequestOutput] = []
        async with contextlib.aclosing(engine.generate(prompt(2), greedy(300))) as stream:
            async for out in stream:
                outputs.append(out)
                if len(outputs) == 3:
                    break
        for _ in range(200):
            if engine.stats().num_running == 0 and engine.stats().blocks.device.in_use == 0:
                break
            await asyncio.sleep(0.01)
        assert engine.stats().blocks.device.in_use == 0
    finally:
        await engine.stop()
    assert len(outputs) == 3 and not outputs[-1].finished


async def test_rejected_requests_raise_in_the_caller(make_engine: EngineFactory) -> None:
    engine = AsyncEngine(make_engine(max_model_len=32))
    await engine.start()
    try:
        with pytest.raises(RequestError, match="context holds 32"):
            await collect(engine, prompt(3, 40), greedy(4))
        # The engine keeps serving after a rejection.
        assert len(await collect(engine, prompt(4, 10), greedy(4))) == 4
    finally:
        await engine.stop()


async def test_parallel_samples_arrive_on_one_stream(make_engine: EngineFactory) -> None:
    engine = AsyncEngine(make_engine())
    await engine.start()
    try:
        params = SamplingParams(temperature=0.7, seed=5, n=3, max_tokens=5, ignore_eos=True)
        per_sample: dict[int, int] = {}
        async for out in engine.generate(prompt(5), params):
            per_sample[out.index] = per_sample.get(out.index, 0) + len(out.new_token_ids)
    finally:
        await engine.stop()
    assert per_sample == {0: 5, 1: 5, 2: 5}


async def test_a_kv_snapshot_is_taken_between_steps_and_refused_once_stopped(
    make_engine: EngineFactory,
) -> None:
    engine = AsyncEngine(make_engine(block_size=4))
    await engine.start()
    try:
        # Far more tokens than the test reads, so the sequence is still running when the
        # engine thread runs ahead of a slow consumer; leaving the stream aborts it.
        params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        async with contextlib.aclosing(engine.generate(prompt(6, 21), params, "pm")) as stream:
            # Snapshots after several tokens land at every offset within a block.
            seen_lengths = set()
            for _ in range(6):
                await anext(stream)
                (seq,) = (await engine.kv_snapshot()).sequences
                assert (seq.request_id, seq.status) == ("pm", "running")
                # Between steps a decoding sequence's newest token has no K/V yet, and
                # its slot is only taken when the next step is scheduled: the blocks
                # hold exactly the computed tokens.
                assert seq.num_computed_tokens == seq.num_tokens - 1
                assert len(seq.blocks) == -(-seq.num_computed_tokens // 4)
                seen_lengths.add(seq.num_tokens % 4)
            assert len(seen_lengths) > 1
        # Leaving the stream queued its abort; the snapshot, queued after it, sees it done.
        assert (await engine.kv_snapshot()).num_sequences == 0
    finally:
        await engine.stop()
    with pytest.raises(EngineDeadError):
        await engine.kv_snapshot()


async def test_a_kv_snapshot_asked_for_when_the_engine_fails_fails_too(
    make_engine: EngineFactory,
) -> None:
    sync_engine = make_engine()
    in_step, fail_now = threading.Event(), threading.Event()

    def failing_step() -> list[RequestOutput]:
        in_step.set()
        fail_now.wait(10)
        raise RuntimeError("injected step failure")

    sync_engine.step = failing_step  # type: ignore[method-assign]
    engine = AsyncEngine(sync_engine)
    await engine.start()
    stream = engine.generate(prompt(7), greedy(4), "boom")
    first = asyncio.create_task(anext(stream))
    await asyncio.to_thread(in_step.wait, 10)
    snapshot = asyncio.create_task(engine.kv_snapshot())
    await asyncio.sleep(0.05)  # queued behind the step in flight
    fail_now.set()
    with pytest.raises(EngineDeadError):
        await asyncio.wait_for(snapshot, 10)
    with pytest.raises(EngineDeadError):
        await first
    await stream.aclose()
    await engine.stop()
    sync_engine.abort("boom")  # the dead thread never did; the pools must balance after it


async def test_generate_passes_the_cache_scope_to_the_engine(make_engine: EngineFactory) -> None:
    engine = AsyncEngine(make_engine(block_size=16))
    await engine.start()
    ids = prompt(3, length=40)  # 2 full blocks of 16; the system prompt fills the first

    async def cached_tokens(private: str) -> int:
        scope = CacheScope(private=private, shared_tokens=16)
        outs = [out async for out in engine.generate(ids, greedy(2), cache_scope=scope)]
        return outs[-1].num_cached_tokens

    try:
        assert [await cached_tokens(p) for p in ("a", "b", "a")] == [0, 16, 32]
    finally:
        await engine.stop()
