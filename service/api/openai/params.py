"""OpenAI's sampling fields, shared by chat and text completions, as the engine's
SamplingParams; and the fields accepted only at the value this server always behaves as."""

from __future__ import annotations

from typing import Protocol

from service.api.limits import Limits
from service.api.openai.errors import context_exceeded, invalid
from service.api.sampling import SamplingError, SamplingErrorKind, sampling_params
from service.engine.params import SamplingParams


class NeutralFields(Protocol):
    frequency_penalty: float | None
    presence_penalty: float | None
    repetition_penalty: float | None
    min_tokens: int | None
    min_p: float | None
    include_stop_str_in_output: bool | None
    skip_special_tokens: bool | None
    spaces_between_special_tokens: bool | None


# Fields accepted at the value this server always behaves as, refused at any other.
NEUTRAL = {
    "frequency_penalty": 0,
    "presence_penalty": 0,
    "repetition_penalty": 1,
    "min_tokens": 0,
    "min_p": 0,
    "include_stop_str_in_output": False,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
}


def refuse_penalties(req: NeutralFields) -> None:
    """Penalties, min_tokens and vLLM's detokenizing options: neutral values only."""
    for name, default in NEUTRAL.items():
        value = getattr(req, name)
        if value is not None and value != default:
            raise invalid(
                f"{name} is not supported (only {str(default).lower()})", name, "unsupported_value"
            )


class SamplingFields(Protocol):
    """The sampling fields the chat and the text completion requests share."""

    temperature: float | None
    top_p: float | None
    n: int | None
    seed: int | None
    stop: str | list[str] | None
    top_k: int | None
    ignore_eos: bool | None
    stop_token_ids: list[int] | None
    logit_bias: dict[str, float] | None


def engine_params(
    req: SamplingFields,
    limits: Limits,
    prompt_tokens: int,
    max_model_len: int,
    asked: int | None,  # max_tokens as the request gives it
    default: int,  # max_tokens when it does not (cut to the room the prompt leaves)
    logprobs: int | None,  # top log-probabilities per token; None: none at all
    vocab_size: int | None = None,  # logit_bias's token ids are below it
    logprobs_param: str = "top_logprobs",  # what the request calls `logprobs`
) -> SamplingParams:
    """OpenAI's sampling fields as the engine's parameters, within the server's limits.

    An explicit max_tokens that the context cannot hold is refused (as vLLM does); the
    default is cut to what the context has left."""
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > 4:
        raise invalid("stop takes at most 4 strings", "stop")
    top_k = 0 if req.top_k is None or req.top_k == -1 else req.top_k  # vLLM's -1: off
    try:
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
        )
    except SamplingError as exc:
        if exc.kind is SamplingErrorKind.CONTEXT:
            raise context_exceeded(prompt_tokens, max_model_len, asked or 0) from None
        raise invalid(str(exc), logprobs_param if exc.param == "logprobs" else exc.param) from None


def _logit_bias(bias: dict[str, float], vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} as (id, bias) pairs, ids in the vocabulary."""
    pairs = []
    for key, value in bias.items():
        token = int(key) if key.isdecimal() else -1
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            raise invalid(f"logit_bias: {key!r} is not a token id of this model", "logit_bias")
        pairs.append((token, value))
    return tuple(sorted(pairs))
