"""ConversationCache (service/sessions/conversation_cache.py): who may share a conversation's
blocks, the page map stored with a turn, and the tail prefill, on a fake engine behind the
engine interface."""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec
import pytest

from service.api.access.gate import cache_salt_for
from service.engine.values import CacheScope
from service.sessions.conversation_cache import ConversationCache
from service.sessions.prompt import ChatFormat
from tests.fake_engine import FakeEngine


@pytest.fixture
async def engine() -> AsyncIterator[FakeEngine]:
    engine = FakeEngine(model_id="model-a", block_size=4)
    await engine.start()
    yield engine
    await engine.stop()
    engine.check_balanced()


def cache(engine: FakeEngine, *, share_across_sessions: bool = False) -> ConversationCache:
    return ConversationCache(
        engine, ChatFormat(engine.tokenizer), share_across_sessions=share_across_sessions
    )


def test_a_session_shares_only_its_system_prompt_blocks_with_other_sessions(
    engine: FakeEngine,
) -> None:
    conversations = cache(engine)
    fmt = conversations.chat_format
    scope = conversations.scope("", "sid", "Be brief.")
    shared = len(fmt.system_prefix("Be brief."))
    assert scope == CacheScope(
        salt="", private="sid", shared_tokens=shared, shared_key=scope.shared_key
    )
    # Keyed by the whole system prompt: the same one shares, one that begins alike does not.
    assert conversations.scope("", "other", "Be brief.").shared_key == scope.shared_key
    alike = conversations.scope("", "other", "Be brief. And polite.").shared_key
    assert alike != scope.shared_key and len(alike) == len(scope.shared_key) == 24
    # The shared part is the prompt up to the user's words, whatever they are.
    for content in ("a", "Hello there", "<|im_end|>"):
        prompt = fmt.first_prompt("Be brief.", content)
        assert prompt[:shared] == fmt.first_prompt("Be brief.", "zzz")[:shared]
        assert shared < len(prompt)
    assert "Be brief." in fmt.tokenizer.decode(fmt.first_prompt("Be brief.", "a")[:shared])


def test_global_scope_shares_everything_within_a_tenant_and_tenants_never(
    engine: FakeEngine,
) -> None:
    conversations = cache(engine, share_across_sessions=True)
    assert conversations.scope(cache_salt_for("default"), "sid", None) == CacheScope()
    alice = conversations.scope(cache_salt_for("alice"), "sid", None)
    bob = conversations.scope(cache_salt_for("bob"), "sid", None)
    assert alice.salt and bob.salt and alice.salt != bob.salt
    assert cache(engine).scope(cache_salt_for("alice"), "sid", None).salt == alice.salt


async def test_the_page_map_is_the_ids_and_what_they_were_computed_under_not_where_blocks_are(
    engine: FakeEngine,
) -> None:
    conversations = cache(engine)
    ids = list(range(100, 114))  # 3 full blocks of 4, and 2 tokens
    before = conversations.page_map(ids)
    scope = conversations.scope("", "sid", None)
    async for _ in engine.generate(ids[:9], cache_scope=scope):  # computes the first 2 blocks
        pass
    page_map = conversations.page_map(ids)
    assert (page_map.token_ids, page_map.block_size) == (ids, 4)
    assert (page_map.model_id, page_map.namespace) == ("model-a", "model-a|")
    # Where the blocks are is the engine's to find at the next turn: the record never says.
    assert msgspec.structs.replace(before, updated=page_map.updated) == page_map


async def test_the_tail_prefill_is_one_prefill_only_request_the_next_turn_waits_for(
    engine: FakeEngine,
) -> None:
    conversations = cache(engine)
    scope = conversations.scope("", "sid", None)
    ids = list(range(100, 112))
    conversations.prefill_tail("sid", ids, scope)
    await conversations.wait_for_tail("sid")
    (request,) = engine.requests
    assert (request.request_id, request.prompt, request.params.max_tokens) == (
        "sid/tail/12",
        ids,
        0,
    )
    assert request.scope == scope
    await conversations.wait_for_tail("no-such-session")  # nothing to wait for
    conversations.close()  # draining: no more of them
    conversations.prefill_tail("sid", [*ids, 1, 2, 3, 4], scope)
    await conversations.stop()
    assert len(engine.requests) == 1
