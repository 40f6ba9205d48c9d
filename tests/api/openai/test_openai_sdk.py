"""The official `openai` SDK, unchanged, against a real `pagechat serve` (the tiny model, API
keys on): sync and async clients, whole and streamed answers, the `stream()` helper,
`model_dump()` history, nulls, n > 1, logprobs, `models.retrieve()`, and every error as the
SDK's own class. Last, an app written as the SDK's docs write one runs three turns."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from typing import Any

import openai
import pytest

from tests.api.server import ServerProcess, is_idle, running_server
from tests.tiny_model import make_tiny_llama

pytestmark = [pytest.mark.server, pytest.mark.timeout(240)]

KEY = "sk-sdk-test-0123456789abcdef"
NAMES = ("tiny-llama", "gpt-4o-mini")  # --served-model-name: an app's own model name works
HI: list[Any] = [{"role": "user", "content": "Hello there"}]
_addresses = itertools.count(1)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    directory = tmp_path_factory.mktemp("sdk")
    model = make_tiny_llama(directory / "model")
    keys = directory / "keys"
    keys.write_text(f"{KEY} sdk-tenant admin\n")
    with running_server(
        directory,
        *("--model", str(model), "--dtype", "float32", "--max-model-len", "512"),
        *("--default-max-tokens", "8", "--api-keys-file", str(keys)),
        # Each client below speaks from an address of its own (X-Forwarded-For), so that
        # the failed-key test's refusals stay its own.
        *("--trusted-proxies", "127.0.0.1"),
        *("--served-model-name", ",".join(NAMES)),
    ) as server:
        yield server


@pytest.fixture(autouse=True)
async def balanced(server: ServerProcess) -> AsyncIterator[None]:
    yield
    await asyncio.to_thread(wait_idle, server)


def wait_idle(server: ServerProcess, timeout: float = 10.0) -> None:
    """Wait until no request holds a block or a slot (the stats need the admin key)."""
    deadline = time.monotonic() + timeout
    while True:
        request = urllib.request.Request(
            server.http + "/v1/stats", headers={"authorization": f"Bearer {KEY}"}
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            stats = json.loads(response.read())
        if is_idle(stats):
            return
        assert time.monotonic() < deadline, f"the server is not idle: {stats}"
        time.sleep(0.05)


def _options(server: ServerProcess, key: str) -> dict[str, Any]:
    return {
        "base_url": server.http + "/v1",
        "api_key": key,
        "max_retries": 0,  # a refusal is the test's to see, not the SDK's to retry
        "default_headers": {"x-forwarded-for": f"10.7.{next(_addresses) % 250}.1"},
    }


@pytest.fixture
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(**_options(server, KEY)) as client:
        yield client


@pytest.fixture
async def aclient(server: ServerProcess) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(**_options(server, KEY)) as client:
        yield client


def test_models_are_listed_and_retrieved_by_any_served_name(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [NAMES[0]]
    for name in NAMES:
        assert client.models.retrieve(name).id == name
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-5")
    assert missing.value.code == "model_not_found"


def test_a_whole_answer_parses_into_the_sdks_types(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(model=NAMES[1], messages=HI, max_tokens=5)
    assert completion.object == "chat.completion" and completion.model == NAMES[1]
    (choice,) = completion.choices
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert completion.usage is not None
    assert 1 <= completion.usage.completion_tokens <= 5
    assert completion.usage.total_tokens == (
        completion.usage.prompt_tokens + completion.usage.completion_tokens
    )


def test_a_stream_yields_chunks_then_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=NAMES[0],
        messages=HI,
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True, "include_obfuscation": False},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] in ("stop", "length") and not any(finishes[:-1])
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert usage.completion_tokens >= 1 and text is not None


def stop_within(client: openai.OpenAI) -> str:
    """A stop string the greedy answer to HI holds (the tiny model's answers run to their
    max_tokens, and the `stream()` helper takes a "length" finish for an error)."""
    answer = client.chat.completions.create(
        model=NAMES[0], messages=HI, max_tokens=8, temperature=0
    )
    text = answer.choices[0].message.content or ""
    assert len(text.strip()) >= 2, text
    return text.strip()[-2:]


def test_the_stream_helper_gathers_the_final_completion(client: openai.OpenAI) -> None:
    pieces = []
    greedy: dict[str, Any] = {"temperature": 0, "max_tokens": 8, "stop": stop_within(client)}
    with client.chat.completions.stream(model=NAMES[0], messages=HI, **greedy) as stream:
        for event in stream:
            if event.type == "content.delta":
                pieces.append(event.delta)
        final = stream.get_final_completion()
    assert final.choices[0].message.content == "".join(pieces)
    assert final.choices[0].finish_reason == "stop"


def test_model_dump_history_and_explicit_nulls_are_taken(client: openai.OpenAI) -> None:
    messages: list[Any] = list(HI)
    first = client.chat.completions.create(model=NAMES[0], messages=messages, max_tokens=4)
    # The SDK's own message, as it dumps it: refusal, tool_calls, audio... all null.
    messages.append(first.choices[0].message.model_dump())
    messages.append({"role": "user", "content": "And then?"})
    second = client.chat.completions.create(
        model=NAMES[0],
        messages=messages,
        max_tokens=4,
        temperature=None,
        top_p=None,
        n=None,
        stop=None,
        seed=None,
        presence_penalty=None,
        frequency_penalty=None,
        logprobs=None,
        top_logprobs=None,
        logit_bias=None,
        response_format={"type": "text"},
        metadata={"app": "test"},
        store=False,
        user="someone",
        parallel_tool_calls=None,
        service_tier=None,
        tools=None,
        tool_choice=None,
    )
    assert second.choices[0].message.content is not None
    # More of the conversation came from the prefix cache the second time.
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details.cached_tokens > 0


def test_n_samples_and_logprobs(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(
        model=NAMES[0], messages=HI, max_tokens=3, n=3, seed=5, logprobs=True, top_logprobs=2
    )
    assert [c.index for c in completion.choices] == [0, 1, 2]
    for choice in completion.choices:
        assert choice.logprobs is not None and choice.logprobs.content is not None
        entries = choice.logprobs.content
        if not any("\ufffd" in e.token for e in entries):  # no character split in two
            assert "".join(e.token for e in entries) == choice.message.content
        assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in entries)


def test_text_completions_whole_and_streamed(client: openai.OpenAI) -> None:
    whole = client.completions.create(
        model=NAMES[0], prompt="Once upon a time", max_tokens=5, temperature=0, logprobs=1
    )
    (choice,) = whole.choices
    assert choice.logprobs is not None and choice.logprobs.tokens is not None
    assert "".join(choice.logprobs.tokens) == choice.text
    assert whole.usage is not None and whole.usage.completion_tokens == 5
    stream = client.completions.create(
        model=NAMES[0], prompt="Once upon a time", max_tokens=5, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == choice.text


def test_vllms_sampling_fields_go_through_extra_body(client: openai.OpenAI) -> None:
    extra = {"top_k": 5, "ignore_eos": True, "min_tokens": 0, "repetition_penalty": 1.0}
    completion = client.chat.completions.create(
        model=NAMES[0], messages=HI, max_tokens=7, extra_body=extra
    )
    assert completion.usage is not None and completion.usage.completion_tokens == 7
    assert completion.choices[0].finish_reason == "length"  # no stop at EOS


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {"tools": [{"type": "function", "function": {"name": "no spaces"}}]},
            "tools[0].function.name",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}},
                }
            },
            "response_format",
        ),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"extra_body": {"min_p": 2}}, "min_p"),
        ({"extra_body": {"no_such_field": 1}}, "no_such_field"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_what_cannot_be_honoured_is_a_bad_request_naming_the_field(
    client: openai.OpenAI, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=NAMES[0], messages=HI, **extra)
    assert refused.value.param == param


def test_errors_come_as_the_sdks_classes(server: ServerProcess, client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-5", messages=HI)
    with pytest.raises(openai.NotFoundError):  # an unknown route, in OpenAI's shape too
        client.get("/no/such/route", cast_to=object)
    with (
        openai.OpenAI(**_options(server, "sk-wrong-0123456789abcdef")) as stranger,
        pytest.raises(openai.AuthenticationError) as unauthorized,
    ):
        stranger.models.list()
    assert unauthorized.value.code == "invalid_api_key"


def test_cors_is_off_by_default(server: ServerProcess) -> None:
    preflight = urllib.request.Request(
        server.http + "/v1/chat/completions",
        method="OPTIONS",
        headers={"origin": "https://app.example", "access-control-request-method": "POST"},
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(preflight, timeout=10)
    with refused.value as response:
        assert response.code == 405
        assert response.headers.get("access-control-allow-origin") is None


def test_guessing_keys_is_a_rate_limit_error_with_retry_after(server: ServerProcess) -> None:
    with openai.OpenAI(**_options(server, "sk-guess-0123456789abcdef")) as guesser:
        for _ in range(6):  # five free failures, then refusals
            with pytest.raises(openai.AuthenticationError):
                guesser.models.list()
        with pytest.raises(openai.RateLimitError) as refused:
            guesser.models.list()
    assert refused.value.response.headers["retry-after"].isdigit()


async def test_the_async_client_answers_whole_and_streamed_at_once(
    aclient: openai.AsyncOpenAI,
) -> None:
    async def whole() -> str:
        completion = await aclient.chat.completions.create(
            model=NAMES[0], messages=HI, max_tokens=5
        )
        return completion.choices[0].message.content or ""

    async def streamed() -> str:
        stream = await aclient.chat.completions.create(
            model=NAMES[0], messages=HI, max_tokens=5, stream=True
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    answers = await asyncio.gather(whole(), streamed(), whole(), streamed())
    assert all(isinstance(a, str) for a in answers)
    # The helper's own "length" finish error, with what was generated, as with OpenAI.
    with pytest.raises(openai.LengthFinishReasonError) as cut:
        async with aclient.chat.completions.stream(
            model=NAMES[0], messages=HI, max_tokens=4
        ) as stream:
            await stream.get_final_completion()
    assert cut.value.completion.choices[0].finish_reason == "length"


# ---------------------------------------------------------------------- an unchanged app


def chat_app(
    client: openai.OpenAI,
    questions: list[str],
    *,
    model: str = "gpt-4o-mini",
    temperature: float | None = None,
    top_p: float | None = None,
    max_tokens: int | None = None,
    seed: int | None = None,
    stop: str | None = None,
) -> list[str]:
    """A small chat app as the SDK's docs write one: a history of messages, each answer's
    message appended as the SDK dumps it, every optional parameter passed through as is."""
    messages: list[Any] = [{"role": "system", "content": "You are a helpful assistant."}]
    answers = []
    for question in questions:
        messages.append({"role": "user", "content": question})
        response = client.chat.completions.create(
            model=model,
            messages=messages,
            temperature=temperature,
            top_p=top_p,
            max_tokens=max_tokens,
            seed=seed,
            stop=stop,
            n=None,
            presence_penalty=None,
            frequency_penalty=None,
            logprobs=None,
            user=None,
        )
        message = response.choices[0].message
        messages.append(message.model_dump())
        answers.append(message.content or "")
    return answers


def test_an_app_written_against_the_sdk_runs_three_turns_unchanged(
    client: openai.OpenAI,
) -> None:
    answers = chat_app(client, ["Hi!", "What can you do?", "Thanks, bye."])
    assert len(answers) == 3 and all(isinstance(a, str) for a in answers)
