"""Seedable chat request traces, and the bookkeeping to replay one against an engine.

A trace is a set of conversations. Each conversation belongs to one user, starts with one of
`num_system_prompts` shared system prompts, and has one or more turns: a returning user sends
the next turn `think_s` after the previous answer ended, and that turn's prompt is the whole
conversation so far (the prompt and answer of the previous turn) plus the new message.

Lengths are long-tailed like real chat logs (many short turns, a few long ones): user messages
and answers are log-normal, clipped. Defaults (`WorkloadConfig`):

    user message   log-normal, median 48 tokens, sigma 1.0, clipped to [4, 1024]
    answer         log-normal, median 96 tokens, sigma 0.9, clipped to [4, 512]
    system prompt  num_system_prompts=4 distinct prompts of 64 tokens; each user picks one
    returning      after each turn the user comes back with probability 0.5 (at most 4 turns)
    think time     exponential, mean 5 s
    arrivals       first turns as a Poisson process at `rate` conversations/s
    sampling       a turn asks for n=4 samples with probability 0.1, else n=1

A turn whose prompt plus answer would not fit `max_model_len` ends its conversation instead.
Token ids are drawn uniformly from the model's ordinary (non-control) ids. Everything, answer
tokens included (`answer_token_ids`, for model-free replays), is a function of the seed.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable
from dataclasses import dataclass, field

FIRST_TOKEN_ID = 17  # ids 0-16 are control tokens in the default model's vocabulary
VOCAB_SIZE = 49152


@dataclass(slots=True, frozen=True)
class WorkloadConfig:
    seed: int = 0
    num_conversations: int = 200
    rate: float = 4.0  # new conversations per second
    num_system_prompts: int = 4
    system_prompt_len: int = 64
    message_median: float = 48.0
    message_sigma: float = 1.0
    message_max: int = 1024
    answer_median: float = 96.0
    answer_sigma: float = 0.9
    answer_max: int = 512
    return_prob: float = 0.5
    max_turns: int = 4
    think_mean_s: float = 5.0
    parallel_prob: float = 0.1
    parallel_n: int = 4
    max_model_len: int = 2048

    def __post_init__(self) -> None:
        if self.num_conversations < 1 or self.num_system_prompts < 1 or self.max_turns < 1:
            raise ValueError("need >= 1 conversation, system prompt and turn")
        if self.rate <= 0 or self.think_mean_s < 0:
            raise ValueError("rate must be > 0 and think_mean_s >= 0")
        if not (0 <= self.return_prob <= 1 and 0 <= self.parallel_prob <= 1):
            raise ValueError("probabilities must be in [0, 1]")
        if self.system_prompt_len + 8 >= self.max_model_len:
            raise ValueError("the system prompt must leave room in max_model_len")


@dataclass(slots=True, frozen=True)
class Request:
    """One turn. Its prompt is its parent's full history (if any) followed by `new_token_ids`."""

    request_id: str
    conversation: int
    turn: int
    system_prompt: int
    new_token_ids: tuple[int, ...]  # the system prompt + message (first turn), or the message
    prompt_len: int  # with the history, as the trace's own answers make it
    output_len: int
    n: int
    parent: str | None  # the previous turn of the conversation
    arrival_s: float  # first turns: since the trace began; follow-ups: unused
    think_s: float  # follow-ups: after the parent's answer ended


@dataclass(slots=True, frozen=True)
class Trace:
    config: WorkloadConfig
    requests: tuple[Request, ...]

    def by_id(self) -> dict[str, Request]:
        return {r.request_id: r for r in self.requests}

    @property
    def num_output_tokens(self) -> int:
        return sum(r.output_len * r.n for r in self.requests)


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, round(rng.lognormvariate(math.log(median), sigma))))


def _tokens(rng: random.Random, count: int) -> tuple[int, ...]:
    return tuple(rng.randrange(FIRST_TOKEN_ID, VOCAB_SIZE) for _ in range(count))


def answer_token_ids(config: WorkloadConfig, request: Request, sample: int) -> list[int]:
    """The answer a model-free replay appends for `sample` of `request` (deterministic)."""
    rng = random.Random(f"{config.seed}/{request.request_id}/{sample}")
    return list(_tokens(rng, request.output_len))


def generate(config: WorkloadConfig) -> Trace:
    rng = random.Random(config.seed)
    system_prompts = [
        _tokens(rng, config.system_prompt_len) for _ in range(config.num_system_prompts)
    ]
    requests: list[Request] = []
    start = 0.0
    for conv in range(config.num_conversations):
        start += rng.expovariate(config.rate)
        sp = rng.randrange(config.num_system_prompts)
        history = 0
        parent: str | None = None
        for turn in range(config.max_turns):
            message = _tokens(
                rng,
                _lognormal(rng, config.message_median, config.message_sigma, 4, config.message_max),
            )
            output_len = _lognormal(
                rng, config.answer_median, config.answer_sigma, 4, config.answer_max
            )
            n = config.parallel_n if rng.random() < config.parallel_prob else 1
            think = rng.expovariate(1 / config.think_mean_s) if config.think_mean_s else 0.0
            returns = rng.random() < config.return_prob
            new = (*system_prompts[sp], *message) if parent is None else message
            prompt_len = history + len(new)
            if prompt_len + output_len > config.max_model_len:
                break
            request = Request(
                request_id=f"c{conv}t{turn}",
                conversation=conv,
                turn=turn,
                system_prompt=sp,
                new_token_ids=new,
                prompt_len=prompt_len,
                output_len=output_len,
                n=n,
                parent=parent,
                arrival_s=start if parent is None else 0.0,
                think_s=think if parent is not None else 0.0,
            )
            requests.append(request)
            history, parent = prompt_len + output_len, request.request_id
            if not returns:
                break
    return Trace(config, tuple(requests))


@dataclass(slots=True)
class Arrivals:
    """Releases a trace's turns when they are due, in a replay on any clock.

    `burst`: every first turn is due at time 0 and every follow-up as soon as its parent ends
    (a saturated server); otherwise first turns come at their arrival times and follow-ups
    `think_s` after their parent ended. `finish` records a turn's answer (sample 0), which
    becomes part of its follow-up's prompt.
    """

    trace: Trace
    burst: bool = False
    _pending: list[Request] = field(default_factory=list)
    _children: dict[str, Request] = field(default_factory=dict)
    _history: dict[str, list[int]] = field(default_factory=dict)
    _due_at: dict[str, float] = field(default_factory=dict)
    _outstanding: int = 0

    def __post_init__(self) -> None:
        for r in self.trace.requests:
            if r.parent is None:
                self._pending.append(r)
                self._due_at[r.request_id] = 0.0 if self.burst else r.arrival_s
            else:
                self._children[r.parent] = r
        self._pending.sort(key=lambda r: self._due_at[r.request_id])
        self._outstanding = len(self.trace.requests)

    @property
    def done(self) -> bool:
        return self._outstanding == 0

    def next_due(self) -> float | None:
        return self._due_at[self._pending[0].request_id] if self._pending else None

    def due(self, now: float) -> list[Request]:
        """Turns due by `now`, in order; each is handed out once."""
        out: list[Request] = []
        while self._pending and self._due_at[self._pending[0].request_id] <= now:
            out.append(self._pending.pop(0))
        return out

    def prompt(self, request: Request) -> list[int]:
        history = self._history.pop(request.parent, []) if request.parent else []
        return [*history, *request.new_token_ids]

    def finish(self, request: Request, now: float, token_ids: Iterable[int]) -> None:
        """`request` ended at `now`; `token_ids` is its prompt and sample 0's answer."""
        self._outstanding -= 1
        child = self._children.pop(request.request_id, None)
        if child is None:
            return
        self._history[request.request_id] = list(token_ids)
        self._due_at[child.request_id] = now + (0.0 if self.burst else child.think_s)
        self._pending.append(child)
        self._pending.sort(key=lambda r: self._due_at[r.request_id])
