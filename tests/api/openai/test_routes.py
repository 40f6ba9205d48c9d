"""The OpenAI-compatible endpoints against a real `pagechat serve`: /v1/models, and
/v1/chat/completions whole and streamed (SSE), with every refusal in OpenAI's error shape,
served model names, CORS and log-probabilities."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.api.server import ServerProcess, running_server, wait_balanced
from tests.tiny_model import gguf_tokenizer

pytestmark = [
    pytest.mark.server,
    pytest.mark.real_model,
    pytest.mark.timeout(180),
    pytest.mark.usefixtures("balanced"),
]

MAX_MODEL_LEN = 256
BODY_LIMIT = 65536
BODY_TIMEOUT_S = 2
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
NAMES = ("smol", "gpt-4o-mini")  # --served-model-name: the first listed
APP_ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_server(
        tmp_path_factory.mktemp("server"),
        *("--dtype", "float32"),
        *("--num-device-blocks", "64", "--num-cpu-blocks", "64"),
        *("--max-model-len", str(MAX_MODEL_LEN), "--max-tokens", "128"),
        *("--default-max-tokens", "64"),
        *("--max-inflight-turns", "1", "--max-body-bytes", str(BODY_LIMIT)),
        *("--body-timeout-s", str(BODY_TIMEOUT_S)),
        *("--served-model-name", ",".join(NAMES), "--cors-allowed-origins", APP_ORIGIN),
    ) as server:
        yield server


def post(
    server: ServerProcess, body: bytes | dict[str, Any], path: str = "/v1/chat/completions"
) -> tuple[int, dict[str, Any]]:
    status, _, result = post_with_headers(server, body, path)
    return status, result


def post_with_headers(
    server: ServerProcess, body: bytes | dict[str, Any], path: str = "/v1/chat/completions"
) -> tuple[int, dict[str, str], dict[str, Any]]:
    """Status, headers (lower-case names) and the JSON body of one POST."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    try:
        conn.request("POST", path, data, {"content-type": "application/json"})
        response = conn.getresponse()
        headers = {k.lower(): v for k, v in response.getheaders()}
        return response.status, headers, json.loads(response.read())
    finally:
        conn.close()


def stream(
    server: ServerProcess, body: dict[str, Any], path: str = "/v1/chat/completions"
) -> list[str]:
    """The SSE `data:` payloads of a streamed completion, in order."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    try:
        conn.request("POST", path, json.dumps({**body, "stream": True}))
        response = conn.getresponse()
        assert response.status == 200
        assert response.getheader("content-type", "").startswith("text/event-stream")
        events = []
        for line in response:
            if line.startswith(b"data: "):
                events.append(line[6:].decode().strip())
        return events
    finally:
        conn.close()


def request(
    server: ServerProcess, method: str, path: str, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.request(method, path, headers=headers or {})
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def test_models_lists_the_first_served_name_and_retrieves_each(server: ServerProcess) -> None:
    status, body = server.get("/v1/models")
    assert status == 200
    (model,) = json.loads(body)["data"]
    assert (model["object"], model["id"]) == ("model", NAMES[0])
    assert 0 < time.time() - model["created"] < 3600  # when this server started
    for name in NAMES:
        status, body = server.get(f"/v1/models/{name}")
        assert (status, json.loads(body)["id"]) == (200, name)
    status, body = server.get("/v1/models/gpt-5")
    assert status == 404
    assert json.loads(body)["error"]["code"] == "model_not_found"


def test_an_answer_names_the_model_as_it_was_asked_for(server: ServerProcess) -> None:
    for asked, named in [(None, NAMES[0]), (NAMES[1], NAMES[1])]:
        body = {"messages": FRANCE, "max_tokens": 1, "model": asked}
        status, result = post(server, body)
        assert (status, result["model"]) == (200, named)


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("GET", "/v1/nope", 404),
        ("POST", "/v1/completions/x", 404),
        ("GET", "/v1/chat/completions", 405),
    ],
)
def test_unknown_routes_under_v1_answer_in_openais_shape(
    server: ServerProcess, method: str, path: str, status: int
) -> None:
    got, headers, body = request(server, method, path)
    assert got == status
    assert headers["content-type"] == "application/json"
    error = json.loads(body)["error"]
    assert error["code"] in ("not_found", "method_not_allowed") and path in error["message"]


def test_cors_answers_a_preflight_from_an_allowed_origin_only(server: ServerProcess) -> None:
    preflight = {
        "access-control-request-method": "POST",
        "access-control-request-headers": "authorization, content-type, x-stainless-os",
    }
    status, headers, _ = request(
        server, "OPTIONS", "/v1/chat/completions", {"origin": APP_ORIGIN, **preflight}
    )
    assert status == 200
    assert headers["access-control-allow-origin"] == APP_ORIGIN
    assert "x-stainless-os" in headers["access-control-allow-headers"].lower()
    status, headers, _ = request(server, "GET", "/v1/models", {"origin": APP_ORIGIN})
    assert headers["access-control-allow-origin"] == APP_ORIGIN
    status, headers, _ = request(
        server, "OPTIONS", "/v1/chat/completions", {"origin": "https://evil.example", **preflight}
    )
    assert status == 400 and "access-control-allow-origin" not in headers


def test_a_completion_answers_and_a_repeat_hits_the_prefix_cache(server: ServerProcess) -> None:
    status, first = post(server, {"messages": FRANCE, "temperature": 0, "max_tokens": 16})
    assert status == 200, first
    (choice,) = first["choices"]
    assert choice["message"]["role"] == "assistant"
    assert "Paris" in choice["message"]["content"]
    assert choice["finish_reason"] == "stop"
    usage = first["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    status, second = post(server, {"messages": FRANCE, "temperature": 0, "max_tokens": 16})
    assert status == 200
    # The same prompt again: its full blocks come from the cache.
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16


def test_a_stream_sends_the_role_then_deltas_then_the_finish_usage_and_done(
    server: ServerProcess,
) -> None:
    events = stream(
        server,
        {
            "messages": FRANCE,
            "max_completion_tokens": 6,
            "stream_options": {"include_usage": True},
        },
    )
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [c["choices"][0] for c in chunks[1:-1]]
    assert "".join(d["delta"].get("content", "") for d in deltas).strip()
    assert deltas[-1]["finish_reason"] in ("stop", "length")
    assert all(d["finish_reason"] is None for d in deltas[:-1])
    usage = chunks[-1]
    assert usage["choices"] == [] and 1 <= usage["usage"]["completion_tokens"] <= 6


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(server: ServerProcess) -> None:
    """vLLM's stream_options.continuous_usage_stats, as vLLM's own clients send it."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {"messages": FRANCE, "max_tokens": 5, "n": 2, "ignore_eos": True}
    chunks = [json.loads(e) for e in stream(server, {**body, "stream_options": options})[:-1]]
    assert all("usage" in c for c in chunks)
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts[0] == 0 and counts == sorted(counts) and counts[-1] == 2 * 5
    assert {c["usage"]["prompt_tokens"] for c in chunks} == {chunks[-1]["usage"]["prompt_tokens"]}
    assert chunks[-1]["choices"] == []  # the final usage chunk, as without the option
    # Without include_usage it asks for nothing, as in vLLM.
    alone = stream(server, {**body, "stream_options": {"continuous_usage_stats": True}})
    assert not any("usage" in json.loads(e) for e in alone[:-1])


def test_logprobs_come_per_token_with_the_top_alternatives(server: ServerProcess) -> None:
    body = {"messages": FRANCE, "max_tokens": 4, "temperature": 0, "logprobs": True}
    status, result = post(server, {**body, "top_logprobs": 3})
    assert status == 200, result
    (choice,) = result["choices"]
    entries = choice["logprobs"]["content"]
    assert len(entries) == result["usage"]["completion_tokens"]
    assert "".join(e["token"] for e in entries) == choice["message"]["content"]
    for entry in entries:
        assert len(entry["top_logprobs"]) == 3
        # Greedy: the chosen token is the most likely one.
        assert entry["top_logprobs"][0]["token"] == entry["token"]
        assert entry["logprob"] == pytest.approx(entry["top_logprobs"][0]["logprob"])
        assert bytes(entry["bytes"]).decode() == entry["token"]
    events = stream(server, body)
    streamed = [json.loads(e)["choices"] for e in events[:-1]]
    tokens = [e for c in streamed if c and c[0]["logprobs"] for e in c[0]["logprobs"]["content"]]
    assert [e["token"] for e in tokens] == [e["token"] for e in entries]
    assert all(e["top_logprobs"] == [] for e in tokens)


def test_logprobs_end_with_the_answers_last_token_not_the_end_of_turn(
    server: ServerProcess,
) -> None:
    """The <|im_end|> that ends an answer is no part of it: no entry, whole or streamed (as
    OpenAI's); the usage still counts it, as the model generated it."""
    body = {"messages": FRANCE, "max_tokens": 64, "temperature": 0, "logprobs": True}
    status, result = post(server, body)
    assert status == 200, result
    (choice,) = result["choices"]
    assert choice["finish_reason"] == "stop"
    entries = choice["logprobs"]["content"]
    assert "".join(e["token"] for e in entries) == choice["message"]["content"]
    assert "<|im_end|>" not in [e["token"] for e in entries]
    assert len(entries) == result["usage"]["completion_tokens"] - 1
    chunks = [json.loads(e)["choices"] for e in stream(server, body)[:-1]]
    streamed = [e for c in chunks if c and c[0]["logprobs"] for e in c[0]["logprobs"]["content"]]
    assert [e["token"] for e in streamed] == [e["token"] for e in entries]
    assert chunks[-1][0]["finish_reason"] == "stop"
    # A text completion's legacy logprobs, ended by a stop token id ("."): the same rule.
    text_body = {"prompt": "The capital of France is", "max_tokens": 64, "temperature": 0}
    text_body |= {"logprobs": 0, "stop_token_ids": [30]}
    status, text = post(server, text_body, "/v1/completions")
    assert status == 200, text
    (choice,) = text["choices"]
    assert choice["finish_reason"] == "stop" and "Paris" in choice["text"]
    assert "".join(choice["logprobs"]["tokens"]) == choice["text"]
    assert len(choice["logprobs"]["tokens"]) == text["usage"]["completion_tokens"] - 1


def test_logit_bias_steers_the_answer(server: ServerProcess) -> None:
    rome = gguf_tokenizer().encode(" Rome")
    assert len(rome) == 1
    body = {"messages": FRANCE, "max_tokens": 2, "temperature": 0}
    status, result = post(server, {**body, "logit_bias": {str(rome[0]): 100}})
    assert status == 200, result
    assert result["choices"][0]["message"]["content"] == " Rome Rome"


def test_a_final_assistant_message_is_continued(server: ServerProcess) -> None:
    begun = "The capital of France is"
    body = {"messages": [*FRANCE, {"role": "assistant", "content": begun}], "temperature": 0}
    status, result = post(server, {**body, "max_tokens": 4})
    assert status == 200, result
    # Only what follows the given start comes back.
    assert "Paris" in result["choices"][0]["message"]["content"]
    assert not result["choices"][0]["message"]["content"].startswith(begun)


def test_a_text_completion_continues_the_prompt_whole_and_streamed(
    server: ServerProcess,
) -> None:
    body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    status, result = post(server, {**body, "logprobs": 2}, "/v1/completions")
    assert status == 200, result
    assert result["object"] == "text_completion" and result["id"].startswith("cmpl-")
    (choice,) = result["choices"]
    assert "Paris" in choice["text"] and choice["finish_reason"] == "length"
    logprobs = choice["logprobs"]
    assert "".join(logprobs["tokens"]) == choice["text"]
    assert logprobs["text_offset"][0] == 0 and len(logprobs["top_logprobs"][0]) == 2
    assert result["usage"]["completion_tokens"] == 4
    events = stream(server, {**body, "stream_options": {"include_usage": True}}, "/v1/completions")
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"text_completion"}
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == choice["text"]
    assert chunks[-1]["usage"]["completion_tokens"] == 4
    status, refused = post(server, {**body, "echo": True}, "/v1/completions")
    assert (status, refused["error"]["param"]) == (400, "echo")


def test_n_samples_get_a_choice_each(server: ServerProcess) -> None:
    body = {"messages": FRANCE, "n": 3, "seed": 7, "max_tokens": 5}
    status, result = post(server, body)
    assert status == 200, result
    assert [c["index"] for c in result["choices"]] == [0, 1, 2]
    assert all(c["finish_reason"] in ("stop", "length") for c in result["choices"])
    assert result["usage"]["completion_tokens"] <= 15


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (b"{not json", 400, "bad_request"),
        ({"messages": FRANCE, "tools": [{"type": "function"}]}, 400, "invalid_value"),
        ({"messages": FRANCE, "functions": [{"name": "f"}]}, 400, "unsupported_parameter"),
        ({"messages": FRANCE, "no_such_field": 1}, 400, "bad_request"),
        ({"messages": []}, 400, "invalid_value"),
        ({"messages": [{"role": "function", "content": "x"}]}, 400, "invalid_value"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "text": ""}]}]},
            400,
            "invalid_value",
        ),
        ({"messages": FRANCE, "model": "gpt-4o"}, 404, "model_not_found"),
        ({"messages": FRANCE, "max_tokens": 129}, 400, "invalid_value"),
        ({"messages": FRANCE, "temperature": -1}, 400, "invalid_value"),
        ({"messages": FRANCE, "presence_penalty": 2.5}, 400, "invalid_value"),
        ({"messages": FRANCE, "response_format": {"type": "structural_tag"}}, 400, "invalid_value"),
        (
            {"messages": FRANCE, "structured_outputs": {"regex": "[unclosed"}},
            400,
            "invalid_value",
        ),
        (  # the prompt fits, the prompt and the answer asked for do not
            {"messages": [{"role": "user", "content": "river " * 150}], "max_tokens": 128},
            400,
            "context_length_exceeded",
        ),
        (
            {"messages": [{"role": "user", "content": "river " * 300}]},
            400,
            "context_length_exceeded",
        ),
        ({"messages": [{"role": "user", "content": "x" * BODY_LIMIT}]}, 413, "request_too_large"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_bad_requests_get_openai_shaped_errors(
    server: ServerProcess, body: bytes | dict[str, Any], status: int, code: str
) -> None:
    got, result = post(server, body)
    assert got == status, result
    error = result["error"]
    assert error["code"] == code
    assert error["message"] and error["type"] == "invalid_request_error"


def test_the_room_rule_an_explicit_max_tokens_is_refused_the_default_fills_the_room(
    server: ServerProcess,
) -> None:
    """NOTE (room) in service/api/sampling.py, as tests/api/ws/test_chat.py checks it on the
    WebSocket: a max_tokens the context cannot hold after the prompt is a 400 naming the
    field as sent, never a shorter answer; left out, the answer may fill the room left."""
    messages = [{"role": "user", "content": "river " * 200}]
    for field in ("max_tokens", "max_completion_tokens"):
        status, result = post(server, {"messages": messages, field: 100})
        assert status == 400, result
        error = result["error"]
        assert (error["code"], error["param"]) == ("context_length_exceeded", field)
    status, result = post(server, {"messages": messages, "ignore_eos": True, "temperature": 0})
    assert status == 200, result
    usage = result["usage"]
    room = MAX_MODEL_LEN - usage["prompt_tokens"]
    assert 0 < room < 64  # under --default-max-tokens: the room left is the bound
    assert usage["completion_tokens"] == room
    assert result["choices"][0]["finish_reason"] == "length"


def _post_head(server: ServerProcess, content_length: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {content_length}\r\n\r\n".encode()
        + b'{"messages": ['
    )
    return sock


def test_a_body_that_stops_arriving_gets_a_408_and_its_connection_closed(
    server: ServerProcess,
) -> None:
    """A Content-Length the body never reaches: `--body-timeout-s` after the headers, a 408
    in OpenAI's shape, and the connection closed (the rest of the body is never read)."""
    with _post_head(server, 500) as sock:
        reply = b""
        while chunk := sock.recv(65536):  # until the server closes the connection
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), head
    assert b"connection: close" in head.lower()
    error = json.loads(body)["error"]
    assert error["code"] == "request_timeout" and f"{BODY_TIMEOUT_S} s" in error["message"]


def test_a_client_leaving_mid_body_is_one_log_line_not_a_traceback(server: ServerProcess) -> None:
    before = server.log().count("the client left before its body ended")
    for _ in range(3):
        _post_head(server, 500).close()
    deadline = time.monotonic() + 30
    while server.log().count("the client left before its body ended") < before + 3:
        assert time.monotonic() < deadline, server.log()[-3000:]
        time.sleep(0.1)
    assert "ClientDisconnect" not in server.log()
    assert server.get("/health")[0] == 200


async def test_a_client_leaving_a_stream_stops_it_and_frees_its_blocks(
    server: ServerProcess,
) -> None:
    body = {"messages": FRANCE, "max_tokens": 128, "stream": True}
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    data = json.dumps(body).encode()
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        + f"content-length: {len(data)}\r\n\r\n".encode()
        + data
    )
    await writer.drain()
    while b'"content"' not in await reader.readline():  # the first token has come
        pass
    before = (await server.astats())["engine"]["tokens_generated"]
    writer.close()
    stats = await wait_balanced(server, timeout=2.0)
    assert stats["engine"]["tokens_generated"] - before < 100  # stopped well short of 128


async def test_a_request_over_the_inflight_limit_is_told_to_retry(server: ServerProcess) -> None:
    body = {"messages": FRANCE, "max_tokens": 64, "stream": True}
    first = asyncio.create_task(asyncio.to_thread(stream, server, body))
    while (await server.astats())["queue"]["inflight_turns"] == 0:
        await asyncio.sleep(0.01)
    status, headers, result = await asyncio.to_thread(
        post_with_headers, server, {"messages": FRANCE}
    )
    assert status == 429
    assert result["error"]["code"] == "overloaded"
    assert result["error"]["type"] == "requests"  # OpenAI's type for its rate limits
    assert headers["retry-after"] == "1"
    assert (await first)[-1] == "[DONE]"


def test_answers_and_refusals_are_counted_in_the_metrics(server: ServerProcess) -> None:
    series = (
        ("pagechat_turns_total", {"finish_reason": "length", "model_name": NAMES[0]}),
        ("pagechat_errors_total", {"code": "model_not_found"}),
        ("pagechat_time_to_first_token_seconds_count", {}),
    )
    before = [server.metric(name, **labels) for name, labels in series]
    body = {"messages": FRANCE, "max_tokens": 2, "n": 2, "seed": 1, "temperature": 0.5}
    assert post(server, body)[0] == 200
    assert post(server, {"messages": FRANCE, "model": "nope"})[0] == 404
    turns, errors, first_tokens = (
        server.metric(name, **labels) - b for (name, labels), b in zip(series, before, strict=True)
    )
    assert turns == 2  # two samples, each cut at max_tokens
    assert errors == 1
    assert first_tokens == 1  # one request, one time to first token
