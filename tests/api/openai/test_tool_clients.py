"""Tool calls and structured output as apps and agent frameworks use them, against a real
`pagechat serve` on the bundled model: the official SDK (calls whole and streamed, a tool
result sent back), langchain-openai (`with_structured_output` in its three methods, a
`bind_tools` agent loop of two calls and a final answer) and litellm (`tools`).

The bundled model is too small to choose a tool by itself (`tool_choice: auto`), so the loops
name their choice ("required", then plain text); what is tested is that every call parses, its
arguments match their schema, and the history of calls and results goes back in."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pydantic
import pytest

from tests.api.server import ServerProcess, running_server

pytestmark = [
    pytest.mark.server,
    pytest.mark.real_model,
    pytest.mark.timeout(300),
    pytest.mark.usefixtures("balanced"),
]

WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": WEATHER_PARAMS,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The local time in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 40}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
]
ASK: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, prefix: str) -> Iterator[ServerProcess]:
    with running_server(
        tmp_path_factory.mktemp("tools"),
        *("--dtype", "float32", "--max-model-len", "2048", "--served-model-name", "pagechat"),
        prefix=prefix,
    ) as server:
        yield server


@pytest.fixture
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.http + "/v1", api_key="none", max_retries=0) as client:
        yield client


def test_a_required_call_parses_and_its_result_goes_back(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(
        model="pagechat", messages=ASK, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, temperature=1.0, seed=4, max_tokens=120,
    )  # fmt: skip
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.id.startswith("call_")
    schema = {"get_weather": WEATHER_PARAMS, "get_time": TOOLS[1]["function"]["parameters"]}
    jsonschema.validate(json.loads(call.function.arguments), schema[call.function.name])
    history = [
        *ASK,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"},
    ]
    final = client.chat.completions.create(
        model="pagechat", messages=history, tools=TOOLS, temperature=0.0, max_tokens=40
    )
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls


def test_a_named_call_streams_as_tool_call_deltas(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="pagechat", messages=ASK, tools=TOOLS, max_tokens=80, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )  # fmt: skip
    calls: dict[int, dict[str, str]] = {}
    reasons = []
    for chunk in stream:
        for choice in chunk.choices:
            assert not choice.delta.content  # a named call is all calls
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                entry["name"] += (delta.function and delta.function.name) or ""
                entry["arguments"] += (delta.function and delta.function.arguments) or ""
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    assert reasons == ["tool_calls"]
    assert [c["name"] for c in calls.values()] == ["get_time"]
    assert json.loads(calls[0]["arguments"])["city"]


class Place(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=40)
    country: str = pydantic.Field(max_length=40)


def chat_model(server: ServerProcess, **options: Any) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        model="pagechat", base_url=server.http + "/v1", api_key="none", max_retries=0,
        temperature=0.0, max_tokens=150, **options,
    )  # fmt: skip


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_langchains_with_structured_output_in_each_method(
    server: ServerProcess, method: str
) -> None:
    """json_mode returns what the answer parses to (langchain does not check it against the
    schema), so its schema is given as a JSON Schema and the answer checked to be an object."""
    model = chat_model(server)
    question = "Name a city in France and its country."
    if method == "json_mode":
        schema = Place.model_json_schema()
        got = model.with_structured_output(schema, method=method).invoke(question)
        assert isinstance(got, dict), got
    else:
        got = model.with_structured_output(Place, method=method).invoke(question)
        assert isinstance(got, Place) and got.city, got


def test_a_langchain_bind_tools_loop_of_two_calls_and_a_final_answer(
    server: ServerProcess,
) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    @tool
    def multiply(a: int, b: int) -> int:
        """Multiply two integers."""
        return a * b

    tools = {"add": add, "multiply": multiply}
    model = chat_model(server)
    calling = model.bind_tools(list(tools.values()), tool_choice="any", parallel_tool_calls=False)
    messages: list[Any] = [HumanMessage("What is 3 plus 4, times 5? Use the tools.")]
    for _ in range(2):
        reply = calling.invoke(messages)
        assert len(reply.tool_calls) == 1, reply
        call = reply.tool_calls[0]
        result = tools[call["name"]].invoke(call["args"])  # the arguments fit the signature
        messages += [reply, ToolMessage(str(result), tool_call_id=call["id"])]
    final = model.bind_tools(list(tools.values())).invoke(messages)
    assert final.content and not final.tool_calls, final


def test_litellm_with_tools(server: ServerProcess) -> None:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch at import
    import litellm

    response = litellm.completion(
        model="openai/pagechat", api_base=server.http + "/v1", api_key="none",
        messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        temperature=0.0, max_tokens=120,
    )  # fmt: skip
    message = response.choices[0].message
    (call,) = message.tool_calls
    assert response.choices[0].finish_reason == "tool_calls"
    assert call.function.name in {"get_weather", "get_time"}
    assert json.loads(call.function.arguments)["city"]
