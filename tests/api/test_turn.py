"""Where a turn's prompt comes from: stored token ids, the template, or (for a page map
written for another model) the stored text."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from service.api.turn import Turn
from service.engine.blocks import CacheScope
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


def turn(fmt: ChatFormat, *, tenant: str = "default", scope: str = "session") -> Turn:
    config = SimpleNamespace(prefix_cache_scope=scope)
    service: Any = SimpleNamespace(chat_format=fmt, model_id="model-a", config=config)
    store: Any = _Store()
    return Turn(
        service,
        store,
        tenant,
        "sid",
        "Again",
        SamplingParams(),
        received=0.0,
        send=None,  # type: ignore[arg-type]
    )


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


def test_a_session_shares_only_its_system_prompt_blocks_with_other_sessions(
    fmt: ChatFormat,
) -> None:
    scope = turn(fmt)._cache_scope(meta(0, system="Be brief."))
    shared = fmt.system_prefix_len("Be brief.")
    assert scope == CacheScope(salt="", private="sid", shared_tokens=shared)
    # The shared part is the prompt up to the user's words, whatever they are.
    for content in ("a", "Hello there", "<|im_end|>"):
        prompt = fmt.first_prompt("Be brief.", content)
        assert prompt[:shared] == fmt.first_prompt("Be brief.", "zzz")[:shared]
        assert shared < len(prompt)
    assert "Be brief." in fmt.tokenizer.decode(fmt.first_prompt("Be brief.", "a")[:shared])


def test_global_scope_shares_everything_within_a_tenant_and_tenants_never(
    fmt: ChatFormat,
) -> None:
    assert turn(fmt, scope="global")._cache_scope(meta(0)) == CacheScope()
    alice = turn(fmt, tenant="alice", scope="global")._cache_scope(meta(0))
    bob = turn(fmt, tenant="bob", scope="global")._cache_scope(meta(0))
    assert alice.salt and bob.salt and alice.salt != bob.salt
    assert turn(fmt, tenant="alice")._cache_scope(meta(0)).salt == alice.salt
