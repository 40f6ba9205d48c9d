"""How a text completion request (/v1/completions) becomes a prompt and sampling parameters."""

from __future__ import annotations

import json
from typing import Any

import pytest

from service.api.limits import Limits
from service.api.openai.completion_request import (
    CompletionRequest,
    completion_prompt,
    decode_completion_request,
)
from service.api.openai.errors import OpenAIError
from tests.api.openai.two_hops import openai_params
from tests.tiny_model import gguf_tokenizer

SERVED = ("smol",)


def decode(**body: Any) -> CompletionRequest:
    return decode_completion_request(json.dumps({"prompt": "Once upon", **body}).encode(), SERVED)


def test_the_default_answer_length_is_configurable_and_clamped_to_the_room_left() -> None:
    limits = Limits(default_completion_tokens=40)
    assert openai_params(decode(), limits, 5, 2048).max_tokens == 40
    assert openai_params(decode(), limits, 2040, 2048).max_tokens == 8


def test_a_string_prompt_is_plain_text_and_ids_or_a_list_of_one_work_too() -> None:
    tokenizer = gguf_tokenizer()
    ids = tokenizer.encode("Once upon <|im_start|>")
    for prompt in ("Once upon <|im_start|>", ["Once upon <|im_start|>"], ids, [ids]):
        req = decode(prompt=prompt)
        assert completion_prompt(req, tokenizer, Limits()) == ids


def test_nulls_mean_defaults_and_the_default_answer_is_short() -> None:
    nulls = dict.fromkeys(f for f in CompletionRequest.__struct_fields__ if f != "prompt")
    params = openai_params(decode(**nulls), Limits(), 5, 2048)
    assert params == openai_params(decode(), Limits(), 5, 2048)
    assert params.max_tokens == Limits().default_completion_tokens == 16
    assert params.logprobs is None
    assert openai_params(decode(logprobs=3), Limits(), 5, 2048).logprobs == 3
    assert openai_params(decode(best_of=2, n=2), Limits(), 5, 2048).n == 2


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": [10**9]}, "prompt"),
    ],
)
def test_prompts_that_cannot_be_served_are_refused(body: dict[str, Any], param: str) -> None:
    with pytest.raises(OpenAIError) as caught:
        completion_prompt(decode(**body), gguf_tokenizer(), Limits())
    assert caught.value.param == param


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"echo": True}, "echo"),
        ({"suffix": "end"}, "suffix"),
        ({"best_of": 3}, "best_of"),
        ({"logprobs": 21}, "logprobs"),
        ({"model": "other"}, "model"),
        ({"messages": []}, "messages"),
    ],
)
def test_what_cannot_be_honoured_is_refused_by_name(body: dict[str, Any], param: str) -> None:
    with pytest.raises(OpenAIError) as caught:
        decode(**body)
    assert caught.value.param == param


def test_max_tokens_beyond_the_context_is_refused() -> None:
    with pytest.raises(OpenAIError) as caught:
        openai_params(decode(max_tokens=100), Limits(), 2000, 2048)
    assert caught.value.code == "context_length_exceeded"
    assert openai_params(decode(), Limits(), 2040, 2048).max_tokens == 8


def test_a_prompt_over_the_context_is_named_prompt_not_messages() -> None:
    with pytest.raises(OpenAIError) as caught:
        openai_params(decode(), Limits(), 2048, 2048)
    assert (caught.value.code, caught.value.param) == ("context_length_exceeded", "prompt")
    assert "the prompt" in caught.value.message


def test_stop_token_ids_outside_the_vocabulary_are_refused() -> None:
    vocab = gguf_tokenizer().vocab_size
    with pytest.raises(OpenAIError) as caught:
        openai_params(decode(stop_token_ids=[vocab]), Limits(), 10, 2048, vocab)
    assert (caught.value.code, caught.value.param) == ("invalid_value", "stop_token_ids")
    ok = openai_params(decode(stop_token_ids=[vocab - 1]), Limits(), 10, 2048, vocab)
    assert ok.stop_token_ids == (vocab - 1,)
