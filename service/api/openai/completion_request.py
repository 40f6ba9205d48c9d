"""OpenAI's (legacy) text completion request, /v1/completions: a prompt in, text out.

The prompt is a string, or token ids, or a list holding one of those; it is tokenized as
plain text (no chat template, no special tokens). Nulls mean the default, as for chat
(service.api.openai.chat_request); `echo`, `suffix` and `best_of` other than `n` are refused.
"""

from __future__ import annotations

from service.api.limits import Limits
from service.api.openai.errors import (
    invalid,
    unsupported,
)
from service.api.openai.params import SamplingFields, decode_fields
from service.api.sampling import AskedSampling
from service.engine.values import TextTokenizer

MAX_LOGPROBS = 20

# A string, token ids, or a list of prompts (msgspec takes one list type in a union).
Prompt = str | list[str | int | list[int]]


class CompletionRequest(SamplingFields, kw_only=True, forbid_unknown_fields=True):
    prompt: Prompt
    logprobs: int | None = None  # this many top log-probabilities per token
    # Accepted at their neutral values only.
    best_of: int | None = None  # only n
    echo: bool | None = None  # only false
    suffix: str | None = None  # only null

    def sampling(self) -> AskedSampling:
        """This request's sampling fields as the one value the builder checks
        (`service.api.sampling.sampling_params`)."""
        return self.shared_sampling(self.max_tokens, self.logprobs, {"prompt": "prompt"})


def decode_completion_request(
    body: bytes, served: tuple[str, ...], ignore_unknown: bool = False
) -> CompletionRequest:
    req = decode_fields(body, CompletionRequest, "completion request", served, ignore_unknown)
    if req.echo:
        raise invalid("echo is not supported (only false)", "echo", "unsupported_value")
    if req.suffix is not None:
        raise unsupported("suffix")
    if req.best_of is not None and req.best_of != (req.n or 1):
        raise invalid("best_of is not supported (only equal to n)", "best_of", "unsupported_value")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise invalid(f"logprobs must be in 0..{MAX_LOGPROBS}", "logprobs")
    return req


def completion_prompt(
    req: CompletionRequest, tokenizer: TextTokenizer, limits: Limits
) -> list[int]:
    """The prompt's token ids: a string tokenized as plain text (after BOS where the model
    asks for one), or the ids as given."""
    prompt: str | int | list[str | int | list[int]] | list[int] = req.prompt
    if isinstance(prompt, list) and any(not isinstance(p, int) for p in prompt):
        if len(prompt) != 1:
            raise invalid("prompt may hold one prompt only (send one request each)", "prompt")
        (prompt,) = prompt
    if isinstance(prompt, int):
        raise invalid("prompt is a string, token ids, or a list of one of those", "prompt")
    if isinstance(prompt, str):
        if len(prompt) > limits.max_message_chars:
            raise invalid(
                f"prompt has {len(prompt)} characters; at most {limits.max_message_chars}",
                "prompt",
            )
        ids = tokenizer.encode_prompt(prompt)
    else:
        ids = [t for t in prompt if isinstance(t, int)]
        if len(ids) != len(prompt) or any(not 0 <= t < tokenizer.vocab_size for t in ids):
            raise invalid(f"prompt token ids must be in 0..{tokenizer.vocab_size - 1}", "prompt")
    if not ids:
        raise invalid("prompt must not be empty", "prompt")
    return ids
