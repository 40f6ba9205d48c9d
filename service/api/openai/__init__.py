"""OpenAI's HTTP API: /v1/chat/completions, /v1/completions, /v1/models; vLLM's /tokenize and
/detokenize (docs/protocol.md).

    routes.py              OpenAIRoutes: parse, admit, answer; the parts it works with
    chat_request.py        the chat completion request: schema, checks, its prompt
    completion_request.py  the text completion request: schema, checks, its prompt
    params.py              OpenAI's sampling fields -> service.api.sampling
    answer.py              one answer, whole or as server-sent events, and its metrics
    tokenize.py            /tokenize and /detokenize: a prompt or conversation as ids, and back
    errors.py              OpenAI's error shape; refusals as HTTP statuses
    sse.py                 EventStream: server-sent events that stop when the client goes

Stateless: a request carries its whole conversation; nothing is stored in Redis.
"""
