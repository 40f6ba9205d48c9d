"""OpenAI's sampling fields, shared by chat and text completions, as the engine's
SamplingParams; and the fields accepted only at the value this server always behaves as."""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from protocol.frames import ResponseFormat
from service.api.limits import Limits
from service.api.nesting import nesting_message, too_deep
from service.api.openai.errors import context_exceeded, decode_error, invalid, model_not_found
from service.api.sampling import SamplingError, SamplingErrorKind, bad_word_ids, sampling_params
from service.api.structured import (
    StructuredError,
    StructuredOutputs,
    from_response_format,
    from_vllm_fields,
)
from service.engine.params import SamplingParams, StructuredOutput
from service.engine.values import TextTokenizer

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
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Accepted at their neutral values only (NEUTRAL).
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None


Request = TypeVar("Request", bound=SamplingFields)


def decode_fields(body: bytes, kind: type[Request], what: str, served: tuple[str, ...]) -> Request:
    """A request of `kind` from its JSON body, its shared fields checked (the model among
    `served`, the neutral-only ones, a non-empty cache_salt); OpenAIError if not."""
    try:
        req = msgspec.json.decode(body, type=kind)
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


def engine_params(
    req: SamplingFields,
    limits: Limits,
    prompt_tokens: int,
    max_model_len: int,
    asked: int | None,  # max_tokens as the request gives it
    default: int,  # max_tokens when it does not (cut to the room the prompt leaves)
    logprobs: int | None,  # top log-probabilities per token; None: none at all
    vocab_size: int | None = None,  # logit_bias's and stop_token_ids' ids are below it
    logprobs_param: str = "top_logprobs",  # what the request calls `logprobs`
    prompt_param: str = "messages",  # what the request calls its prompt
    max_tokens_param: str = "max_tokens",  # what the request called `asked`
    tokenizer: TextTokenizer | None = None,  # bad_words are tokenized with it
) -> SamplingParams:
    """OpenAI's sampling fields as the engine's parameters, within the server's limits.

    A prompt that fills the context, or an explicit max_tokens that the context cannot hold,
    is refused (as vLLM does); the default is cut to what the context has left."""
    if prompt_tokens >= max_model_len:  # no room for one answer token
        raise context_exceeded(prompt_tokens, max_model_len, prompt_param=prompt_param)
    stop_ids = req.stop_token_ids or []
    if vocab_size is not None and any(not 0 <= t < vocab_size for t in stop_ids):
        raise invalid(f"stop_token_ids must be in 0..{vocab_size - 1}", "stop_token_ids")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > 4:
        raise invalid("stop takes at most 4 strings", "stop")
    top_k = 0 if req.top_k is None or req.top_k == -1 else req.top_k  # vLLM's -1: off
    structured = structured_output(req)
    try:
        bad_words = bad_word_ids(req.bad_words or (), tokenizer) if tokenizer else ()
        return sampling_params(
            limits,
            max_tokens=asked,
            default_max_tokens=default,
            room=max_model_len - prompt_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=top_k,
            n=1 if req.n is None else req.n,
            seed=req.seed,
            stop=tuple(stop),
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=bool(req.ignore_eos),
            logprobs=logprobs,
            logit_bias=_logit_bias(req.logit_bias or {}, vocab_size),
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            min_p=req.min_p or 0.0,
            min_tokens=req.min_tokens or 0,
            bad_words=bad_words,
            structured=None if structured is None else structured[0],
        )
    except SamplingError as exc:
        if exc.kind is SamplingErrorKind.CONTEXT:
            raise context_exceeded(
                prompt_tokens, max_model_len, asked or 0, prompt_param=prompt_param,
                max_tokens_param=max_tokens_param,
            ) from None  # fmt: skip
        renamed = {"logprobs": logprobs_param, "max_tokens": max_tokens_param}
        raise invalid(str(exc), renamed.get(exc.param or "", exc.param)) from None


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


def _logit_bias(bias: dict[str, float], vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} as (id, bias) pairs, ids in the vocabulary."""
    pairs = []
    for key, value in bias.items():
        token = int(key) if key.isdecimal() else -1
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            raise invalid(f"logit_bias: {key!r} is not a token id of this model", "logit_bias")
        pairs.append((token, value))
    return tuple(sorted(pairs))
