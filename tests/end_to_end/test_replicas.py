"""Two replicas on one Redis, as behind nginx when the hash ring moves or a client comes
without `?session=`: one session is answered by one replica at a time (the other says `busy`),
and its stored page map never diverges from its messages.

Before: both replicas answered as turn 1, the messages held both exchanges, and the page map
only the one written last, so the model silently stopped seeing part of the transcript.
Also here: a burst of 300 opens and resumes at once is served whole (before: ~150 at once got
`storage_unavailable: Too many connections` from the server's own Redis pool).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from clients.chat_client import Answer, ChatClient, ChatServerError
from service.sessions.models import Message, PageMap
from tests.api.server import (
    REDIS_URL,
    ServerProcess,
    delete_prefix,
    start_server,
    stored_session,
    unique_prefix,
    wait_balanced,
)
from tests.tiny_model import gguf_tokenizer, make_tiny_llama

pytestmark = [pytest.mark.server, pytest.mark.timeout(300)]

ROUNDS = 8
SYSTEM = "You are terse."


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ServerProcess]]:
    directory = tmp_path_factory.mktemp("replicas")
    model = make_tiny_llama(directory / "tiny")
    prefix = unique_prefix()
    servers: list[ServerProcess] = []
    try:
        for name in ("a", "b"):
            servers.append(
                start_server(
                    directory / f"{name}.log",
                    *("--model", str(model), "--dtype", "float32", "--replica-id", name),
                    *("--redis-url", REDIS_URL, "--redis-prefix", prefix),
                )
            )
        yield servers
    finally:
        codes = [server.stop() for server in servers]
        delete_prefix(prefix)
    assert codes == [0] * len(servers), [server.log() for server in servers]


def _stored(prefix: str, session_id: str) -> tuple[list[Message], PageMap]:
    messages, page_map = stored_session(prefix, session_id)
    assert page_map is not None
    return messages, page_map


def _prefix_of(server: ServerProcess) -> str:
    args = server.proc.args
    assert isinstance(args, list)
    return str(args[args.index("--redis-prefix") + 1])


async def _ask(chat: ChatClient, content: str) -> Answer | ChatServerError:
    try:
        return await chat.ask(content, max_tokens=8, temperature=0.0)
    except ChatServerError as exc:
        return exc


async def test_one_session_on_two_replicas_is_answered_by_one_at_a_time(
    replicas: list[ServerProcess],
) -> None:
    a, b = replicas
    prefix = _prefix_of(a)
    tokenizer = gguf_tokenizer()
    async with await ChatClient.connect(a.ws) as on_a, await ChatClient.connect(b.ws) as on_b:
        opened = await on_a.open(SYSTEM)
        await on_b.resume(opened.session_id, opened.secret)
        winners = set()
        for round_ in range(ROUNDS):
            results = await asyncio.gather(
                _ask(on_a, f"Round {round_} from a."), _ask(on_b, f"Round {round_} from b.")
            )
            answers = [r for r in results if isinstance(r, Answer)]
            refusals = [r for r in results if isinstance(r, ChatServerError)]
            assert len(answers) == 1 and len(refusals) == 1, results
            assert refusals[0].code == "busy" and not refusals[0].fatal
            winners.add(0 if isinstance(results[0], Answer) else 1)
            messages, page_map = await asyncio.to_thread(_stored, prefix, opened.session_id)
            # One exchange per round, and the page map holds every one of them, in order.
            assert len(messages) == 2 * (round_ + 1)
            assert messages[-1].content == answers[0].text
            seen = tokenizer.decode(page_map.token_ids)
            at = seen.index(SYSTEM)
            for message in messages:
                found = seen.find(message.content, at)
                assert found >= 0, (message, seen)
                at = found + len(message.content)
    for server in replicas:
        await wait_balanced(server)


async def test_a_burst_of_300_opens_and_resumes_is_served_whole(
    replicas: list[ServerProcess],
) -> None:
    a = replicas[0]

    async def open_and_resume() -> None:
        async with await ChatClient.connect(a.ws) as chat:
            opened = await chat.open()
        async with await ChatClient.connect(a.ws) as chat:
            resumed = await chat.resume(opened.session_id, opened.secret)
            assert resumed.resumed

    results = await asyncio.gather(*(open_and_resume() for _ in range(300)), return_exceptions=True)
    failures = [r for r in results if isinstance(r, BaseException)]
    assert not failures, failures[:3]
    await wait_balanced(a)
