"""Structured output against a real `pagechat serve` on the bundled model: the official SDK's
`parse()` with a pydantic model, json_object, vLLM's structured_outputs on both routes, the
WebSocket `user` frame's response_format, and a schema that cannot be constrained refused
with a 400 naming it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Literal

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
    pytest.mark.timeout(240),
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
        *("--dtype", "float32", "--max-model-len", "1024", "--served-model-name", "pagechat"),
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
