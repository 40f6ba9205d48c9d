"""Prometheus metrics, named as people already graph them (vLLM's names, pagechat_ prefix).

Engine figures (pools, prefix cache, swaps, preemptions, queues, tokens) are read from the
engine's latest stats snapshot at scrape time, so nothing is counted twice. Latencies and
connections are observed by the API layer as they happen. Every pagechat_ series carries a
`model_name` label (the served model name, as vLLM's carry theirs), so dashboards that filter
by model work unchanged; the process_ and python_ series are prometheus_client's own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from service.engine.values import EnginePrecision, EngineStats, KVTierStats

_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
    1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
# Token counts, 1-2-5 per decade (vLLM's buckets for its length histograms).
_TOKEN_BUCKETS = tuple(m * 10**e for e in range(6) for m in (1, 2, 5))
_LAG_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterable[Metric]:
        s = self._stats()
        b = s.blocks
        yield _gauge(
            "pagechat_kv_cache_usage_perc",
            "Fraction of device KV blocks in use (1 = full).",
            b.device.in_use / b.device.total,
        )
        yield _gauge(  # vLLM's older name, which its example dashboard reads
            "pagechat_gpu_cache_usage_perc",
            "Fraction of device KV blocks in use (vLLM's older name of kv_cache_usage_perc).",
            b.device.in_use / b.device.total,
        )
        yield _gauge(
            "pagechat_cpu_kv_cache_usage_perc",
            "Fraction of CPU swap-pool KV blocks in use.",
            b.cpu.in_use / b.cpu.total if b.cpu.total else 0.0,
        )
        blocks = GaugeMetricFamily(
            "pagechat_kv_cache_blocks", "KV blocks by tier and state.", labels=["tier", "state"]
        )
        for tier, usage in (("device", b.device), ("cpu", b.cpu)):
            blocks.add_metric([tier, "free"], usage.free)
            blocks.add_metric([tier, "cached"], usage.cached)
            blocks.add_metric([tier, "in_use"], usage.in_use)
        yield blocks
        yield _counter(
            "pagechat_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
            b.prefix_queries,
        )  # fmt: skip
        yield _counter(
            "pagechat_prefix_cache_hits", "Prompt tokens found on the device.", b.prefix_hits
        )
        yield _counter(
            "pagechat_prefix_cache_cpu_hits",
            "Prompt tokens found in the CPU pool and swapped back in.",
            b.prefix_cpu_hits,
        )
        yield _counter(
            "pagechat_kv_blocks_swapped_out", "KV blocks moved device -> CPU.", b.blocks_swapped_out
        )
        yield _counter(
            "pagechat_kv_blocks_swapped_in", "KV blocks moved CPU -> device.", b.blocks_swapped_in
        )
        yield _counter(
            "pagechat_kv_blocks_dropped", "Cached KV blocks dropped for lack of room.",
            b.blocks_dropped,
        )  # fmt: skip
        preemptions = CounterMetricFamily(
            "pagechat_num_preemptions", "Sequences preempted, by mode.", labels=["mode"]
        )
        preemptions.add_metric(["swap"], s.preemptions_swap)
        preemptions.add_metric(["recompute"], s.preemptions_recompute)
        yield preemptions
        yield _gauge("pagechat_num_requests_waiting", "Requests waiting.", s.num_waiting)
        yield _gauge("pagechat_num_requests_running", "Requests running.", s.num_running)
        yield _gauge("pagechat_num_requests_swapped", "Requests swapped out.", s.num_swapped)
        yield _counter(
            "pagechat_prompt_tokens", "Prompt tokens of every answer, cached or not.",
            s.prompt_tokens,
        )  # fmt: skip
        yield _counter(
            "pagechat_prompt_tokens_computed", "Prompt tokens computed (not cached).",
            s.prompt_tokens_computed,
        )  # fmt: skip
        yield _counter("pagechat_generation_tokens", "Tokens generated.", s.tokens_generated)
        yield _counter(
            "pagechat_prefix_cache_tier_hits",
            "Prompt tokens loaded from the third KV tier.",
            b.prefix_tier_hits,
        )
        if s.kv_tier is not None:
            yield from _tier_metrics(s.kv_tier)


def _tier_metrics(t: KVTierStats) -> Iterable[Metric]:
    stored = GaugeMetricFamily(
        "pagechat_kv_tier_bytes", "Bytes the third KV tier holds, by backend.", labels=["backend"]
    )
    entries = GaugeMetricFamily(
        "pagechat_kv_tier_blocks", "Blocks the third KV tier holds, by backend.", labels=["backend"]
    )
    for b in t.backends:
        stored.add_metric([b.name], b.bytes)
        entries.add_metric([b.name], b.entries)
    yield stored
    yield entries
    yield _counter(
        "pagechat_kv_tier_blocks_written", "Blocks written to the tier.", t.blocks_written
    )
    yield _counter(
        "pagechat_kv_tier_writes_dropped",
        "Blocks not written: the queue was full or no backend was up.",
        t.writes_dropped,
    )
    yield _counter(
        "pagechat_kv_tier_blocks_loaded", "Blocks loaded from the tier.", t.blocks_loaded
    )
    yield _counter(
        "pagechat_kv_tier_blocks_missed", "Blocks asked for, not found.", t.blocks_missed
    )
    rejected = CounterMetricFamily(
        "pagechat_kv_tier_blocks_rejected", "Blocks failing a check, by reason.", labels=["reason"]
    )
    for reason in ("malformed", "foreign", "truncated", "checksum"):
        rejected.add_metric([reason], t.blocks_rejected.get(reason, 0))
    yield rejected
    errors = CounterMetricFamily(
        "pagechat_kv_tier_errors", "Tier operations that failed, by kind.", labels=["op"]
    )
    errors.add_metric(["write"], t.write_errors)
    errors.add_metric(["read"], t.read_errors)
    yield errors
    yield _gauge("pagechat_kv_tier_pending_writes", "Blocks queued for writing.", t.pending_writes)
    yield _counter("pagechat_kv_tier_loads_timed_out", "Loads given up.", t.loads_timed_out)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


class _ModelNamed:
    """A registry's families with `model_name` added to every pagechat_ sample.

    prometheus_client has no constant labels (the Go client's ConstLabels); adding the label
    at scrape time keeps every observation site unaware of it, and the name is known only once
    the model is loaded, after the metrics exist.
    """

    def __init__(self, registry: CollectorRegistry, model_name: Callable[[], str]) -> None:
        self._registry = registry
        self._model_name = model_name

    def collect(self) -> Iterable[Metric]:
        name = self._model_name()
        for family in self._registry.collect():
            if family.name.startswith("pagechat_"):
                family.samples = [
                    s._replace(labels={"model_name": name, **s.labels}) for s in family.samples
                ]
            yield family


class Metrics:
    """One registry per server (not the process-global one), so servers and tests coexist.

    `model_name`: the name the server answers to (the first --served-model-name), read at
    each scrape."""

    def __init__(
        self, engine_stats: Callable[[], EngineStats], model_name: Callable[[], str]
    ) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.time_to_first_token = Histogram(
            "pagechat_time_to_first_token_seconds",
            "User message received -> first token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            "pagechat_inter_token_latency_seconds",
            "Time between consecutive tokens of an answer.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.time_per_output_token = Histogram(
            "pagechat_time_per_output_token_seconds",
            "Time between consecutive tokens of an answer (vLLM's older name, its dashboard's).",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.request_prompt_tokens = Histogram(
            "pagechat_request_prompt_tokens",
            "Prompt tokens of each answered request (cached or not).",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.request_generation_tokens = Histogram(
            "pagechat_request_generation_tokens",
            "Tokens generated by each sample of each request.",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.request_max_num_generation_tokens = Histogram(
            "pagechat_request_max_num_generation_tokens",
            "Tokens generated by each request's longest sample.",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.request_prefill_time = Histogram(
            "pagechat_request_prefill_time_seconds",
            "First scheduled by the engine -> first token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.request_decode_time = Histogram(
            "pagechat_request_decode_time_seconds",
            "First token -> last token of each request.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.request_success = Counter(
            "pagechat_request_success",
            "Finished samples by vLLM's finish reasons: stop, length, abort (every other end).",
            ["finished_reason"],
            registry=r,
        )
        self.e2e_latency = Histogram(
            "pagechat_e2e_request_latency_seconds",
            "User message received -> answer finished and stored.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "pagechat_request_queue_time_seconds",
            "User message received -> first scheduled by the engine.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.event_loop_lag = Histogram(
            "pagechat_event_loop_lag_seconds",
            "How late the event loop woke a sleeping probe task.",
            buckets=_LAG_BUCKETS,
            registry=r,
        )
        self.open_connections = Gauge(
            "pagechat_open_connections", "Open /v1/chat WebSockets.", registry=r
        )
        self.inflight_turns = Gauge(
            "pagechat_inflight_turns", "Answers queued or streaming.", registry=r
        )
        self.turns = Counter(
            "pagechat_turns", "Finished answers, by finish reason.", ["finish_reason"], registry=r
        )
        self.errors = Counter(
            "pagechat_errors",
            "Errors sent (frames and HTTP bodies), by code.",
            ["code"],
            registry=r,
        )
        self.sessions_opened = Counter(
            "pagechat_sessions_opened", "Sessions created or resumed.", ["how"], registry=r
        )
        self.engine_info = Gauge(
            "pagechat_engine_info",
            "1, labelled by how the engine computes: its weights, activation and KV cache"
            " dtypes, and the CPU kernels' version (empty where none run).",
            ["weights", "activation_dtype", "kv_cache_dtype", "cpu_kernels"],
            registry=r,
        )
        r.register(_EngineCollector(engine_stats))
        # The process's memory, CPU time and open files, the interpreter and its GC, under
        # the names every exporter gives them (process_resident_memory_bytes, ...), as the
        # default registry (which this one replaces) would have them.
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        self._exposed = _ModelNamed(r, model_name)

    def describe_engine(self, precision: EnginePrecision) -> None:
        self.engine_info.labels(
            weights=precision.weights,
            activation_dtype=precision.activation_dtype,
            kv_cache_dtype=precision.kv_cache_dtype or precision.activation_dtype,
            cpu_kernels=precision.cpu_kernels,
        ).set(1)

    def render(self) -> bytes:
        return generate_latest(self._exposed)
