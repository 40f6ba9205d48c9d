"""instructor's `Mode.TOOLS`, unchanged, against a real `pagechat serve` on the bundled model:
a response model with a nested model and an enum (pydantic writes them as `$defs` and `$ref`s
and says nothing of `additionalProperties`; instructor sends it as a tool forced by name)
parses ten times in ten, and a forced call cut by `max_tokens` is instructor's
incomplete-output error, never a model parsed from `content`.

`max_retries=0` throughout: a call instructor could not parse would otherwise be asked again
with the error in the prompt, and a failure hidden behind a second try."""

from __future__ import annotations

import concurrent.futures
import enum
import json
from collections.abc import Iterator
from typing import Any

import instructor
import openai
import pydantic
import pytest
from instructor.core import IncompleteOutputException

from tests.api.server import ServerProcess, running_server

pytestmark = [
    pytest.mark.server,
    pytest.mark.real_model,
    pytest.mark.timeout(300),
    pytest.mark.usefixtures("balanced"),
]

CITIES = ("Oslo", "Paris", "Lima", "Cairo", "Tokyo", "Quito", "Rome", "Perth", "Dakar", "Hanoi")


class Unit(enum.Enum):
    CELSIUS = "celsius"
    FAHRENHEIT = "fahrenheit"


class Town(pydantic.BaseModel):
    # Bounded strings: sampled at temperature 1.0, a free string may run until max_tokens.
    name: str = pydantic.Field(max_length=30)
    country: str = pydantic.Field(max_length=30)


class Forecast(pydantic.BaseModel):
    """The forecast for a town."""

    town: Town
    unit: Unit
    days: int = pydantic.Field(ge=1, le=7)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, prefix: str) -> Iterator[ServerProcess]:
    with running_server(
        tmp_path_factory.mktemp("instructor"),
        *("--dtype", "float32", "--max-model-len", "2048", "--served-model-name", "pagechat"),
        prefix=prefix,
    ) as server:
        yield server


@pytest.fixture
def client(server: ServerProcess) -> Iterator[instructor.Instructor]:
    with openai.OpenAI(base_url=server.http + "/v1", api_key="none", max_retries=0) as raw:
        yield instructor.from_openai(raw, mode=instructor.Mode.TOOLS)


def test_mode_tools_parses_a_nested_model_and_an_enum_ten_times_in_ten(
    client: instructor.Instructor,
) -> None:
    schema = json.dumps(Forecast.model_json_schema())
    assert "$defs" in schema and "additionalProperties" not in schema  # as instructor sends it

    def ask(seed: int, city: str) -> tuple[Forecast, Any]:
        return client.chat.completions.create_with_completion(
            model="pagechat", response_model=Forecast, max_retries=0,
            messages=[{"role": "user", "content": f"Forecast for {city}?"}],
            temperature=1.0, seed=seed, max_tokens=120,
        )  # fmt: skip

    # All ten at once, as one batch: each is still parsed by instructor and checked on its own.
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(CITIES)) as pool:
        answers = list(pool.map(ask, range(len(CITIES)), CITIES))
    parsed = []
    for forecast, completion in answers:
        choice = completion.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        assert isinstance(forecast.town, Town) and isinstance(forecast.unit, Unit)
        parsed.append(forecast)
    assert len(parsed) == 10


@pytest.mark.parametrize("max_tokens", [1, 4, 11, 24])
def test_a_forced_call_cut_by_max_tokens_is_an_incomplete_output_error(
    client: instructor.Instructor, max_tokens: int
) -> None:
    with pytest.raises(IncompleteOutputException) as caught:
        client.chat.completions.create(
            model="pagechat", response_model=Forecast, max_retries=0,
            messages=[{"role": "user", "content": "Forecast for Oslo?"}],
            temperature=1.0, seed=max_tokens, max_tokens=max_tokens,
        )  # fmt: skip
    choice = caught.value.last_completion.choices[0]
    assert choice.finish_reason == "length", choice
    assert choice.message.content is None and not choice.message.tool_calls, choice
