"""The Responses API against a real `pagechat serve` (the bundled model, Redis on
127.0.0.1:6379): the official SDK's `responses.create`, `.stream`, `.parse`, `.retrieve` and
`.delete`, a function tool's round trip chained by `previous_response_id` (the conversation's
blocks reused), errors in OpenAI's shape, and OpenAI's Agents SDK running an agent with a
function tool through it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Literal

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
WEATHER: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": WEATHER_PARAMS,
    "strict": True,
}


class Town(pydantic.BaseModel):
    """Bounded fields: a sampled free string may run until the token limit."""

    name: str = pydantic.Field(max_length=30)
    size: Literal["small", "medium", "large"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, prefix: str) -> Iterator[ServerProcess]:
    with running_server(
        tmp_path_factory.mktemp("responses"),
        *("--dtype", "float32", "--max-model-len", "2048", "--served-model-name", "pagechat"),
        prefix=prefix,
    ) as server:
        yield server


@pytest.fixture
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.http + "/v1", api_key="none", max_retries=0) as client:
        yield client


def test_create_answers_text_with_its_usage(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model="pagechat", input="What is the capital of France?", temperature=0.0,
        max_output_tokens=24,
    )  # fmt: skip
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status in ("completed", "incomplete")
    assert "Paris" in response.output_text
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant"
    usage = response.usage
    assert usage is not None and 0 < usage.output_tokens <= 24
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens


def test_the_stream_helper_sees_every_event_in_order_and_the_final_response(
    client: openai.OpenAI,
) -> None:
    with client.responses.stream(
        model="pagechat", input="Name three colours.", instructions="Answer in one line.",
        temperature=0.0, max_output_tokens=16,
    ) as stream:  # fmt: skip
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert kinds.index("response.output_item.added") < kinds.index("response.output_text.delta")
    for done in ("response.output_text.done", "response.content_part.done",
                 "response.output_item.done"):  # fmt: skip
        assert kinds.index(done) > kinds.index("response.output_text.delta")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text and final.output_text
    assert final.instructions == "Answer in one line."


def test_a_function_call_round_trip_chained_by_previous_response_id(
    client: openai.OpenAI,
) -> None:
    first = client.responses.create(
        model="pagechat", input="What is the weather in Paris?", tools=[WEATHER],
        tool_choice="required", parallel_tool_calls=False, temperature=1.0,
        max_output_tokens=120, extra_body={"seed": 4},
    )  # fmt: skip
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMS)
    second = client.responses.create(
        model="pagechat", previous_response_id=first.id, tools=[WEATHER],
        input=[{"type": "function_call_output", "call_id": call.call_id,
                "output": "18 degrees, sunny"}],
        temperature=0.0, max_output_tokens=30,
    )  # fmt: skip
    assert second.previous_response_id == first.id
    assert second.output_text and not [i for i in second.output if i.type == "function_call"]
    # The conversation so far was computed by the first response: its blocks serve the second.
    assert second.usage is not None and first.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens >= 16


def test_streamed_function_calls_come_as_items_with_their_arguments(
    client: openai.OpenAI,
) -> None:
    with client.responses.stream(
        model="pagechat", input="Weather in Rome?", tools=[WEATHER], tool_choice="required",
        temperature=1.0, max_output_tokens=120, extra_body={"seed": 7},
    ) as stream:  # fmt: skip
        events = list(stream)
        final = stream.get_final_response()
    (call,) = [item for item in final.output if item.type == "function_call"]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in done] == [call.arguments]
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMS)


def test_parse_returns_the_pydantic_object(client: openai.OpenAI) -> None:
    response = client.responses.parse(
        model="pagechat", input="Describe Lyon as a town record.", text_format=Town,
        temperature=0.0, max_output_tokens=80,
    )  # fmt: skip
    assert isinstance(response.output_parsed, Town), response.output_text
    assert response.text is not None and response.text.format is not None
    assert response.text.format.type == "json_schema"


def test_a_stored_response_is_retrieved_deleted_and_then_unknown(client: openai.OpenAI) -> None:
    response = client.responses.create(model="pagechat", input="Hi", max_output_tokens=4)
    assert client.responses.retrieve(response.id).output_text == response.output_text
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.retrieve(response.id)
    assert caught.value.code == "response_not_found"
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model="pagechat", input="x", previous_response_id=response.id)
    assert caught.value.body["param"] == "previous_response_id"  # type: ignore[index]


def test_a_response_not_stored_cannot_be_chained(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model="pagechat", input="Hi", max_output_tokens=4, store=False
    )
    assert response.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


def test_errors_come_in_openais_shape_naming_the_field(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(
            model="pagechat",
            input="x",
            tools=[{"type": "web_search"}],  # type: ignore[list-item]
        )
    assert caught.value.body["param"] == "tools[0].type"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="pagechat", input="word " * 3000)
    assert caught.value.code == "context_length_exceeded"
    assert caught.value.body["param"] == "input"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="another-model", input="x")


async def test_the_agents_sdk_runs_an_agent_with_a_function_tool(server: ServerProcess) -> None:
    agents = pytest.importorskip("agents")  # openai-agents: a dev dependency
    from agents import Agent, ModelSettings, Runner, function_tool
    from agents.models.openai_responses import OpenAIResponsesModel

    agents.set_tracing_disabled(True)  # no exporter: nothing leaves this machine
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"18 degrees and sunny in {city}"

    async with openai.AsyncOpenAI(
        base_url=server.http + "/v1", api_key="none", max_retries=0
    ) as client:
        agent = Agent(
            name="weather",
            instructions="Answer questions about the weather; call get_weather first.",
            tools=[get_weather],
            # Required for the first turn (the SDK resets it after a tool call), so that the
            # bundled model calls the tool whatever it would choose; one call (left parallel, the
            # small model calls it again and again).
            model_settings=ModelSettings(
                tool_choice="required", parallel_tool_calls=False, temperature=0.0, max_tokens=200
            ),
            model=OpenAIResponsesModel(model="pagechat", openai_client=client),
        )
        result = await Runner.run(agent, "What is the weather in Paris?", max_turns=4)
    assert len(calls) == 1 and calls[0]
    assert isinstance(result.final_output, str) and result.final_output
