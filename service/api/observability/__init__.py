"""What the server shows of itself.

    stats.py     the /v1/stats document
    kv_view.py   the /v1/kv document (KVView) from the engine's KVSnapshot
    metrics.py   Prometheus metrics (/metrics)
    loop_lag.py  LoopLagMonitor: the event loop's lag, sampled
    meter.py     AnswerMeter: one answer's latencies and outcome, either transport

The numbers themselves come from the engine (`EngineStats`, `KVSnapshot`) and from
`service.api.admission`; nothing here changes what it shows.
"""
