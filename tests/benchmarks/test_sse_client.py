"""Tests for `benchmarks/sse_client.py`: server-sent events cut from arbitrary pieces, and a
streamed chat completion's chunks read into one timed answer."""

from __future__ import annotations

import json

import pytest

from benchmarks.sse_client import SSEParser, StreamError, StreamResult

STREAM = (
    b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
    b'"finish_reason":null}]}\n\n'
    b'data: {"choices":[{"index":0,"delta":{"content":"Hel"},"finish_reason":null}]}\n\n'
    b": a comment line, ignored\n\n"
    b'data: {"choices":[{"index":0,"delta":{"content":"lo"},"finish_reason":"length"}]}\n\n'
    b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":2}}\n\n'
    b"data: [DONE]\n\n"
)


def events_of(pieces: list[bytes]) -> list[str]:
    parser = SSEParser()
    return [data for piece in pieces for data in parser.feed(piece)]


def test_events_are_the_same_however_the_bytes_are_cut() -> None:
    whole = events_of([STREAM])
    assert len(whole) == 5 and whole[-1] == "[DONE]"
    assert events_of([STREAM[i : i + 1] for i in range(len(STREAM))]) == whole
    assert events_of([STREAM[:37], STREAM[37:38], STREAM[38:]]) == whole


def test_a_partial_event_waits_for_its_blank_line() -> None:
    parser = SSEParser()
    assert parser.feed(b"data: [DO") == []
    assert parser.feed(b"NE]\n") == []
    assert parser.feed(b"\n") == ["[DONE]"]


def test_crlf_line_ends_and_multi_line_data_follow_the_sse_rules() -> None:
    assert events_of([b"data: a\r\ndata:b\r\nid: 3\r\n\r\nevent: x\r\n\r\n"]) == ["a\nb"]


def test_chunks_add_up_to_the_text_its_first_arrival_and_the_usage() -> None:
    result = StreamResult(sent_at=10.0)
    done = [result.take(data, 10.0 + i) for i, data in enumerate(events_of([STREAM]))]
    assert done == [False, False, False, False, True]
    assert result.text == "Hello"
    assert result.content_chunks == 2
    assert result.ttft_s == pytest.approx(1.0)  # the first chunk with text, not the role's
    assert result.done_at == 14.0
    assert result.finish_reason == "length"
    assert (result.prompt_tokens, result.completion_tokens) == (7, 2)


def test_an_error_event_fails_the_stream() -> None:
    result = StreamResult(sent_at=0.0)
    with pytest.raises(StreamError, match="overloaded"):
        result.take(json.dumps({"error": {"message": "overloaded"}}), 1.0)


def test_a_stream_without_text_has_no_time_to_first_token() -> None:
    with pytest.raises(StreamError):
        _ = StreamResult(sent_at=0.0).ttft_s
