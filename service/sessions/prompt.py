"""How a conversation becomes token ids, turn after turn: the one prompt builder of the
service, the terminal chat (`pagechat chat`) and the OpenAI endpoints.

The first turn renders the chat template. Every later turn's prompt is the stored token ids
of the conversation so far plus the new user turn's tokens, so the whole previous
conversation is a prefix-cache hit while its blocks survive. A request that carries its whole
conversation (OpenAI's) is rendered whole, or left open to continue its last assistant turn.

NOTE: the pieces (a user turn, the end of an assistant turn) are cut from the model's own
template by rendering a small probe conversation with and without them, so any template whose
rendering only ever appends works; one that rewrites earlier turns is refused at start-up.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from service.engine.values import TextTokenizer
from service.sessions.models import Message, Role

# A stand-in conversation to cut template pieces from; its contents never reach a prompt.
_PROBE = (
    {"role": "system", "content": "S"},
    {"role": "user", "content": "U"},
    {"role": "assistant", "content": "A"},
)


class TemplateError(ValueError):
    """The chat template does not render conversations append-only."""


class ChatFormat:
    def __init__(self, tokenizer: TextTokenizer) -> None:
        self.tokenizer = tokenizer
        self._probe = tokenizer.apply_chat_template(_PROBE, add_generation_prompt=False)
        asked = tokenizer.apply_chat_template(_PROBE[:2], add_generation_prompt=True)
        answer = tokenizer.encode(_PROBE[2]["content"])
        if self._probe[: len(asked) + len(answer)] != asked + answer:
            raise TemplateError("the template does not append an assistant turn")
        # What follows an answer's tokens to close the turn (ChatML: <|im_end|> "\n").
        self.end_of_turn: list[int] = self._probe[len(asked) + len(answer) :]
        if not self.end_of_turn:
            raise TemplateError("the template ends an assistant turn with nothing")
        self.user_turn("probe")  # fail at start-up, not on the first second turn

    def first_prompt(self, system: str | None, content: str) -> list[int]:
        """A new conversation; system None keeps the template's default system prompt."""
        messages = [] if system is None else [{"role": "system", "content": system}]
        messages.append({"role": "user", "content": content})
        return self.conversation(messages)

    def conversation(
        self,
        turns: Sequence[Mapping[str, str]],
        *,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """A whole conversation of `{"role", "content"}` turns through the template, contents
        as plain text; with the generation prompt, the assistant's turn opened after it.
        `template_kwargs`: a request's own template variables (`enable_thinking`)."""
        return self.tokenizer.apply_chat_template(turns, add_generation_prompt, template_kwargs)

    def continuation(
        self,
        turns: Sequence[Mapping[str, str]],
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """The conversation with its last (assistant) turn left open, so that the answer goes
        on from its text: rendered closed, less the tokens that end a turn."""
        closed = self.conversation(
            turns, add_generation_prompt=False, template_kwargs=template_kwargs
        )
        end = self.end_of_turn
        if closed[-len(end) :] != end:
            raise TemplateError("this model's template cannot continue an assistant message")
        return closed[: -len(end)]

    def system_prefix(self, system: str | None) -> list[int]:
        """The leading tokens every conversation with this system prompt has, whatever the
        user says: the template's fixed prefix and the system prompt (the part sessions may
        share in the prefix cache)."""
        first = self.first_prompt(system, "a")
        return first[: _common_prefix_len(first, self.first_prompt(system, "b"))]

    def user_turn(self, content: str) -> list[int]:
        """The tokens a user turn adds after a closed conversation, generation prompt included."""
        full = self.tokenizer.apply_chat_template([*_PROBE, {"role": "user", "content": content}])
        if full[: len(self._probe)] != self._probe:
            raise TemplateError("the template rewrites earlier turns when one is added")
        return full[len(self._probe) :]

    def next_prompt(self, history: list[int], content: str) -> list[int]:
        return history + self.user_turn(content)

    def close_turn(self, answer: list[int]) -> list[int]:
        """The tokens that end an assistant turn after `answer` (which may already hold the
        first of them: the model stops on <|im_end|>, and it stays in its token ids)."""
        end = self.end_of_turn
        if answer and answer[-1] == end[0]:
            return end[1:]
        return end

    def render(self, system: str | None, messages: Sequence[Message], content: str) -> list[int]:
        """A prompt from the stored text alone: for a page map written for another model."""
        turns = [] if system is None else [{"role": "system", "content": system}]
        turns += [{"role": str(m.role), "content": m.content} for m in messages]
        turns.append({"role": Role.USER.value, "content": content})
        return self.conversation(turns)


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
