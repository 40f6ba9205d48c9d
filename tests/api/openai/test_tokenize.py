"""vLLM's /tokenize and /detokenize against a real `pagechat serve` (the bundled model, API
keys on): a conversation's token ids are its chat completion's prompt, and come back as the
model's chat prompt; a prompt's as /v1/completions reads it; every refusal in OpenAI's
error shape."""

from __future__ import annotations

import asyncio
import http.client
import json
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from tests.api.server import ServerProcess, is_idle, running_server
from tests.tiny_model import gguf_tokenizer

pytestmark = [pytest.mark.server, pytest.mark.real_model, pytest.mark.timeout(180)]

KEY = "sk-tokenize-0123456789abcdef"
NAME = "smol"
MAX_MODEL_LEN = 256
CHAT = [
    {"role": "system", "content": "You are a geography teacher."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    directory = tmp_path_factory.mktemp("tokenize")
    keys = directory / "keys"
    keys.write_text(f"{KEY} tokenize-tenant admin\n")
    with running_server(
        directory,
        *("--dtype", "float32", "--num-device-blocks", "32", "--num-cpu-blocks", "16"),
        *("--max-model-len", str(MAX_MODEL_LEN), "--default-max-tokens", "8"),
        *("--api-keys-file", str(keys), "--served-model-name", NAME),
    ) as server:
        yield server


@pytest.fixture(autouse=True)
async def balanced(server: ServerProcess) -> AsyncIterator[None]:
    yield
    await asyncio.to_thread(_wait_balanced, server)


def _wait_balanced(server: ServerProcess, timeout: float = 10.0) -> None:
    """Every pool's blocks add up and none is held (the stats need the admin key)."""
    deadline = time.monotonic() + timeout
    while True:
        status, stats = post(server, None, "/v1/stats", method="GET")
        assert status == 200, stats
        for pool in (stats["kv"]["device"], stats["kv"]["cpu"]):
            assert pool["free"] + pool["cached"] + pool["in_use"] == pool["total"], stats
        if is_idle(stats):
            return
        assert time.monotonic() < deadline, f"the server is not idle: {stats}"
        time.sleep(0.05)


def post(
    server: ServerProcess,
    body: bytes | dict[str, Any] | None,
    path: str,
    *,
    key: str | None = KEY,
    method: str = "POST",
) -> tuple[int, dict[str, Any]]:
    data = body if isinstance(body, bytes | None) else json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    try:
        conn.request(method, path, data, headers)
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def tokenize(server: ServerProcess, **body: Any) -> dict[str, Any]:
    status, result = post(server, body, "/tokenize")
    assert status == 200, result
    return result


def detokenize(server: ServerProcess, tokens: list[int]) -> str:
    status, result = post(server, {"model": NAME, "tokens": tokens}, "/detokenize")
    assert status == 200, result
    text: str = result["prompt"]
    return text


def prompt_tokens(server: ServerProcess, **body: Any) -> int:
    """The prompt's length as the chat completion of `body` counted it."""
    status, result = post(server, {**body, "max_tokens": 1}, "/v1/chat/completions")
    assert status == 200, result
    count: int = result["usage"]["prompt_tokens"]
    return count


def test_a_chat_prompt_round_trips_through_tokenize_and_detokenize(server: ServerProcess) -> None:
    result = tokenize(server, model=NAME, messages=CHAT)
    ids = result["tokens"]
    assert result["count"] == len(ids) == prompt_tokens(server, messages=CHAT)
    assert result["max_model_len"] == MAX_MODEL_LEN and result["token_strs"] is None
    # Back as the model's own chat prompt, its special tokens written out, the assistant's
    # turn opened (as the answer's prompt has it).
    text = detokenize(server, ids)
    assert text == gguf_tokenizer().render_chat(CHAT)
    assert text.startswith("<|im_start|>system\nYou are a geography teacher.<|im_end|>\n")
    assert text.endswith("<|im_start|>user\nAnd of Italy?<|im_end|>\n<|im_start|>assistant\n")
    # Each token's own string in the vocabulary, when asked for.
    named = tokenize(server, messages=CHAT, return_token_strs=True)
    assert named["tokens"] == ids and len(named["token_strs"]) == len(ids)
    assert named["token_strs"][:3] == ["<|im_start|>", "system", "Ċ"]


def test_the_chat_fields_shape_the_prompt_as_a_chat_completion_does(
    server: ServerProcess,
) -> None:
    opened = [*CHAT, {"role": "assistant", "content": "The capital of Italy is"}]
    continued = tokenize(server, messages=opened)["tokens"]
    assert detokenize(server, continued).endswith("assistant\nThe capital of Italy is")
    assert len(continued) == prompt_tokens(server, messages=opened)
    closed = tokenize(server, messages=opened, add_generation_prompt=True)["tokens"]
    assert detokenize(server, closed).endswith("is<|im_end|>\n<|im_start|>assistant\n")
    bare = tokenize(server, messages=CHAT, add_generation_prompt=False)["tokens"]
    assert detokenize(server, bare).endswith("And of Italy?<|im_end|>\n")
    # The tools' signatures in the system message, as the answer's prompt holds them.
    with_tools = tokenize(server, messages=CHAT, tools=[WEATHER])["tokens"]
    assert '"name": "get_weather"' in detokenize(server, with_tools)
    assert len(with_tools) == prompt_tokens(server, messages=CHAT, tools=[WEATHER])
    no_tools = tokenize(server, messages=CHAT, tools=[WEATHER], tool_choice="none")["tokens"]
    assert no_tools == tokenize(server, messages=CHAT)["tokens"]
    # Special-token text in a message is plain text: never a special id.
    end = gguf_tokenizer().token_to_id("<|im_end|>")
    tricky = tokenize(server, messages=[{"role": "user", "content": "<|im_end|>"}])["tokens"]
    plain = tokenize(server, messages=[{"role": "user", "content": "x"}])["tokens"]
    assert tricky.count(end) == plain.count(end)  # the template's own only


def test_a_prompt_is_tokenized_as_a_text_completion_reads_it(server: ServerProcess) -> None:
    text = "The capital of France is Paris. <|im_end|>"
    result = tokenize(server, prompt=text, return_token_strs=True)
    assert result["tokens"] == gguf_tokenizer().encode(text)  # SmolLM2 asks for no BOS
    assert result["count"] == len(result["tokens"]) and result["token_strs"][0] == "The"
    assert tokenize(server, prompt=text, add_special_tokens=False)["tokens"] == result["tokens"]
    assert detokenize(server, result["tokens"]) == text
    status, completion = post(server, {"prompt": text, "max_tokens": 1}, "/v1/completions")
    assert status == 200 and completion["usage"]["prompt_tokens"] == result["count"]
    assert tokenize(server, prompt="") == {
        "count": 0, "max_model_len": MAX_MODEL_LEN, "tokens": [], "token_strs": None,
    }  # fmt: skip
    assert detokenize(server, []) == ""


@pytest.mark.parametrize(
    ("path", "body", "status", "code", "param"),
    [
        ("/tokenize", {"model": "gpt-4o", "prompt": "hi"}, 404, "model_not_found", "model"),
        ("/detokenize", {"model": "gpt-4o", "tokens": [1]}, 404, "model_not_found", "model"),
        ("/detokenize", {"tokens": [1, -1]}, 400, "invalid_value", "tokens"),
        ("/detokenize", {"tokens": [49152]}, 400, "invalid_value", "tokens"),  # the vocabulary's
        ("/detokenize", {"tokens": [1.5]}, 400, "bad_request", "tokens[0]"),
        ("/detokenize", {"tokens": "hello"}, 400, "bad_request", "tokens"),
        ("/detokenize", {}, 400, "bad_request", None),
        ("/detokenize", b"{not json", 400, "bad_request", None),
        ("/tokenize", b"[1, 2]", 400, "bad_request", None),
        ("/tokenize", {"prompt": "hi", "messages": CHAT}, 400, "invalid_value", None),
        ("/tokenize", {}, 400, "invalid_value", None),
        ("/tokenize", {"prompt": "hi", "tools": [WEATHER]}, 400, "invalid_value", "tools"),
        ("/tokenize", {"prompt": "hi", "no_such_field": 1}, 400, "bad_request", "no_such_field"),
        ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, 400, "invalid_value",
         "messages[0].role"),
        ("/tokenize", {"messages": CHAT, "tools": [{"type": "function"}]}, 400, "invalid_value",
         "tools[0]"),
        ("/tokenize", {"messages": CHAT, "add_generation_prompt": True,
                       "continue_final_message": True}, 400, "invalid_value",
         "continue_final_message"),
        ("/tokenize", {"messages": CHAT, "chat_template": "{{ messages }}"}, 400,
         "unsupported_parameter", "chat_template"),
        ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"messages": []}},
         400, "invalid_value", "chat_template_kwargs"),
        # Oversized: over the context in tokens, over the limits in characters or bytes.
        ("/tokenize", {"prompt": "river " * 300}, 400, "context_length_exceeded", "prompt"),
        ("/tokenize", {"messages": [{"role": "user", "content": "river " * 300}]}, 400,
         "context_length_exceeded", "messages"),
        ("/tokenize", {"prompt": "x" * 16_001}, 400, "invalid_value", "prompt"),
        ("/detokenize", {"tokens": [1] * (MAX_MODEL_LEN + 1)}, 400, "context_length_exceeded",
         "tokens"),
        ("/tokenize", {"prompt": "x" * (1024 * 1024)}, 413, "request_too_large", None),
    ],
)  # fmt: skip
def test_bad_requests_get_openai_shaped_errors(
    server: ServerProcess,
    path: str,
    body: bytes | dict[str, Any],
    status: int,
    code: str,
    param: str | None,
) -> None:
    got, result = post(server, body, path)
    assert got == status, result
    error = result["error"]
    assert (error["code"], error["param"], error["type"]) == (code, param, "invalid_request_error")
    assert error["message"]


def test_both_need_a_key_and_take_only_post(server: ServerProcess) -> None:
    for path in ("/tokenize", "/detokenize"):
        status, result = post(server, {"prompt": "hi", "tokens": [1]}, path, key=None)
        assert (status, result["error"]["code"]) == (401, "invalid_api_key")
        status, result = post(server, None, path, method="GET")
        assert (status, result["error"]["code"]) == (405, "method_not_allowed")
