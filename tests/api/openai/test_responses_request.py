"""A Responses API request as the chat completion it asks for (service/api/openai/responses.py):
items to messages, instructions, function tools and tool_choice, text.format, the fields
refused, and the chat path's errors renamed to the Responses fields they came from."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from service.api.openai.chat_request import decode_request
from service.api.openai.errors import OpenAIError, invalid
from service.api.openai.responses import (
    ResponsesRequest,
    as_responses_error,
    chat_body,
    decode_responses_request,
    input_messages,
)

SERVED = ("tiny",)


def request(**fields: Any) -> ResponsesRequest:
    return decode_responses_request(json.dumps(fields).encode())


def test_text_input_is_one_user_message_and_instructions_a_system_message_first() -> None:
    req = request(input="Hi", instructions="Be brief.", max_output_tokens=9, temperature=0.5)
    body = json.loads(chat_body(req, [], input_messages(req)))
    assert body["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]
    assert body["max_completion_tokens"] == 9 and body["temperature"] == 0.5
    chat = decode_request(json.dumps(body).encode(), SERVED)  # the chat path takes it as is
    assert chat.sampling().max_tokens == 9


def test_items_become_messages_calls_grouped_and_results_as_tool_messages() -> None:
    req = request(
        input=[
            {"role": "developer", "content": [{"type": "input_text", "text": "Rules."}]},
            {"type": "message", "role": "user", "content": "Weather?"},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "function_call", "call_id": "call_a", "name": "f", "arguments": "{}"},
            {"type": "function_call", "call_id": "call_b", "name": "g", "arguments": '{"x":1}'},
            {"type": "function_call_output", "call_id": "call_a", "output": "sunny"},
            {"type": "function_call_output", "call_id": "call_b",
             "output": [{"type": "input_text", "text": "42"}]},
            {"role": "assistant",
             "content": [{"type": "output_text", "text": "It is sunny.", "annotations": []}]},
        ]
    )  # fmt: skip
    messages = input_messages(req)
    assert [m["role"] for m in messages] == ["developer", "user", "assistant", "tool", "tool",
                                             "assistant"]  # fmt: skip
    assert [c["id"] for c in messages[2]["tool_calls"]] == ["call_a", "call_b"]
    assert messages[2]["tool_calls"][1]["function"] == {"name": "g", "arguments": '{"x":1}'}
    assert messages[4] == {"role": "tool", "tool_call_id": "call_b", "content": "42"}
    assert messages[5]["content"] == "It is sunny."
    decode_request(chat_body(req, [], messages), SERVED)


def test_the_history_of_a_previous_response_comes_before_the_new_input() -> None:
    history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    req = request(input="c", instructions="new rules")
    body = json.loads(chat_body(req, history, input_messages(req)))
    # OpenAI's rule: a previous response's instructions are not carried over, the new ones are
    # the first message.
    assert [m["content"] for m in body["messages"]] == ["a", "b", "new rules", "c"]


def test_function_tools_tool_choice_and_text_format_take_their_chat_forms() -> None:
    params = {"type": "object", "properties": {"city": {"type": "string"}}}
    req = request(
        input="x",
        tools=[{"type": "function", "name": "get_weather", "parameters": params, "strict": True}],
        tool_choice={"type": "function", "name": "get_weather"},
        text={"format": {"type": "json_schema", "name": "w", "schema": params, "strict": True}},
    )
    body = json.loads(chat_body(req, [], input_messages(req)))
    assert body["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "parameters": params, "strict": True}}]  # fmt: skip
    assert body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert body["response_format"] == {
        "type": "json_schema", "json_schema": {"name": "w", "schema": params, "strict": True},
    }  # fmt: skip


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "conversation": "conv_1"}, "conversation"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
         "input[0].content[0]"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice"),
        ({}, "input"),
    ],
)  # fmt: skip
def test_what_cannot_be_served_is_refused_naming_its_field(
    fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(OpenAIError) as caught:
        req = request(**fields)
        chat_body(req, [], input_messages(req))
    assert caught.value.status == 400 and caught.value.param == param, caught.value.message


def test_a_field_no_request_has_is_refused_by_name_unless_told_to_ignore_it() -> None:
    with pytest.raises(OpenAIError) as caught:
        decode_responses_request(b'{"input": "x", "max_tokens": 5}')
    assert "max_tokens" in caught.value.message
    req = decode_responses_request(b'{"input": "x", "max_tokens": 5}', ignore_unknown=True)
    assert req.input == "x"


def test_the_chat_paths_errors_name_the_responses_fields() -> None:
    renamed = as_responses_error(invalid("messages[2].content has 9 characters", "messages[2]"))
    assert (renamed.param, renamed.message) == ("input[2]", "input[2].content has 9 characters")
    assert as_responses_error(invalid("bad", "response_format")).param == "text.format"
    assert as_responses_error(invalid("bad", "max_completion_tokens")).param == (
        "max_output_tokens"
    )
    assert as_responses_error(invalid("bad", "temperature")).param == "temperature"


def test_every_field_of_the_request_is_declared() -> None:
    # The SDK's fields the server knows: a new one must be honoured, ignored or refused
    # deliberately, never dropped by accident.
    fields = {f.name for f in msgspec.structs.fields(ResponsesRequest)}
    sdk = {"model", "input", "instructions", "previous_response_id", "store", "stream",
           "max_output_tokens", "temperature", "top_p", "tools", "tool_choice",
           "parallel_tool_calls", "text", "metadata", "user", "truncation", "reasoning",
           "include", "background", "conversation", "prompt", "max_tool_calls",
           "service_tier", "safety_identifier", "prompt_cache_key", "top_logprobs",
           "stream_options", "prompt_cache_retention"}  # fmt: skip
    assert sdk <= fields
