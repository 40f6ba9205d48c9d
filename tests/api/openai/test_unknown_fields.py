"""service/api/openai/unknown_fields.py: a body's fields no request has are refused by name
(the default, OpenAI's way), or, with `--unknown-request-fields ignore`, dropped wherever they
sit and named in a throttled warning (vLLM's way)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from service.api.limits import Limits
from service.api.openai import unknown_fields
from service.api.openai.chat_request import decode_request
from service.api.openai.completion_request import decode_completion_request
from service.api.openai.errors import OpenAIError
from service.api.openai.unknown_fields import MAX_IGNORED, ThrottledWarning
from service.server.app import create_app
from service.server.config import ServerConfig
from service.server.hub import Hub
from tests.api.server import REDIS_URL, delete_prefix, unique_prefix
from tests.fake_engine import FakeEngine

SERVED = ("smol",)
HI = [{"role": "user", "content": "Hi"}]
UNKNOWN = {
    "temprature": 0.2,
    "stream_options": {"include_usage": True, "chunk_size": 4},
    "messages": [{"role": "user", "content": "Hi", "mood": "curious"}],
}


@pytest.fixture(autouse=True)
def fresh_throttle(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts with no warning logged within the interval."""
    monkeypatch.setattr(unknown_fields, "IGNORED", ThrottledWarning())


def body(**fields: Any) -> bytes:
    return json.dumps({"messages": HI, **fields}).encode()


def test_an_unknown_field_is_refused_by_name_by_default() -> None:
    for fields, param in [
        ({"temprature": 0.2}, "temprature"),
        ({"stream_options": {"chunk_size": 4}}, "stream_options.chunk_size"),
        ({"messages": [{"role": "user", "mood": "x"}]}, "messages[0].mood"),
    ]:
        with pytest.raises(OpenAIError) as caught:
            decode_request(body(**fields), SERVED)
        assert (caught.value.status, caught.value.param) == (400, param)


def test_ignored_unknown_fields_are_dropped_wherever_they_sit_and_named_in_the_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, "service.api.openai.unknown_fields"):
        req = decode_request(body(**UNKNOWN, temperature=0.5), SERVED, ignore_unknown=True)
    assert req.temperature == 0.5 and req.stream_options is not None
    assert req.stream_options.include_usage is True
    assert req.messages[0].content == "Hi"
    (record,) = caplog.records
    for name in ("'temprature'", "'stream_options.chunk_size'", "'messages[0].mood'"):
        assert name in record.getMessage()


def test_ignoring_refuses_everything_else_as_before() -> None:
    for fields, param in [({"temperature": "hot"}, "temperature"), ({"n": [1]}, "n")]:
        with pytest.raises(OpenAIError) as caught:
            decode_request(body(temprature=1, **fields), SERVED, ignore_unknown=True)
        assert caught.value.param == param
    with pytest.raises(OpenAIError):
        decode_request(b"{not json", SERVED, ignore_unknown=True)
    many = {f"x{i}": 1 for i in range(MAX_IGNORED + 1)}
    with pytest.raises(OpenAIError):
        decode_request(body(**many), SERVED, ignore_unknown=True)


def test_text_completions_ignore_them_too() -> None:
    raw = json.dumps({"prompt": "Once", "echo_back": True}).encode()
    with pytest.raises(OpenAIError):
        decode_completion_request(raw, SERVED)
    assert decode_completion_request(raw, SERVED, ignore_unknown=True).prompt == "Once"


def test_the_warning_is_logged_at_most_once_an_interval_counting_the_rest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    warning = ThrottledWarning(interval_s=60.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, "service.api.openai.unknown_fields"):
        assert warning.warn("first")
        now[0] = 59.0
        assert not warning.warn("held") and not warning.warn("held")
        now[0] = 60.0
        assert warning.warn("next")
    assert [r.getMessage() for r in caplog.records] == [
        "first",
        "next (2 more such requests since the last warning)",
    ]


@pytest.fixture(params=["refuse", "ignore"])
def client(request: pytest.FixtureRequest) -> Iterator[tuple[TestClient, str]]:
    prefix = unique_prefix()
    config = ServerConfig(
        redis_url=REDIS_URL,
        redis_prefix=prefix,
        replica_id="in-process",
        limits=Limits(drain_timeout_s=0),
        unknown_request_fields=request.param,
    )
    try:
        with TestClient(create_app(Hub(config, engine=FakeEngine()))) as test_client:
            yield test_client, request.param
    finally:
        delete_prefix(prefix)


def test_the_server_setting_picks_the_policy(client: tuple[TestClient, str]) -> None:
    test_client, policy = client
    response = test_client.post("/v1/chat/completions", content=body(temprature=0.2))
    if policy == "refuse":
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "temprature"
    else:
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"]


def test_the_setting_takes_only_its_two_values() -> None:
    with pytest.raises(ValueError, match="unknown_request_fields"):
        ServerConfig(unknown_request_fields="pass")
