"""A request's sampling parameters as the routes build them (service/api/openai/routes.py):
the request as one value (`sampling`), then the one builder, its refusal in OpenAI's shape."""

from __future__ import annotations

from service.api.limits import Limits
from service.api.openai.chat_request import ChatCompletionRequest
from service.api.openai.completion_request import CompletionRequest
from service.api.openai.params import sampling_error
from service.api.sampling import Room, SamplingError, sampling_params
from service.engine.params import SamplingParams
from service.engine.values import TextTokenizer


def openai_params(
    req: ChatCompletionRequest | CompletionRequest,
    limits: Limits,
    prompt_tokens: int,
    max_model_len: int,
    vocab_size: int | None = None,
    tokenizer: TextTokenizer | None = None,
) -> SamplingParams:
    if isinstance(req, ChatCompletionRequest):
        default = limits.default_max_tokens
    else:
        default = limits.default_completion_tokens
    try:
        return sampling_params(
            req.sampling(),
            limits,
            default_max_tokens=default,
            room=Room(prompt_tokens, max_model_len),
            tokenizer=tokenizer,
            vocab_size=vocab_size,
        )
    except SamplingError as exc:
        raise sampling_error(exc) from None
