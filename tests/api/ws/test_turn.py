"""One turn (service/api/ws/turn.py) in-process: a fake engine behind the engine interface and
the real Redis on 127.0.0.1:6379. Where its prompt comes from (stored token ids, the
template, or, for a page map of another model, the stored text), what it sends, stores and
leaves the engine doing afterwards."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from protocol.frames import Delta, Done, ErrorCode, FinishReason, FrameError, ServerFrame
from service.api.limits import Limits
from service.api.observability.metrics import Metrics
from service.api.sampling import AskedSampling
from service.api.ws.turn import Turn
from service.sessions.conversation_cache import ConversationCache
from service.sessions.models import Message, PageMap, Role, SessionMeta
from service.sessions.prompt import ChatFormat
from service.sessions.redis_server import connect
from service.sessions.store import SessionStore
from tests.api.server import REDIS_URL, delete_prefix, unique_prefix
from tests.fake_engine import ANSWER, FakeEngine

HISTORY = [
    Message(role=Role.USER, content="Hi", created=0.0),
    Message(role=Role.ASSISTANT, content="Hello!", created=0.0, finish_reason="stop"),
]


@pytest.fixture
async def store() -> AsyncIterator[SessionStore]:
    prefix = unique_prefix()
    store = SessionStore(connect(REDIS_URL), prefix=prefix, ttl_s=600, replica="replica-a")
    yield store
    await store.close()
    delete_prefix(prefix)


@pytest.fixture
async def engine() -> AsyncIterator[FakeEngine]:
    engine = FakeEngine(model_id="model-a")
    await engine.start()
    yield engine
    await engine.stop()
    engine.check_balanced()


@pytest.fixture
def conversations(engine: FakeEngine) -> ConversationCache:
    return ConversationCache(engine, ChatFormat(engine.tokenizer))


class Client:
    """What a connection would have sent."""

    def __init__(self) -> None:
        self.frames: list[ServerFrame] = []

    async def send(self, frame: ServerFrame) -> None:
        self.frames.append(frame)


def turn(
    engine: FakeEngine,
    conversations: ConversationCache,
    store: SessionStore,
    session_id: str = "sid-0001",
    *,
    content: str = "Again",
    client: Client | None = None,
    asked: AskedSampling | None = None,
) -> Turn:
    return Turn(
        engine,
        conversations,
        Metrics(engine.stats, lambda: engine.model_id),
        store,
        "default",
        session_id,
        content,
        asked or AskedSampling(),
        limits=Limits(default_max_tokens=64),
        received=0.0,
        send=(client or Client()).send,
    )


def meta(turns: int, system: str | None = None) -> SessionMeta:
    return SessionMeta(
        session_id="sid-0001",
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
        block_size=4,
        namespace=model_id + "|",
        model_id=model_id,
        updated=0.0,
    )


async def test_the_first_turn_renders_the_template_with_the_system_prompt(
    engine: FakeEngine, conversations: ConversationCache, store: SessionStore
) -> None:
    prompt = await turn(engine, conversations, store)._prompt(meta(0, system="Be brief."), None)
    assert prompt == conversations.chat_format.first_prompt("Be brief.", "Again")


async def test_later_turns_extend_the_stored_token_ids(
    engine: FakeEngine, conversations: ConversationCache, store: SessionStore
) -> None:
    prompt = await turn(engine, conversations, store)._prompt(meta(1), page_map("model-a"))
    assert prompt == [7, 8, 9, *conversations.chat_format.user_turn("Again")]


async def test_a_page_map_of_another_model_falls_back_to_the_stored_text(
    engine: FakeEngine, conversations: ConversationCache, store: SessionStore
) -> None:
    session_id = (await store.create(model_id="model-b", system=None)).meta.session_id
    lease = await store.begin_turn(session_id)
    await store.append_turn(lease, HISTORY, page_map("model-b"))
    await store.end_turn(lease)
    prompt = await turn(engine, conversations, store, session_id)._prompt(
        meta(1), page_map("model-b")
    )
    assert prompt == conversations.chat_format.render(None, HISTORY, "Again")


async def test_a_turn_streams_stores_its_page_map_and_then_prefills_the_tail(
    engine: FakeEngine, conversations: ConversationCache, store: SessionStore
) -> None:
    """The answer goes out as deltas, then `done`; the stored ids are the prompt, the answer
    and the end of the turn, their full blocks on the device; and a second, prefill-only
    request computes the stored conversation's tail, named after the session."""
    session_id = (await store.create(model_id="model-a", system=None)).meta.session_id
    client = Client()
    await turn(engine, conversations, store, session_id, client=client).run()
    *deltas, done = client.frames
    assert all(isinstance(d, Delta) for d in deltas)
    assert "".join(d.text for d in deltas if isinstance(d, Delta)) == ANSWER
    assert isinstance(done, Done) and done.finish_reason is FinishReason.STOP
    assert done.usage.completion_tokens == len(engine.answer_ids)

    stored_meta, stored = await store.load(session_id)
    assert stored is not None
    chat_format = conversations.chat_format
    prompt = chat_format.first_prompt(None, "Again")
    answer = engine.answer_ids
    assert stored.token_ids == prompt + answer + chat_format.close_turn(answer)
    assert (stored.model_id, stored.namespace, stored.block_size) == ("model-a", "model-a|", 4)
    assert stored_meta.owner == "replica-a"  # the replica that served it: the session's

    await conversations.wait_for_tail(session_id)
    first, tail = engine.requests
    assert first.request_id == f"{session_id}/0"
    assert tail.request_id == f"{session_id}/tail/{len(stored.token_ids)}"
    assert (tail.prompt, tail.params.max_tokens, tail.scope) == (
        stored.token_ids,
        0,
        first.scope,
    )
    # Only the stored conversation's blocks are offered to the third tier, not the turn's own.
    assert (first.persist, tail.persist) == (False, True)
    # The next turn finds every full block of the stored conversation cached.
    assert engine.cached(stored.token_ids, tail.scope) == [True] * (len(stored.token_ids) // 4)


async def test_a_prompt_past_the_context_is_refused_and_nothing_is_stored(
    engine: FakeEngine, conversations: ConversationCache, store: SessionStore
) -> None:
    session_id = (await store.create(model_id="model-a", system=None)).meta.session_id
    long = " ".join(["word"] * engine.limits.max_model_len)
    with pytest.raises(FrameError) as refused:
        await turn(engine, conversations, store, session_id, content=long).run()
    assert refused.value.code is ErrorCode.CONTEXT_LENGTH
    _, stored = await store.load(session_id)
    assert stored is None and engine.requests == []


async def test_the_answer_length_is_clamped_to_what_the_context_has_left(
    engine: FakeEngine, conversations: ConversationCache, store: SessionStore
) -> None:
    """max_tokens 64 (asked, or a default) near the end of the context: the engine is asked
    for no more than the room the prompt leaves, as on every transport."""
    session_id = (await store.create(model_id="model-a", system=None)).meta.session_id
    prompt_len = len(conversations.chat_format.first_prompt(None, "Again"))
    words = engine.limits.max_model_len - prompt_len - 20  # leaves about 20 tokens of room
    content = "Again" + " word" * words
    await turn(engine, conversations, store, session_id, content=content).run()
    (first, *_) = engine.requests
    room = engine.limits.max_model_len - len(first.prompt)
    assert 0 < room < 64
    assert first.params.max_tokens == room


async def test_an_explicit_max_tokens_past_the_room_is_refused_not_shortened(
    engine: FakeEngine, conversations: ConversationCache, store: SessionStore
) -> None:
    """NOTE (room) in service/api/sampling.py: an asked length the context cannot hold is
    refused, as the OpenAI endpoints refuse it; nothing reaches the engine or the store."""
    session_id = (await store.create(model_id="model-a", system=None)).meta.session_id
    prompt_len = len(conversations.chat_format.first_prompt(None, "Again"))
    content = "Again" + " word" * (engine.limits.max_model_len - prompt_len - 20)
    asked = AskedSampling(max_tokens=64)
    with pytest.raises(FrameError) as refused:
        await turn(engine, conversations, store, session_id, content=content, asked=asked).run()
    assert refused.value.code is ErrorCode.CONTEXT_LENGTH
    assert "omit max_tokens for the room left" in str(refused.value)
    _, stored = await store.load(session_id)
    assert stored is None and engine.requests == []
