"""Turning one sample's tokens into streamed text, and deciding when it stops.

Text that might be the start of a stop string is held back until it is known not to be, so a
client never sees part of a stop string. Stop tokens (eos, `stop_token_ids`) end the answer
without adding text; they stay in the sequence's token ids, as the model saw them.
"""

from __future__ import annotations

from service.engine.params import SamplingParams
from service.engine.tokenizer import Tokenizer
from service.engine.values import FinishReason


class StopChecker:
    def __init__(self, tokenizer: Tokenizer, params: SamplingParams) -> None:
        self._detokenizer = tokenizer.detokenizer()
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(tokenizer.eos_token_ids)
        self.stop_ids = frozenset(stop_ids)
        self._min_tokens = params.min_tokens
        self._stops = params.stop
        self._hold = max((len(s) for s in params.stop), default=1) - 1
        self._max_tokens = params.max_tokens
        self._text = ""
        self._emitted = 0

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return self._text[: self._emitted]

    def push(self, token_id: int, num_output_tokens: int) -> tuple[str, FinishReason | None]:
        """Take the newest token; return the text now safe to emit and why it stopped, if so."""
        early = num_output_tokens < self._min_tokens  # no stop yet (the sampler masks ids)
        if token_id in self.stop_ids and not early:
            return self.flush(), FinishReason.STOP
        self._text += self._detokenizer.push(token_id)
        for stop in () if early else self._stops:
            at = self._text.find(stop, max(0, self._emitted - self._hold))
            if at >= 0:
                self._text = self._text[:at]
                return self.flush(), FinishReason.STOP
        if num_output_tokens >= self._max_tokens:
            return self.flush(), FinishReason.LENGTH
        safe = len(self._text) - self._hold
        if safe <= self._emitted:
            return "", None
        out = self._text[self._emitted : safe]
        self._emitted = safe
        return out, None

    def flush(self) -> str:
        out = self._text[self._emitted :]
        self._emitted = len(self._text)
        return out
