"""A thinking model's answer split into its reasoning and its content: the text inside
`<think>...</think>` is `reasoning_content` (vLLM's field), the rest `content`.

A model thinks when its vocabulary holds `<think>` and `</think>` as tokens of their own (Qwen3,
QwQ, DeepSeek-R1's distillations); for any other the answer is all content. The template may
open the block itself (a prompt ending in `<think>`: DeepSeek-R1's, Qwen3's thinking-only
models), and then the answer is reasoning until `</think>`; else it is reasoning only where it
opens with `<think>` (Qwen3 with thinking on; with `enable_thinking: false` its template writes
an empty block into the prompt and the answer is content).
"""

from __future__ import annotations

from dataclasses import dataclass

from service.engine.values import TextTokenizer

OPEN, CLOSE = "<think>", "</think>"


def thinks(tokenizer: TextTokenizer) -> bool:
    """Whether this model's answers may hold a thinking block."""
    return tokenizer.token_to_id(OPEN) is not None and tokenizer.token_to_id(CLOSE) is not None


def opened_by_prompt(tokenizer: TextTokenizer, prompt: list[int]) -> bool:
    """Whether the prompt leaves a thinking block open (its last tokens `<think>`, maybe a
    newline after it)."""
    tail = tokenizer.decode(prompt[-3:]) if prompt else ""
    return tail.rstrip().endswith(OPEN)


@dataclass(slots=True)
class Split:
    reasoning: str | None  # None: the answer held no thinking block
    content: str


def split(text: str, opened: bool) -> Split:
    """A whole answer's reasoning and content (`opened`: the prompt opened the block)."""
    stripped = text.lstrip()
    if not opened and not stripped.startswith(OPEN):
        return Split(None, text)
    inner = stripped.removeprefix(OPEN) if not opened else text
    reasoning, closed, content = inner.partition(CLOSE)
    if not closed:  # cut short while thinking: all of it is reasoning
        return Split(reasoning.strip(), "")
    return Split(reasoning.strip(), content.lstrip("\n"))


class ReasoningStream:
    """An answer streamed as (reasoning, content) pieces: text that may be the start of a
    marker is held back until it is known not to be one."""

    __slots__ = ("_held", "_state", "_trim")

    def __init__(self, opened: bool) -> None:
        # "start": not yet known whether it thinks; "reasoning"; "content"
        self._state = "reasoning" if opened else "start"
        self._held = ""
        self._trim = False  # the newlines after a marker are the block's, not the text's

    def push(self, new: str) -> tuple[str, str]:
        """The reasoning and the content now safe to stream."""
        self._held += new
        reasoning = content = ""
        while True:
            if self._state == "start":
                stripped = self._held.lstrip()
                if stripped.startswith(OPEN):
                    self._held = stripped[len(OPEN) :]
                    self._state, self._trim = "reasoning", True
                    continue
                if OPEN.startswith(stripped):  # "", "<", "<thi": not known yet
                    return reasoning, content
                self._state = "content"
                continue
            if self._trim:
                self._held = self._held.lstrip("\n")
                if not self._held:
                    return reasoning, content
                self._trim = False
            if self._state == "reasoning":
                at = self._held.find(CLOSE)
                if at >= 0:
                    reasoning += self._held[:at]
                    self._held = self._held[at + len(CLOSE) :]
                    self._state, self._trim = "content", True
                    continue
                keep = _partial(self._held, CLOSE)
                reasoning += self._held[: len(self._held) - keep]
                self._held = self._held[len(self._held) - keep :]
                return reasoning, content
            content += self._held
            self._held = ""
            return reasoning, content

    def feed(self, new: str, finished: bool) -> tuple[str, str]:
        """`push`, and at the answer's end what `finish` holds back too."""
        reasoning, content = self.push(new)
        if not finished:
            return reasoning, content
        more_reasoning, more = self.finish()
        return reasoning + more_reasoning, content + more

    def finish(self) -> tuple[str, str]:
        """What is held back when the answer ends."""
        held, self._held = self._held, ""
        if self._state == "reasoning":
            return held, ""
        return "", held


def _partial(text: str, marker: str) -> int:
    """How many trailing characters of `text` could begin `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0
