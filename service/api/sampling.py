"""What a client asks of an answer, as the engine's SamplingParams within the server's limits
and the room the prompt leaves: the one builder of every transport.

Each request type converts itself into one `AskedSampling` (the OpenAI requests with their
`sampling` method; a `/v1/chat` `user` frame's params, and the `pagechat` command's flags, which
are the same fields, with `user_sampling`); `sampling_params` checks it and builds the engine's
value. Each transport maps a `SamplingError` to its own error.

NOTE (room): one rule for an answer's length, on every transport. A prompt that fills the
model's context leaves no room for an answer and is refused. An explicit `max_tokens` is what
the client asked for: refused (never silently shortened) when the prompt and it together do not
fit the context, as OpenAI and vLLM refuse it. An absent one means "the default, or the room
left if less": it never fails for lack of room while one token fits.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from protocol.frames import UserParams
from service.api.limits import Limits
from service.api.structured import StructuredError, from_response_format
from service.engine.params import SamplingParams, StructuredOutput
from service.engine.values import TextTokenizer

MAX_BAD_WORDS = 64


class SamplingErrorKind(enum.Enum):
    """Why a request's sampling fields cannot be served; each transport has its error for it."""

    INVALID = "invalid"  # out of range, or not a value at all
    OVER_LIMIT = "over_limit"  # max_tokens over --max-tokens
    CONTEXT = "context"  # the prompt, or the prompt and an explicit max_tokens, past the context


class SamplingError(ValueError):
    def __init__(
        self,
        message: str,
        param: str | None,
        kind: SamplingErrorKind = SamplingErrorKind.INVALID,
        room: Room | None = None,
        max_tokens: int | None = None,
        prompt_param: str = "prompt",
    ) -> None:
        super().__init__(message)
        self.param = param  # the request's name for the field it is about, when one is
        self.kind = kind
        # CONTEXT: the prompt's length and the context's, the explicit max_tokens (None: the
        # prompt alone fills the context), and what the request calls its prompt.
        self.room = room
        self.max_tokens = max_tokens
        self.prompt_param = prompt_param


@dataclass(slots=True, frozen=True)
class Room:
    """How much of the model's context a prompt leaves for its answer."""

    prompt_tokens: int
    max_model_len: int

    @property
    def tokens(self) -> int:
        return self.max_model_len - self.prompt_tokens


class AskedSampling(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A request's sampling fields in no transport's words, before the limits and the room
    are checked. Defaults are the engine's (SamplingParams); a transport with defaults of its
    own (a `user` frame's temperature 0.7) fills them in when it converts."""

    max_tokens: int | None = None  # None: the default, or the room left if less
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    bad_words: tuple[str, ...] = ()  # words; tokenized by `sampling_params`
    structured: StructuredOutput | None = None
    # What the request calls a field where it differs (errors name the request's field):
    # {"max_tokens": "max_completion_tokens", "prompt": "messages", ...}.
    names: dict[str, str] = msgspec.field(default_factory=dict)

    def name(self, field: str) -> str:
        return self.names.get(field, field)


# The fields that reach SamplingParams as asked (max_tokens and bad_words are the builder's).
_AS_ASKED = tuple(
    name
    for name in AskedSampling.__struct_fields__
    if name in SamplingParams.__struct_fields__ and name not in ("max_tokens", "bad_words")
)


def user_sampling(params: UserParams) -> AskedSampling:
    """A `/v1/chat` `user` frame's params (and the `pagechat` command's flags, the same
    fields) as the one value; SamplingError for a response_format that cannot be one."""
    try:
        structured = from_response_format(params.response_format, "params.response_format")
    except StructuredError as exc:
        raise SamplingError(str(exc), exc.param) from None
    return AskedSampling(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        seed=params.seed,
        stop=tuple(params.stop),
        ignore_eos=params.ignore_eos,
        logprobs=params.logprobs,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        min_p=params.min_p,
        min_tokens=params.min_tokens,
        bad_words=tuple(params.bad_words),
        structured=structured,
    )


def sampling_params(
    asked: AskedSampling,
    limits: Limits,
    *,
    default_max_tokens: int,  # max_tokens when none is asked (cut to the room left)
    room: Room | None = None,  # None: the prompt is not known yet; all but the room checked
    tokenizer: TextTokenizer | None = None,  # bad_words are tokenized with it
    vocab_size: int | None = None,  # token ids are below it; None: the tokenizer's
) -> SamplingParams:
    """The engine's parameters for `asked`, or SamplingError. An explicit max_tokens is
    refused under 1 (0 is no answer at all, never "the default": leaving it out is), over the
    limit, or past the room (NOTE (room) above); the default is cut to the room."""
    max_tokens = asked.max_tokens
    prompt = asked.name("prompt")
    if room is not None and room.tokens < 1:
        raise SamplingError(
            f"the {prompt} has {room.prompt_tokens} tokens; the model's context holds "
            f"{room.max_model_len} including the answer",
            prompt,
            SamplingErrorKind.CONTEXT,
            room,
            prompt_param=prompt,
        )
    if vocab_size is None and tokenizer is not None:
        vocab_size = tokenizer.vocab_size
    _check_ids(asked, vocab_size)
    _check_words(asked.bad_words)
    bad_words = bad_word_ids(asked.bad_words, tokenizer) if tokenizer is not None else ()
    if max_tokens is not None:
        _check_max_tokens(asked, max_tokens, limits, room)
    try:
        return SamplingParams(
            max_tokens=_default(default_max_tokens, room) if max_tokens is None else max_tokens,
            bad_words=bad_words,
            **{name: getattr(asked, name) for name in _AS_ASKED},
        )
    except ValueError as exc:
        field = _field_named(str(exc))
        raise SamplingError(str(exc), None if field is None else asked.name(field)) from None


def bad_word_ids(words: Sequence[str], tokenizer: TextTokenizer) -> tuple[tuple[int, ...], ...]:
    """vLLM's bad_words as token sequences: each word as it reads at the start of a text and
    after a space (" word" is other tokens in most vocabularies)."""
    _check_words(words)
    found: dict[tuple[int, ...], None] = {}
    for word in words:
        for text in (word, " " + word.lstrip()):
            if ids := tuple(tokenizer.encode(text)):
                found[ids] = None
    return tuple(found)


def _check_max_tokens(
    asked: AskedSampling, max_tokens: int, limits: Limits, room: Room | None
) -> None:
    param = asked.name("max_tokens")
    if max_tokens < 1:
        raise SamplingError(f"{param} must be >= 1 (omit it for the default)", param)
    if max_tokens > limits.max_tokens:
        raise SamplingError(
            f"{param} is {max_tokens}; the limit is {limits.max_tokens}",
            param,
            SamplingErrorKind.OVER_LIMIT,
        )
    if room is not None and max_tokens > room.tokens:
        raise SamplingError(
            f"{param} is {max_tokens}; the context has room for {room.tokens} after the "
            f"{room.prompt_tokens} of the {asked.name('prompt')} (omit {param} for the room left)",
            param,
            SamplingErrorKind.CONTEXT,
            room,
            max_tokens,
            asked.name("prompt"),
        )


def _check_words(words: Sequence[str]) -> None:
    if len(words) > MAX_BAD_WORDS:
        raise SamplingError(f"bad_words takes at most {MAX_BAD_WORDS} words", "bad_words")
    if any(not word.strip() for word in words):
        raise SamplingError("bad_words must be non-empty words", "bad_words")


def _check_ids(asked: AskedSampling, vocab_size: int | None) -> None:
    if vocab_size is None:
        return
    if any(not 0 <= t < vocab_size for t in asked.stop_token_ids):
        param = asked.name("stop_token_ids")
        raise SamplingError(f"{param} must be in 0..{vocab_size - 1}", param)
    for token, _ in asked.logit_bias:
        if token >= vocab_size:
            param = asked.name("logit_bias")
            raise SamplingError(f"{param}: '{token}' is not a token id of this model", param)


def _default(default_max_tokens: int, room: Room | None) -> int:
    return default_max_tokens if room is None else min(default_max_tokens, room.tokens)


def _field_named(message: str) -> str | None:
    """The field a SamplingParams error is about ("top_p must be ..." -> top_p)."""
    name = message.split(" ", 1)[0]
    return name if name in SamplingParams.__struct_fields__ else None
