"""service/api/sampling.py: a request's sampling fields as one value, and the one builder that
checks it against the limits and the room the prompt leaves (NOTE (room))."""

from __future__ import annotations

import pytest

from protocol.frames import JsonSchemaFormat, ResponseFormat, UserParams
from service.api.limits import Limits
from service.api.sampling import (
    MAX_BAD_WORDS,
    AskedSampling,
    Room,
    SamplingError,
    SamplingErrorKind,
    bad_word_ids,
    sampling_params,
    user_sampling,
)
from service.engine.params import SamplingParams, StructuredOutput


class Words:
    """A tokenizer of a few words: one id per space-separated piece, a leading space kept."""

    vocab_size = 100

    def encode(self, text: str) -> list[int]:
        return [sum(map(ord, piece)) % self.vocab_size for piece in text.split(" ") if piece] + (
            [99] if text.startswith(" ") else []
        )


def build(asked: AskedSampling, room: Room | None = None, **limits: int) -> SamplingParams:
    return sampling_params(asked, Limits(**limits), default_max_tokens=512, room=room)


def refused(asked: AskedSampling, room: Room | None = None, **limits: int) -> SamplingError:
    with pytest.raises(SamplingError) as caught:
        build(asked, room, **limits)
    return caught.value


def test_no_max_tokens_is_the_default_cut_to_the_room_left() -> None:
    assert build(AskedSampling()).max_tokens == 512
    assert build(AskedSampling(), Room(100, 2048)).max_tokens == 512
    assert build(AskedSampling(), Room(2000, 2048)).max_tokens == 48
    assert build(AskedSampling(), Room(2047, 2048)).max_tokens == 1


def test_an_explicit_max_tokens_past_the_room_is_refused_never_shortened() -> None:
    assert build(AskedSampling(max_tokens=48), Room(2000, 2048)).max_tokens == 48
    error = refused(AskedSampling(max_tokens=49), Room(2000, 2048))
    assert error.kind is SamplingErrorKind.CONTEXT and error.param == "max_tokens"
    assert (error.room, error.max_tokens) == (Room(2000, 2048), 49)
    assert "room for 48" in str(error) and "omit max_tokens" in str(error)


def test_a_prompt_that_fills_the_context_is_refused_whatever_is_asked() -> None:
    for asked in (AskedSampling(), AskedSampling(max_tokens=1)):
        error = refused(asked, Room(2048, 2048))
        assert error.kind is SamplingErrorKind.CONTEXT
        assert (error.param, error.max_tokens) == ("prompt", None)


def test_errors_name_the_field_as_the_request_calls_it() -> None:
    names = {"max_tokens": "max_completion_tokens", "prompt": "messages"}
    error = refused(AskedSampling(max_tokens=100, names=names), Room(2000, 2048))
    assert (error.param, error.prompt_param) == ("max_completion_tokens", "messages")
    error = refused(AskedSampling(names=names), Room(2048, 2048))
    assert error.param == "messages" and "the messages has 2048 tokens" in str(error)
    error = refused(AskedSampling(logprobs=21, names={"logprobs": "top_logprobs"}))
    assert error.param == "top_logprobs"


def test_max_tokens_under_one_or_over_the_limit_is_refused_by_kind() -> None:
    zero = refused(AskedSampling(max_tokens=0))
    assert (zero.kind, zero.param) == (SamplingErrorKind.INVALID, "max_tokens")
    over = refused(AskedSampling(max_tokens=2049), max_tokens=2048)
    assert over.kind is SamplingErrorKind.OVER_LIMIT
    assert build(AskedSampling(max_tokens=2048), max_tokens=2048).max_tokens == 2048


def test_without_a_room_all_but_the_room_is_checked() -> None:
    """The WebSocket checks a frame before its prompt is known; the turn checks the room."""
    assert build(AskedSampling(max_tokens=2000)).max_tokens == 2000
    assert refused(AskedSampling(top_p=0)).param == "top_p"


def test_each_field_reaches_the_engine_unchanged() -> None:
    schema = StructuredOutput(kind="regex", spec="a+")
    asked = AskedSampling(
        max_tokens=7, temperature=0.5, top_p=0.9, top_k=3, n=2, seed=11, stop=("x",),
        stop_token_ids=(5,), ignore_eos=True, logprobs=2, logit_bias=((4, 1.5),),
        presence_penalty=0.1, frequency_penalty=0.2, repetition_penalty=1.1, min_p=0.05,
        min_tokens=1, structured=schema,
    )  # fmt: skip
    assert build(asked) == SamplingParams(
        max_tokens=7, temperature=0.5, top_p=0.9, top_k=3, n=2, seed=11, stop=("x",),
        stop_token_ids=(5,), ignore_eos=True, logprobs=2, logit_bias=((4, 1.5),),
        presence_penalty=0.1, frequency_penalty=0.2, repetition_penalty=1.1, min_p=0.05,
        min_tokens=1, structured=schema,
    )  # fmt: skip


def test_every_field_but_the_names_is_one_of_the_engines() -> None:
    asked = set(AskedSampling.__struct_fields__) - {"names"}
    assert asked == set(SamplingParams.__struct_fields__)


def test_token_ids_must_be_in_the_vocabulary() -> None:
    def limits_check(asked: AskedSampling) -> SamplingParams:
        return sampling_params(asked, Limits(), default_max_tokens=16, vocab_size=8)

    assert limits_check(AskedSampling(stop_token_ids=(7,), logit_bias=((7, 1.0),)))
    for asked, param in [
        (AskedSampling(stop_token_ids=(8,)), "stop_token_ids"),
        (AskedSampling(logit_bias=((8, 1.0),)), "logit_bias"),
    ]:
        with pytest.raises(SamplingError) as caught:
            limits_check(asked)
        assert caught.value.param == param


def test_bad_words_are_tokenized_at_a_texts_start_and_after_a_space() -> None:
    words = Words()
    ids = bad_word_ids(["ab", " ab"], words)
    assert set(ids) == {tuple(words.encode("ab")), tuple(words.encode(" ab"))}
    asked = AskedSampling(bad_words=("ab",))
    params = sampling_params(asked, Limits(), default_max_tokens=16, tokenizer=words)
    assert set(params.bad_words) == set(ids)
    with pytest.raises(SamplingError):
        bad_word_ids(["  "], words)
    with pytest.raises(SamplingError):
        bad_word_ids(["w"] * (MAX_BAD_WORDS + 1), words)
    with pytest.raises(SamplingError) as caught:  # checked before any tokenizer is at hand
        build(AskedSampling(bad_words=("ok", " ")))
    assert caught.value.param == "bad_words"


def test_a_user_frames_params_become_one_value_with_the_protocols_defaults() -> None:
    asked = user_sampling(UserParams(stop=["END"], bad_words=["x"], seed=3))
    assert (asked.temperature, asked.top_p, asked.max_tokens) == (0.7, 0.95, None)
    assert (asked.stop, asked.bad_words, asked.seed) == (("END",), ("x",), 3)
    schema = JsonSchemaFormat(name="a", schema={"type": "object"})
    fmt = ResponseFormat(type="json_schema", json_schema=schema)
    assert user_sampling(UserParams(response_format=fmt)).structured == StructuredOutput(
        kind="json", spec='{"type":"object"}'
    )
    with pytest.raises(SamplingError) as caught:
        user_sampling(UserParams(response_format=ResponseFormat(type="xml")))
    assert caught.value.param == "params.response_format"
