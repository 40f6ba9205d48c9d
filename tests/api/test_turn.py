"""Where a turn's prompt comes from: stored token ids, the template, or (for a page map
written for another model) the stored text."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from service.api.turn import Turn
from service.engine.params import SamplingParams
from service.sessions.models import Message, PageMap, Role, SessionMeta
from service.sessions.prompt import ChatFormat
from tests.tiny_model import gguf_tokenizer

HISTORY = [
    Message(role=Role.USER, content="Hi", created=0.0),
    Message(role=Role.ASSISTANT, content="Hello!", created=0.0, finish_reason="stop"),
]


class _Store:
    async def messages(self, session_id: str) -> list[Message]:
        return HISTORY


@pytest.fixture(scope="module")
def fmt() -> ChatFormat:
    return ChatFormat(gguf_tokenizer())


def turn(fmt: ChatFormat) -> Turn:
    service: Any = SimpleNamespace(chat_format=fmt, model_id="model-a", store=_Store())
    return Turn(service, "sid", "Again", SamplingParams(), received=0.0, send=None)  # type: ignore[arg-type]


def meta(turns: int, system: str | None = None) -> SessionMeta:
    return SessionMeta(
        session_id="sid",
        created=0.0,
        updated=0.0,
        owner="r",
        model_id="model-a",
        system=system,
        turns=turns,
    )


def page_map(model_id: str) -> PageMap:
    return PageMap(
        token_ids=[7, 8, 9],
        block_size=16,
        block_hashes=[],
        tiers=[],
        namespace=model_id + "|",
        model_id=model_id,
        replica="r",
        updated=0.0,
    )


async def test_the_first_turn_renders_the_template_with_the_system_prompt(
    fmt: ChatFormat,
) -> None:
    prompt = await turn(fmt)._prompt(meta(0, system="Be brief."), None)
    assert prompt == fmt.first_prompt("Be brief.", "Again")


async def test_later_turns_extend_the_stored_token_ids(fmt: ChatFormat) -> None:
    prompt = await turn(fmt)._prompt(meta(1), page_map("model-a"))
    assert prompt == [7, 8, 9, *fmt.user_turn("Again")]


async def test_a_page_map_of_another_model_falls_back_to_the_stored_text(
    fmt: ChatFormat,
) -> None:
    prompt = await turn(fmt)._prompt(meta(1), page_map("model-b"))
    assert prompt == fmt.render(None, HISTORY, "Again")
