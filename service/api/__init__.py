"""The transports: how clients reach the engine.

    ws/             /v1/chat, the WebSocket chat protocol (docs/protocol.md): a connection's
                    state machine, one turn's answer, the bounded frame writer
    openai/         OpenAI's HTTP API: /v1/chat/completions, /v1/completions, /v1/models
    access/         who may come in: API keys, tenants, the Origin rule, failed attempts
    observability/  /v1/stats, /v1/kv, /metrics, the event loop's lag, each answer's meter

What the rooms share sits here: `admission` (connections and answers in flight under the
limits), `limits` (what a client may ask for), `refusal` (why the server turns a client away,
in no transport's words) and `sampling` (a client's request as the engine's SamplingParams).

The engine is seen only through `service.engine.serving` (the interface), `.values` and
`.params`; the process that builds and wires everything is `service.server`.
"""
