"""The /v1/stats document: one JSON snapshot of pools, caches, queues, sessions and the loop."""

from __future__ import annotations

import msgspec

from service.api.admission import Admission
from service.api.observability.loop_lag import LagSummary, LoopLagMonitor
from service.engine.serving import ServingEngine
from service.engine.values import KVTierStats, PoolUsage


class Pool(msgspec.Struct, kw_only=True):
    total: int
    free: int
    cached: int
    in_use: int


class KVStats(msgspec.Struct, kw_only=True):
    block_size: int
    device: Pool
    cpu: Pool


class PrefixCacheStats(msgspec.Struct, kw_only=True):
    queries: int  # prompt tokens looked up
    hits: int  # found on the device
    cpu_hits: int  # found in the CPU pool, swapped back in
    tier_hits: int  # loaded from the third tier
    hit_rate: float  # (hits + cpu_hits + tier_hits) / queries


class SwapStats(msgspec.Struct, kw_only=True):
    blocks_swapped_out: int
    blocks_swapped_in: int
    blocks_dropped: int
    preemptions_swap: int
    preemptions_recompute: int


class QueueStats(msgspec.Struct, kw_only=True):
    waiting: int
    running: int
    swapped: int
    inflight_turns: int  # answers this server has accepted and not finished


class SessionStats(msgspec.Struct, kw_only=True):
    open_connections: int
    attached: int  # connections with a session open
    answering: int  # sessions with an answer in flight
    draining: bool


class EngineCounters(msgspec.Struct, kw_only=True):
    steps: int
    prompt_tokens: int  # every answer's prompt, cached or not
    prompt_tokens_computed: int
    tokens_generated: int
    step_overhead_share: float  # share of step time outside the model forward


class TierBackend(msgspec.Struct, kw_only=True):
    name: str  # dir | redis
    entries: int
    bytes: int
    cap_bytes: int
    available: bool  # false while left alone after a failure


class TierStats(msgspec.Struct, kw_only=True):
    """The third KV tier (docs/config.md, --kv-tier-*)."""

    codec: str
    backends: list[TierBackend]
    blocks_written: int
    bytes_written: int
    writes_dropped: int  # the write queue was full, or no backend was up
    write_errors: int
    pending_writes: int
    loads: int
    loads_timed_out: int
    blocks_loaded: int
    blocks_missed: int
    blocks_rejected: dict[str, int]  # by reason: malformed, foreign, truncated, checksum
    read_errors: int


def tier_stats(t: KVTierStats) -> TierStats:
    return TierStats(
        codec=t.codec,
        backends=[
            TierBackend(
                name=b.name,
                entries=b.entries,
                bytes=b.bytes,
                cap_bytes=b.cap_bytes,
                available=b.available,
            )
            for b in t.backends
        ],
        blocks_written=t.blocks_written,
        bytes_written=t.bytes_written,
        writes_dropped=t.writes_dropped,
        write_errors=t.write_errors,
        pending_writes=t.pending_writes,
        loads=t.loads,
        loads_timed_out=t.loads_timed_out,
        blocks_loaded=t.blocks_loaded,
        blocks_missed=t.blocks_missed,
        blocks_rejected=t.blocks_rejected,
        read_errors=t.read_errors,
    )


class Stats(msgspec.Struct, kw_only=True):
    model_id: str
    weights: str  # the layers' matmul weights: GGUF types where packed ("Q4_1"), or fp32 | bf16
    weight_dtype: str  # the dense matmul weights' (what --dtype auto chose, or was told)
    activation_dtype: str  # the activations'
    kv_cache_dtype: str  # the KV cache's (float16 on a CPU by default)
    decode_threads: int  # the native decode stack's threads; 0: decode steps run op by op
    cpu_kernels: str  # the CPU kernels' version ("avx2"; a kernel that differs in brackets)
    kv: KVStats
    prefix_cache: PrefixCacheStats
    swaps: SwapStats
    queue: QueueStats
    sessions: SessionStats
    engine: EngineCounters
    event_loop_lag: LagSummary
    kv_tier: TierStats | None  # null: no third tier


def _pool(usage: PoolUsage) -> Pool:
    return Pool(total=usage.total, free=usage.free, cached=usage.cached, in_use=usage.in_use)


def collect(
    engine: ServingEngine,
    admission: Admission,
    lag: LoopLagMonitor,
    lag_window_s: float = 60.0,
) -> Stats:
    s = engine.stats()
    b = s.blocks
    return Stats(
        model_id=engine.model_id,
        weights=engine.precision.weights,
        weight_dtype=engine.precision.weight_dtype,
        activation_dtype=engine.precision.activation_dtype,
        kv_cache_dtype=engine.precision.kv_cache_dtype or engine.precision.activation_dtype,
        decode_threads=engine.precision.decode_threads,
        cpu_kernels=engine.precision.cpu_kernels,
        kv=KVStats(block_size=engine.limits.block_size, device=_pool(b.device), cpu=_pool(b.cpu)),
        prefix_cache=PrefixCacheStats(
            queries=b.prefix_queries,
            hits=b.prefix_hits,
            cpu_hits=b.prefix_cpu_hits,
            tier_hits=b.prefix_tier_hits,
            hit_rate=(b.prefix_hits + b.prefix_cpu_hits + b.prefix_tier_hits) / b.prefix_queries
            if b.prefix_queries
            else 0.0,
        ),
        swaps=SwapStats(
            blocks_swapped_out=b.blocks_swapped_out,
            blocks_swapped_in=b.blocks_swapped_in,
            blocks_dropped=b.blocks_dropped,
            preemptions_swap=s.preemptions_swap,
            preemptions_recompute=s.preemptions_recompute,
        ),
        queue=QueueStats(
            waiting=s.num_waiting,
            running=s.num_running,
            swapped=s.num_swapped,
            inflight_turns=admission.answers_in_flight,
        ),
        sessions=SessionStats(
            open_connections=len(admission.connections),
            attached=sum(c.session_id is not None for c in admission.connections),
            answering=len(admission.answering_sessions),
            draining=admission.draining,
        ),
        engine=EngineCounters(
            steps=s.steps,
            prompt_tokens=s.prompt_tokens,
            prompt_tokens_computed=s.prompt_tokens_computed,
            tokens_generated=s.tokens_generated,
            step_overhead_share=s.timing.overhead_share,
        ),
        event_loop_lag=lag.summary(lag_window_s),
        kv_tier=tier_stats(s.kv_tier) if s.kv_tier is not None else None,
    )
