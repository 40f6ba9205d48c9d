"""OpenAI's sampling fields, shared by chat and text completions, as one `AskedSampling`
(service/api/sampling.py builds the engine's SamplingParams from it); the fields accepted only
at the value this server always behaves as; the builder's refusals in OpenAI's shape."""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from protocol.frames import ResponseFormat
from service.api.nesting import nesting_message, too_deep
from service.api.openai.errors import (
    OpenAIError,
    context_exceeded,
    decode_error,
    invalid,
    model_not_found,
)
from service.api.openai.unknown_fields import decode
from service.api.sampling import AskedSampling, SamplingError, SamplingErrorKind
from service.api.structured import (
    StructuredError,
    VllmStructuredOutputs,
    from_response_format,
    from_vllm_fields,
)
from service.engine.params import StructuredOutput

# Fields accepted at the value this server always behaves as, refused at any other.
NEUTRAL = {
    "include_stop_str_in_output": False,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
}


def refuse_penalties(req: SamplingFields) -> None:
    """vLLM's detokenizing options: neutral values only."""
    for name, default in NEUTRAL.items():
        value = getattr(req, name)
        if value is not None and value != default:
            raise invalid(
                f"{name} is not supported (only {str(default).lower()})", name, "unsupported_value"
            )


class StreamOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM's: with include_usage, in every chunk
    include_obfuscation: bool | None = None  # ignored: no padding is ever sent


class SamplingFields(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The fields the chat and the text completion requests share: the model, the answer's
    length and sampling, streaming, the cache salt, and those accepted only neutral."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    logit_bias: dict[str, float] | None = None  # {"token id": bias in [-100, 100]}
    # vLLM's, honoured: top_k (0 or -1: off), ignore_eos, stop_token_ids, and cache_salt: a
    # secret string salting this request's prefix-cache blocks, so that only requests with
    # the same salt (and tenant) share them. Non-empty when given.
    top_k: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    cache_salt: str | None = None
    # Ignored: they change nothing an answer holds.
    user: str | None = None
    request_id: str | None = None  # vLLM's
    # OpenAI's penalties, and vLLM's repetition_penalty, min_tokens and min_p: honoured.
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    min_p: float | None = None
    bad_words: list[str] | None = None  # vLLM's: words the answer never writes
    # Structured output, honoured: OpenAI's response_format (json_object, json_schema) and
    # vLLM's structured_outputs and older guided_* fields; at most one of them.
    response_format: ResponseFormat | None = None
    structured_outputs: VllmStructuredOutputs | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Accepted at their neutral values only (NEUTRAL).
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None

    def shared_sampling(
        self, max_tokens: int | None, logprobs: int | None, names: dict[str, str]
    ) -> AskedSampling:
        """These fields as the one value `sampling_params` checks (each request's `sampling`
        adds its own); OpenAIError for one that is not a value at all. Nulls are defaults."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > 4:
            raise invalid("stop takes at most 4 strings", "stop")
        structured = structured_output(self)
        return AskedSampling(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None or self.top_k == -1 else self.top_k,  # vLLM's -1: off
            n=1 if self.n is None else self.n,
            seed=self.seed,
            stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=bool(self.ignore_eos),
            logprobs=logprobs,
            logit_bias=_logit_bias(self.logit_bias or {}),
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            min_p=self.min_p or 0.0,
            min_tokens=self.min_tokens or 0,
            bad_words=tuple(self.bad_words or ()),
            structured=None if structured is None else structured[0],
            names=names,
        )


Request = TypeVar("Request", bound=SamplingFields)


def decode_fields(
    body: bytes,
    kind: type[Request],
    what: str,
    served: tuple[str, ...],
    ignore_unknown: bool = False,  # --unknown-request-fields ignore
) -> Request:
    """A request of `kind` from its JSON body, its shared fields checked (the model among
    `served`, the neutral-only ones, a non-empty cache_salt); OpenAIError if not. A field no
    request has is refused, or dropped with `ignore_unknown`: NOTE (unknown fields) in
    service/api/openai/unknown_fields.py."""
    try:
        req = decode(body, kind, what, ignore_unknown)
    except msgspec.DecodeError as exc:
        raise decode_error(exc, what) from None
    except RecursionError:  # the decoder's own bound on nesting
        raise invalid(f"not a valid {what}: {nesting_message()}", None, "bad_request") from None
    if too_deep(req):  # NOTE (nesting) in service/api/nesting.py
        raise invalid(f"not a valid {what}: {nesting_message()}", None, "bad_request")
    if req.model is not None and req.model not in served:
        raise model_not_found(req.model, served)
    refuse_penalties(req)
    if req.cache_salt is not None and not req.cache_salt:
        raise invalid("cache_salt must be a non-empty string", "cache_salt")
    structured_output(req)  # its fields' shapes; the engine checks the schema or grammar
    return req


def sampling_error(exc: SamplingError) -> OpenAIError:
    """The one builder's refusal (service/api/sampling.py) in OpenAI's shape: past the
    context, vLLM's `context_length_exceeded`; else `invalid_value` naming the field."""
    if exc.kind is SamplingErrorKind.CONTEXT and exc.room is not None:
        return context_exceeded(
            exc.room.prompt_tokens,
            exc.room.max_model_len,
            exc.max_tokens or 0,
            prompt_param=exc.prompt_param,
            max_tokens_param=exc.param or "max_tokens",
        )
    return invalid(str(exc), exc.param)


def structured_output(req: SamplingFields) -> tuple[StructuredOutput, str] | None:
    """What the answer must match and the field that asked it (None: free text)."""
    try:
        from_format = from_response_format(req.response_format)
        from_vllm = from_vllm_fields(
            req.structured_outputs,
            req.guided_json,
            req.guided_regex,
            req.guided_choice,
            req.guided_grammar,
        )
    except StructuredError as exc:
        raise invalid(str(exc), exc.param) from None
    if from_format is not None and from_vllm is not None:
        raise invalid(
            f"one structured output at a time: response_format and {from_vllm[1]}", from_vllm[1]
        )
    return (from_format, "response_format") if from_format is not None else from_vllm


def _logit_bias(bias: dict[str, float]) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} as (id, bias) pairs (the vocabulary is the builder's to
    check)."""
    pairs = []
    for key, value in bias.items():
        if not key.isdecimal():
            raise invalid(f"logit_bias: {key!r} is not a token id of this model", "logit_bias")
        token = int(key)
        pairs.append((token, value))
    return tuple(sorted(pairs))
