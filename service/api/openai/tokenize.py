"""vLLM's POST /tokenize and /detokenize: a prompt's or a conversation's token ids, exactly
as an answer's prompt would hold them, and token ids back as text.

A conversation goes through the one path /v1/chat/completions renders its prompt by
(`chat_request.render_prompt`: the model's template, contents as plain text, tools in the
system message, a final assistant message continued), so an app that counts with /tokenize
counts what the answer's prompt holds. A plain `prompt` is tokenized as /v1/completions
tokenizes one: plain text, special-token strings as characters.

NOTE (limits): a prompt is at most `max_message_chars` characters, each message as in a chat
request, the body at most `--max-body-bytes`, and the token ids either way at most the
model's context (`max_model_len`, as vLLM's): more is a 400 saying so, never a partial answer.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from service.api.limits import Limits
from service.api.nesting import nesting_message, too_deep
from service.api.openai.chat_request import (
    ChatCompletionRequest,
    ChatMessageIn,
    check_template_kwargs,
    render_prompt,
)
from service.api.openai.errors import (
    context_exceeded,
    decode_error,
    invalid,
    model_not_found,
    unsupported,
)
from service.engine.values import TextTokenizer
from service.sessions.prompt import ChatFormat


class TokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's two request shapes in one: a `prompt`, or `messages` with the chat fields."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = None
    # Default: true for a prompt (BOS where the model asks for one, as /v1/completions
    # starts a raw prompt), false for messages (the template writes its own).
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = None  # the vocabulary's string of each token
    # As a chat completion reads them.
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    # As on /v1/chat/completions: variables for the model's own template (its only one).
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None
    mm_processor_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    tokens: list[int]
    model: str | None = None


R = TypeVar("R", TokenizeRequest, DetokenizeRequest)
# The fields that shape a conversation's prompt: with a plain prompt they would do nothing.
_CHAT_ONLY = (
    "add_generation_prompt",
    "continue_final_message",
    "tools",
    "tool_choice",
    "chat_template_kwargs",
    "chat_template",
    "mm_processor_kwargs",
)


def tokenize_request(
    body: bytes, served: tuple[str, ...], chat: ChatFormat, limits: Limits, max_model_len: int
) -> dict[str, Any]:
    """The answer of POST /tokenize: `count`, `max_model_len`, `tokens`, `token_strs`.
    `served`: the model names this server answers to."""
    req = _decode(body, TokenizeRequest, "tokenize request", served)
    tokenizer = chat.tokenizer
    if (req.prompt is None) == (req.messages is None):
        given = "both" if req.prompt is not None else "neither"
        raise invalid(f"a tokenize request has a prompt or messages, not {given}", None)
    if req.messages is not None:
        ids, param = _conversation(req, chat, limits, max_model_len), "messages"
    else:
        for name in _CHAT_ONLY:
            if getattr(req, name) is not None:
                raise invalid(f"{name} applies to messages, not to a prompt", name)
        plain = req.add_special_tokens is False
        ids, param = _prompt(req.prompt or "", plain, tokenizer, limits), "prompt"
    if len(ids) > max_model_len:
        raise context_exceeded(len(ids), max_model_len, prompt_param=param)
    strs = [tokenizer.id_to_token(t) or "" for t in ids] if req.return_token_strs else None
    return {
        "count": len(ids),
        "max_model_len": max_model_len,
        "tokens": ids,
        "token_strs": strs,
    }


def detokenize_request(
    body: bytes, served: tuple[str, ...], tokenizer: TextTokenizer, max_model_len: int
) -> dict[str, Any]:
    """The answer of POST /detokenize: `prompt`, the ids' text, special tokens written out."""
    req = _decode(body, DetokenizeRequest, "detokenize request", served)
    if len(req.tokens) > max_model_len:
        raise context_exceeded(len(req.tokens), max_model_len, prompt_param="tokens")
    vocab = tokenizer.vocab_size
    for i, token in enumerate(req.tokens):
        if not 0 <= token < vocab:
            raise invalid(f"tokens[{i}] is {token}: token ids are in 0..{vocab - 1}", "tokens")
    return {"prompt": tokenizer.decode(req.tokens, skip_special_tokens=False)}


def _conversation(
    req: TokenizeRequest, chat: ChatFormat, limits: Limits, max_model_len: int
) -> list[int]:
    """The conversation's prompt, as a chat completion with these fields would have it."""
    if req.mm_processor_kwargs:
        raise unsupported("mm_processor_kwargs")
    check_template_kwargs(req.chat_template_kwargs)
    if req.chat_template is not None:
        raise unsupported("chat_template", "is not supported: the model's own template is used")
    if req.continue_final_message and req.add_generation_prompt:
        raise invalid(
            "continue_final_message and add_generation_prompt cannot both be true",
            "continue_final_message",
        )
    as_chat = ChatCompletionRequest(
        messages=req.messages or [],
        tools=req.tools,
        tool_choice=req.tool_choice,
        add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message,
        chat_template_kwargs=req.chat_template_kwargs,
    )
    ids = render_prompt(as_chat, chat, limits, max_model_len)
    if req.add_special_tokens:
        bos = chat.tokenizer.encode_prompt("")  # [BOS] where the model asks for one
        if ids[: len(bos)] != bos:
            ids = [*bos, *ids]
    return ids


def _prompt(text: str, plain: bool, tokenizer: TextTokenizer, limits: Limits) -> list[int]:
    if len(text) > limits.max_message_chars:
        raise invalid(
            f"prompt has {len(text)} characters; at most {limits.max_message_chars}", "prompt"
        )
    return tokenizer.encode(text) if plain else tokenizer.encode_prompt(text)


def _decode(body: bytes, kind: type[R], what: str, served: tuple[str, ...]) -> R:
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
    return req
