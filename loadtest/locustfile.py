"""Locust users speaking pagechat's /v1/chat WebSocket protocol (docs/protocol.md).

    .venv/bin/python -m loadtest.run --url ws://127.0.0.1:8000 --users 16 --run-time 2m
    .venv/bin/locust -f loadtest/locustfile.py --host ws://127.0.0.1:8000   # the web UI

Six scenarios, one user class each, each class's task tagged with its scenario name (pick
them with `--tags returning oneshot` or by class name on the command line):

- `multiturn` (MultiTurnUser): a new conversation of `--turns` messages with think time;
- `shared` (SharedPromptUser): new conversations under one of a few long system prompts, so
  their first turns share prefix-cache pages;
- `returning` (ReturningUser): a user who disconnects after each turn and comes back after
  `--away-time` with its session id and secret (`?session=ID` in the URL, for the proxy);
- `oneshot` (OneShotUser): a flood of short one-turn questions;
- `openai` (OpenAIUser): conversations over the OpenAI-compatible HTTP endpoint, streamed,
  each turn resending the history (which the prefix cache still serves);
- `slow` (SlowClientUser): hostile-ish clients: one that reads its answer's frames slowly
  (`--read-delay` between frames, well inside the server's slow-reader limit), and every
  third visit one that leaves mid-answer without a word (the server aborts the answer and
  stores what was said); leaving is counted as `vanished`, never a failure.

What each entry in Locust's statistics means (type, name):

- `session`, `open` / `resume`: connect and get the session frame (ms);
- `turn`, <scenario>: whole turn, user frame sent -> done frame (ms); the size is the number of
  tokens generated. Failures (error frames, dropped connections) are counted here;
- `ttft`, <scenario> and `ttft`, `all`: time to first token (ms);
- `itl`, <scenario> and `itl`, `all`: inter-token latency, one entry per token after the first;
- `share`, `cached %` / `swapped %` / `recomputed %`: per turn, the share of the prompt found on
  the device, swapped in from the CPU pool, or computed (the done frame's usage), as a
  "response time" of 0..100; the size is the token count.

Locust's "Aggregated" row mixes these units: read the rows.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

import websocket
from locust import User, between, events, tag, task
from locust.env import Environment

from clients.chat_client import ChatServerError as ServerError
from loadtest.httpclient import CompletionError, stream_completion
from loadtest.wsclient import ChatSocket, TurnResult, chat_url
from protocol.frames import User as UserFrame
from protocol.frames import UserParams

QUESTIONS = (
    "What is a paged KV cache?",
    "Give me three tips for writing clear emails.",
    "Why is the sky blue?",
    "Suggest a name for a grey cat.",
    "How do I boil an egg?",
    "What does a compiler do?",
    "Write a haiku about autumn.",
    "Explain recursion to a child.",
    "What is the capital of Australia?",
    "How can I sleep better?",
    "Summarise the plot of Hamlet in two sentences.",
    "What is the difference between a list and a tuple in Python?",
)

SHORT_QUESTIONS = (
    "What is 2 + 2?",
    "Say hello.",
    "Name a fruit.",
    "Is water wet?",
    "What colour is grass?",
    "Spell cat.",
)

SYSTEM_PROMPTS = (
    "You are the support assistant of a small bookshop. You help customers find books, "
    "check opening hours (Monday to Saturday, nine to six), explain the returns policy "
    "(thirty days with a receipt) and recommend titles by genre. Answer in one or two short "
    "sentences, be friendly, never invent stock levels, and suggest calling the shop for "
    "anything about orders that are already placed.",
    "You are a patient maths tutor for secondary-school students. Explain each step, use "
    "small whole numbers in examples, check the student's understanding with one question at "
    "the end, and never give only the final answer. Keep every reply under eighty words and "
    "avoid notation the student has not used first.",
    "You are a travel planner. For any destination you suggest what to see in one day, how to "
    "get around by public transport, one local dish to try and one thing to avoid. Keep "
    "answers practical and short, mention the best season to visit when it matters, and say "
    "so plainly when you are unsure about a detail.",
)


@events.init_command_line_parser.add_listener
def _add_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("pagechat")
    group.add_argument("--max-tokens", type=int, default=32, help="answer length cap per turn")
    group.add_argument(
        "--oneshot-max-tokens", type=int, default=8, help="answer cap of the oneshot scenario"
    )
    group.add_argument("--turns", type=int, default=3, help="messages per multiturn conversation")
    group.add_argument("--think-time", type=float, default=4.0, help="mean seconds between turns")
    group.add_argument(
        "--away-time", type=float, default=20.0, help="mean seconds a returning user stays away"
    )
    group.add_argument(
        "--visits", type=int, default=4, help="returns before a returning user starts over"
    )
    group.add_argument("--ws-timeout", type=float, default=300.0, help="socket timeout (s)")
    group.add_argument(
        "--read-delay", type=float, default=0.1, help="seconds a slow client waits per frame"
    )


_DEFAULTS = {
    "max_tokens": 32,
    "oneshot_max_tokens": 8,
    "turns": 3,
    "think_time": 4.0,
    "away_time": 20.0,
    "visits": 4,
    "ws_timeout": 300.0,
    "read_delay": 0.1,
}


def _option(environment: Environment, name: str) -> Any:
    parsed = environment.parsed_options
    return getattr(parsed, name, _DEFAULTS[name]) if parsed is not None else _DEFAULTS[name]


def _think(user: User) -> float:
    mean = float(_option(user.environment, "think_time"))
    return random.uniform(0.5 * mean, 1.5 * mean)


def _away(user: User) -> float:
    mean = float(_option(user.environment, "away_time"))
    return random.uniform(0.5 * mean, 1.5 * mean)


_NETWORK_ERRORS = (
    ServerError,
    CompletionError,
    websocket.WebSocketException,
    OSError,
    AssertionError,
)


class ChatUser(User):
    """Shared plumbing: sockets, turns, and the entries they add to Locust's statistics.

    NOTE: only network calls sit inside `try/except`: `self.wait()` raises StopUser when the
    run ends, and that must reach Locust, never be counted as a failure.
    """

    abstract = True
    scenario = "chat"
    wait_time = _think

    def _record(
        self, kind: str, name: str, ms: float, size: int = 0, exc: BaseException | None = None
    ) -> None:
        self.environment.events.request.fire(
            request_type=kind,
            name=name,
            response_time=ms,
            response_length=size,
            exception=exc,
            context={},
        )

    def _connect(self, session_id: str | None = None) -> ChatSocket:
        url = chat_url(self.host or "ws://127.0.0.1:8000", session_id)
        return ChatSocket(url, timeout_s=float(_option(self.environment, "ws_timeout")))

    def _open(self, system: str | None = None) -> ChatSocket | None:
        start = time.perf_counter()
        try:
            sock = self._connect()
            sock.open(system)
        except _NETWORK_ERRORS as exc:
            self._record("session", "open", _ms_since(start), exc=exc)
            return None
        self._record("session", "open", _ms_since(start))
        return sock

    def _resume(self, session_id: str, secret: str, history: int) -> ChatSocket | None:
        start = time.perf_counter()
        sock: ChatSocket | None = None
        try:
            sock = self._connect(session_id)
            opened = sock.resume(session_id, secret)
            if len(opened.messages) < history:
                raise AssertionError(
                    f"resumed with {len(opened.messages)} messages; {history} were stored"
                )
        except _NETWORK_ERRORS as exc:
            self._record("session", "resume", _ms_since(start), exc=exc)
            if sock is not None:
                sock.close()
            return None
        self._record("session", "resume", _ms_since(start))
        return sock

    def _converse(self, system: str | None, turns: int) -> None:
        """Open a session and ask `turns` questions with think time between them."""
        sock = self._open(system)
        if sock is None:
            return
        try:
            for turn in range(turns):
                if turn:
                    self.wait()
                max_tokens = int(_option(self.environment, "max_tokens"))
                if self._ask(sock, random.choice(QUESTIONS), max_tokens) is None:
                    return
        finally:
            sock.close()

    def _ask(
        self, sock: ChatSocket, content: str, max_tokens: int, read_delay_s: float = 0.0
    ) -> TurnResult | None:
        """One turn; its entries are recorded. None when it failed."""
        params = UserParams(max_tokens=max_tokens, temperature=0.7)
        start = time.perf_counter()
        try:
            result = sock.ask(content, params, read_delay_s=read_delay_s)
        except _NETWORK_ERRORS as exc:
            self._record("turn", self.scenario, _ms_since(start), exc=exc)
            return None
        done = result.done
        assert done is not None
        self._record("turn", self.scenario, _ms_since(start), done.usage.completion_tokens)
        self._timings(result)
        usage = done.usage
        self._shares(
            usage.prompt_tokens,
            usage.cached_tokens,
            usage.swapped_in_tokens,
            usage.recomputed_tokens,
        )
        return result

    def _timings(self, result: TurnResult) -> None:
        if (ttft := result.ttft_s) is not None:
            for name in (self.scenario, "all"):
                self._record("ttft", name, ttft * 1000.0)
        for gap in result.inter_token_s:
            for name in (self.scenario, "all"):
                self._record("itl", name, gap * 1000.0)

    def _shares(self, prompt: int, cached: int, swapped: int, recomputed: int) -> None:
        """Where the prompt's tokens came from (the OpenAI usage folds swapped into cached)."""
        if prompt > 0:
            for name, tokens in (
                ("cached %", cached),
                ("swapped %", swapped),
                ("recomputed %", recomputed),
            ):
                self._record("share", name, 100.0 * tokens / prompt, tokens)


def _ms_since(start: float) -> float:
    return (time.perf_counter() - start) * 1000.0


class MultiTurnUser(ChatUser):
    """A new conversation of several messages, with think time between them."""

    scenario = "multiturn"

    @tag("multiturn")
    @task
    def conversation(self) -> None:
        self._converse(None, int(_option(self.environment, "turns")))


class SharedPromptUser(ChatUser):
    """Conversations under one of a few long system prompts: a shared cached prefix."""

    scenario = "shared"

    @tag("shared")
    @task
    def conversation(self) -> None:
        self._converse(random.choice(SYSTEM_PROMPTS), turns=2)


class ReturningUser(ChatUser):
    """Asks, disconnects, stays away, then resumes the same session with its secret."""

    scenario = "returning"
    wait_time = _away

    def on_start(self) -> None:
        self.session: tuple[str, str] | None = None  # (session id, secret)
        self.visits = 0
        self.messages = 0  # stored in the session so far, as this user knows it

    @tag("returning")
    @task
    def visit(self) -> None:
        if self.session is None or self.visits >= int(_option(self.environment, "visits")):
            sock = self._open()
            self.session, self.visits, self.messages = None, 0, 0
        else:
            session_id, secret = self.session
            sock = self._resume(session_id, secret, self.messages)
        if sock is None:
            self.session = None
            return
        try:
            max_tokens = int(_option(self.environment, "max_tokens"))
            if self._ask(sock, random.choice(QUESTIONS), max_tokens) is None:
                self.session = None
                return
            assert sock.session_id is not None and sock.secret is not None
            self.session = (sock.session_id, sock.secret)
            self.visits += 1
            self.messages += 2
        finally:
            sock.close()


class OneShotUser(ChatUser):
    """A flood of short questions, each in a session of its own."""

    scenario = "oneshot"
    wait_time = between(0.0, 1.0)

    @tag("oneshot")
    @task
    def question(self) -> None:
        sock = self._open()
        if sock is None:
            return
        try:
            max_tokens = int(_option(self.environment, "oneshot_max_tokens"))
            self._ask(sock, random.choice(SHORT_QUESTIONS), max_tokens)
        finally:
            sock.close()


class OpenAIUser(ChatUser):
    """Conversations over POST /v1/chat/completions (streamed), resending the history."""

    scenario = "openai"

    @tag("openai")
    @task
    def conversation(self) -> None:
        messages: list[dict[str, str]] = []
        for turn in range(int(_option(self.environment, "turns"))):
            if turn:
                self.wait()
            messages.append({"role": "user", "content": random.choice(QUESTIONS)})
            params = {
                "max_tokens": int(_option(self.environment, "max_tokens")),
                "temperature": 0.7,
            }
            start = time.perf_counter()
            try:
                answer = stream_completion(
                    self.host or "http://127.0.0.1:8000",
                    messages,
                    params,
                    float(_option(self.environment, "ws_timeout")),
                )
            except _NETWORK_ERRORS as exc:
                self._record("turn", self.scenario, _ms_since(start), exc=exc)
                return
            usage = answer.usage
            self._record("turn", self.scenario, _ms_since(start), usage["completion_tokens"])
            self._timings(answer.turn)
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            self._shares(usage["prompt_tokens"], cached, 0, usage["prompt_tokens"] - cached)
            messages.append({"role": "assistant", "content": answer.turn.text})


class SlowClientUser(ChatUser):
    """A slow reader (frames read `--read-delay` apart) and, every third visit, a client that
    vanishes mid-answer: the server must neither stall the others for them nor keep what they
    leave behind (the soak's block and key checks see to that)."""

    scenario = "slow"

    def on_start(self) -> None:
        self.visits = 0

    @tag("slow")
    @task
    def visit(self) -> None:
        self.visits += 1
        sock = self._open()
        if sock is None:
            return
        try:
            max_tokens = int(_option(self.environment, "max_tokens"))
            params = UserParams(max_tokens=max_tokens, temperature=0.7)
            if self.visits % 3 == 0:
                self._vanish(sock, params)
                return
            delay = float(_option(self.environment, "read_delay"))
            self._ask(sock, random.choice(QUESTIONS), max_tokens, read_delay_s=delay)
        finally:
            sock.close()

    def _vanish(self, sock: ChatSocket, params: UserParams) -> None:
        """Ask, read the first delta, and close the socket without a cancel."""
        start = time.perf_counter()
        try:
            sock.send(UserFrame(content=random.choice(QUESTIONS), params=params))
            sock.receive()
        except _NETWORK_ERRORS as exc:
            self._record("turn", self.scenario, _ms_since(start), exc=exc)
            return
        self._record("vanished", self.scenario, _ms_since(start))
