"""What a client asks for, as the engine's SamplingParams within the server's limits: the one
builder of the WebSocket (`user` frames) and the OpenAI endpoints. Each transport maps a
`SamplingError` to its own error."""

from __future__ import annotations

import enum
from collections.abc import Sequence

from service.api.limits import Limits
from service.engine.params import SamplingParams, StructuredOutput
from service.engine.values import TextTokenizer

MAX_BAD_WORDS = 64


class SamplingErrorKind(enum.Enum):
    """Why a request's sampling fields cannot be served; each transport has its error for it."""

    INVALID = "invalid"  # out of range, or not a value at all
    OVER_LIMIT = "over_limit"  # max_tokens over --max-tokens
    CONTEXT = "context"  # max_tokens more than the context has left after the prompt


class SamplingError(ValueError):
    def __init__(
        self, message: str, param: str | None, kind: SamplingErrorKind = SamplingErrorKind.INVALID
    ) -> None:
        super().__init__(message)
        self.param = param  # the SamplingParams field it is about, when one is
        self.kind = kind


def sampling_params(
    limits: Limits,
    *,
    max_tokens: int | None,  # as asked; None: `default_max_tokens`
    default_max_tokens: int,
    room: int | None = None,  # tokens the context leaves for an answer; None: not checked
    temperature: float,
    top_p: float,
    top_k: int = 0,
    n: int = 1,
    seed: int | None = None,
    stop: tuple[str, ...] = (),
    stop_token_ids: tuple[int, ...] = (),
    ignore_eos: bool = False,
    logprobs: int | None = None,
    logit_bias: tuple[tuple[int, float], ...] = (),
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    repetition_penalty: float = 1.0,
    min_p: float = 0.0,
    min_tokens: int = 0,
    bad_words: tuple[tuple[int, ...], ...] = (),
    structured: StructuredOutput | None = None,
) -> SamplingParams:
    """An explicit max_tokens is refused under 1 (0 is no answer at all, never "the default":
    leaving it out is), over the limit, or (given `room`) past what the context holds; the
    default is cut to `room`."""
    if max_tokens is not None and max_tokens < 1:
        raise SamplingError("max_tokens must be >= 1 (omit it for the default)", "max_tokens")
    if max_tokens is not None and max_tokens > limits.max_tokens:
        raise SamplingError(
            f"max_tokens is {max_tokens}; the limit is {limits.max_tokens}",
            "max_tokens",
            SamplingErrorKind.OVER_LIMIT,
        )
    if max_tokens is not None and room is not None and max_tokens > room:
        raise SamplingError(
            f"max_tokens is {max_tokens}; the context has room for {room}",
            "max_tokens",
            SamplingErrorKind.CONTEXT,
        )
    try:
        return SamplingParams(
            max_tokens=_default(default_max_tokens, room) if max_tokens is None else max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            n=n,
            seed=seed,
            stop=stop,
            stop_token_ids=stop_token_ids,
            ignore_eos=ignore_eos,
            logprobs=logprobs,
            logit_bias=logit_bias,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            repetition_penalty=repetition_penalty,
            min_p=min_p,
            min_tokens=min_tokens,
            bad_words=bad_words,
            structured=structured,
        )
    except ValueError as exc:
        raise SamplingError(str(exc), _field_named(str(exc))) from None


def bad_word_ids(words: Sequence[str], tokenizer: TextTokenizer) -> tuple[tuple[int, ...], ...]:
    """vLLM's bad_words as token sequences: each word as it reads at the start of a text and
    after a space (" word" is other tokens in most vocabularies)."""
    if len(words) > MAX_BAD_WORDS:
        raise SamplingError(f"bad_words takes at most {MAX_BAD_WORDS} words", "bad_words")
    found: dict[tuple[int, ...], None] = {}
    for word in words:
        if not word.strip():
            raise SamplingError("bad_words must be non-empty words", "bad_words")
        for text in (word, " " + word.lstrip()):
            if ids := tuple(tokenizer.encode(text)):
                found[ids] = None
    return tuple(found)


def _default(default_max_tokens: int, room: int | None) -> int:
    return default_max_tokens if room is None else min(default_max_tokens, room)


def _field_named(message: str) -> str | None:
    """The field a SamplingParams error is about ("top_p must be ..." -> top_p)."""
    name = message.split(" ", 1)[0]
    return name if name in SamplingParams.__struct_fields__ else None
