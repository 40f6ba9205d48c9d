"""Structured output and tool calls against a real `pagechat serve` on the bundled model, as
apps and agent frameworks use them: the official SDK (`parse()` with a pydantic model,
json_object, vLLM's structured_outputs on both routes, calls whole and streamed, a tool result
sent back), the WebSocket `user` frame's response_format, a schema that cannot be constrained
refused with a 400 naming it, langchain-openai (`with_structured_output` in its three methods,
a `bind_tools` agent loop of two calls and a final answer) and litellm (`tools`).

The bundled model is too small to choose a tool by itself (`tool_choice: auto`), so the loops
name their choice ("required", then plain text); what is tested is that every call parses, its
arguments match their schema, and the history of calls and results goes back in."""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import json
import os
from collections.abc import Iterator
from typing import Any, Literal

import jsonschema
import openai
import pydantic
import pytest

from clients.chat_client import ChatClient, ChatServerError
from protocol.frames import JsonSchemaFormat, ResponseFormat
from tests.api.server import ServerProcess, running_server

pytestmark = [
    pytest.mark.server,
    pytest.mark.real_model,
    pytest.mark.timeout(300),
    pytest.mark.usefixtures("balanced"),
]


class City(pydantic.BaseModel):
    """Bounded fields, as a schema sampled at temperature 1.0 needs (benchmarks/json_schemas.py
    says why): a free string or fraction may run until max_tokens."""

    name: str = pydantic.Field(max_length=40)
    country: str = pydantic.Field(max_length=40)
    population_millions: float = pydantic.Field(ge=0, le=100, multiple_of=0.5)
    river: str | None = pydantic.Field(max_length=40)
    size: Literal["small", "medium", "large"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, prefix: str) -> Iterator[ServerProcess]:
    with running_server(
        tmp_path_factory.mktemp("structured"),
        *("--dtype", "float32", "--max-model-len", "2048", "--served-model-name", "pagechat"),
        prefix=prefix,
    ) as server:
        yield server


@pytest.fixture
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.http + "/v1", api_key="none", max_retries=0) as client:
        yield client


def test_the_sdks_parse_returns_the_pydantic_object(client: openai.OpenAI) -> None:
    completion = client.chat.completions.parse(
        model="pagechat",
        messages=[{"role": "user", "content": "Describe Paris as a city record."}],
        response_format=City,
        temperature=0.0,
        max_tokens=200,
    )
    message = completion.choices[0].message
    assert isinstance(message.parsed, City), message.content
    assert completion.choices[0].finish_reason == "stop"
    assert City.model_validate_json(message.content or "") == message.parsed


def test_sampled_answers_match_the_schema_streamed_or_whole(client: openai.OpenAI) -> None:
    schema = City.model_json_schema()
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "city", "schema": schema, "strict": True},
    }
    messages = [{"role": "user", "content": "Describe a city you like."}]
    whole = client.chat.completions.create(
        model="pagechat", messages=messages, response_format=response_format,  # type: ignore[arg-type]
        temperature=1.0, n=3, seed=5, max_tokens=200,
    )  # fmt: skip
    for choice in whole.choices:
        jsonschema.validate(json.loads(choice.message.content or ""), schema)
    stream = client.chat.completions.create(
        model="pagechat", messages=messages, response_format=response_format,  # type: ignore[arg-type]
        temperature=1.0, seed=9, max_tokens=200, stream=True,
    )  # fmt: skip
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), schema)


def test_json_object_answers_are_objects(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(
        model="pagechat",
        messages=[{"role": "user", "content": "Give the capital of France as JSON."}],
        response_format={"type": "json_object"},
        temperature=0.0,
        max_tokens=120,
    )
    assert isinstance(json.loads(answer.choices[0].message.content or ""), dict)


def test_vllms_structured_outputs_on_chat_and_text_completions(client: openai.OpenAI) -> None:
    choice = client.chat.completions.create(
        model="pagechat",
        messages=[{"role": "user", "content": "Is Paris in France?"}],
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
        temperature=1.0,
    )
    assert choice.choices[0].message.content in {"yes", "no"}
    text = client.completions.create(
        model="pagechat",
        prompt="The year the Eiffel Tower opened:",
        extra_body={"structured_outputs": {"regex": r" [0-9]{4}"}},
        temperature=1.0,
        max_tokens=10,
    )
    assert len(text.choices[0].text) == 5 and text.choices[0].text[1:].isdigit()
    guided = client.completions.create(
        model="pagechat",
        prompt="Answer yes or no. Is water wet?",
        extra_body={"guided_choice": ["yes", "no"]},
        max_tokens=5,
    )
    assert guided.choices[0].text in {"yes", "no"}


def test_a_schema_that_cannot_be_constrained_is_a_400_naming_it(client: openai.OpenAI) -> None:
    unique = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="pagechat",
            messages=[{"role": "user", "content": "Numbers?"}],
            response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": unique}},
        )
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == "response_format", error
    assert "uniqueItems" in error["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(
            model="pagechat", prompt="x", extra_body={"structured_outputs": {"regex": "[a-"}}
        )
    assert isinstance(caught.value.body, dict)
    assert caught.value.body["param"] == "structured_outputs.regex"


async def test_the_websocket_user_frame_takes_response_format(server: ServerProcess) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}, "year": {"type": "integer"}},
        "required": ["city", "year"],
        "additionalProperties": False,
    }
    response_format = ResponseFormat(
        type="json_schema", json_schema=JsonSchemaFormat(name="x", schema=schema)
    )
    async with await ChatClient.connect(server.ws) as chat:
        await chat.open()
        answer = await chat.ask(
            "Name a city and a year.", temperature=1.0, seed=2, response_format=response_format
        )
        jsonschema.validate(json.loads(answer.text), schema)
        assert answer.finish_reason == "stop"
        bad = ResponseFormat(
            type="json_schema", json_schema=JsonSchemaFormat(schema={"not": {"type": "null"}})
        )
        with pytest.raises(ChatServerError) as caught:
            await chat.ask("Again.", response_format=bad)
        assert caught.value.frame.code == "invalid_params" and "not" in caught.value.frame.message
        # The session goes on: a free answer after the refusal.
        again = await chat.ask("Say hello.", temperature=0.0, max_tokens=8)
        assert again.text
    await asyncio.sleep(0)


# ---------------------------------------------------------------------- tools

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


class Unit(enum.Enum):
    CELSIUS = "celsius"
    FAHRENHEIT = "fahrenheit"


class Town(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=30)
    country: str = pydantic.Field(max_length=30)


class Forecast(pydantic.BaseModel):
    """A nested model and an enum: pydantic writes them as $defs and $refs, as instructor's
    Mode.TOOLS sends them (test_instructor.py sends them through instructor itself)."""

    town: Town
    unit: Unit
    days: int = pydantic.Field(ge=1, le=7)


@pytest.mark.parametrize("choice", ["required", "named"])
def test_tools_with_defs_and_refs_are_called_ten_times_in_ten(
    client: openai.OpenAI, choice: str
) -> None:
    tool = openai.pydantic_function_tool(Forecast)
    assert "$defs" in json.dumps(tool)  # what broke: refs resolved against the call grammar
    named = {"type": "function", "function": {"name": "Forecast"}}
    tool_choice: Any = "required" if choice == "required" else named

    def ask(seed: int) -> Any:
        return client.chat.completions.create(
            model="pagechat", messages=[{"role": "user", "content": "Forecast for Oslo?"}],
            tools=[tool], tool_choice=tool_choice, parallel_tool_calls=False,
            temperature=1.0, seed=seed, max_tokens=120,
        )  # fmt: skip

    # All ten at once, as one batch: each is still parsed and checked on its own.
    with concurrent.futures.ThreadPoolExecutor(max_workers=10) as pool:
        answers = list(pool.map(ask, range(10)))
    assert len(answers) == 10
    for answer in answers:
        choice_ = answer.choices[0]
        assert choice_.finish_reason == "tool_calls", choice_
        (call,) = choice_.message.tool_calls or []
        assert call.type == "function" and call.function.name == "Forecast"
        Forecast.model_validate_json(call.function.arguments)
        assert "\n" not in call.function.arguments and "  " not in call.function.arguments


def test_tools_with_defs_and_refs_under_auto_are_offered_and_read(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(
        model="pagechat", messages=[{"role": "user", "content": "Forecast for Oslo?"}],
        tools=[openai.pydantic_function_tool(Forecast)], temperature=0.0, max_tokens=60,
    )  # fmt: skip
    message = answer.choices[0].message
    for call in message.tool_calls or []:  # the bundled model rarely calls by itself
        Forecast.model_validate_json(call.function.arguments)
    assert message.content or message.tool_calls


def test_a_tool_parameters_refusal_names_the_tool_and_shows_no_call_grammar(
    client: openai.OpenAI,
) -> None:
    unique = {"type": "object", "properties": {"ids": {"type": "array", "uniqueItems": True}}}
    bad = {"type": "function", "function": {"name": "ids", "parameters": unique}}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="pagechat", messages=ASK, tools=[*TOOLS, bad], tool_choice="required"
        )
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == "tools[2].function.parameters", error
    assert "uniqueItems" in error["message"]
    for inside in ("<tool_call>", "%json", "start:", "None:"):
        assert inside not in error["message"], error


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_cut_by_max_tokens_is_never_content(
    client: openai.OpenAI, stream: bool
) -> None:
    for max_tokens in (1, 2, 4, 7, 11, 16, 24):
        kwargs: Any = dict(
            model="pagechat", messages=ASK, tools=TOOLS, max_tokens=max_tokens,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            temperature=1.0, seed=max_tokens,
        )  # fmt: skip
        if not stream:
            choice = client.chat.completions.create(**kwargs).choices[0]
            assert choice.finish_reason == "length", choice
            assert choice.message.content is None and not choice.message.tool_calls, choice
            continue
        reasons, content, calls = [], "", []
        for chunk in client.chat.completions.create(**kwargs, stream=True):
            for delta in chunk.choices:
                content += delta.delta.content or ""
                calls += delta.delta.tool_calls or []
                if delta.finish_reason:
                    reasons.append(delta.finish_reason)
        assert reasons == ["length"] and content == "" and not calls, (max_tokens, content)
