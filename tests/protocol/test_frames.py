"""The wire frames (protocol/frames.py): validation, both encodings, and the size limit."""

from __future__ import annotations

import msgspec
import pytest

from protocol.frames import (
    Cancel,
    Codec,
    Delta,
    Done,
    ErrorCode,
    FinishReason,
    FrameError,
    Open,
    Resume,
    ServerFrame,
    Timing,
    Usage,
    User,
    UserParams,
)

LIMIT = 1024


@pytest.fixture(params=[False, True], ids=["json", "msgpack"])
def codec(request: pytest.FixtureRequest) -> Codec:
    return Codec(binary=request.param)


def payload(codec: Codec, obj: object) -> tuple[str | None, bytes | None]:
    if codec.binary:
        return None, msgspec.msgpack.encode(obj)
    return msgspec.json.encode(obj).decode(), None


@pytest.mark.parametrize(
    ("obj", "frame"),
    [
        ({"type": "open"}, Open()),
        ({"type": "open", "system": "Be brief."}, Open(system="Be brief.")),
        ({"type": "resume", "session_id": "abc", "secret": "s"}, Resume("abc", "s")),
        ({"type": "user", "content": "hi"}, User(content="hi")),
        (
            {"type": "user", "content": "hi", "params": {"max_tokens": 5, "temperature": 0}},
            User(content="hi", params=UserParams(max_tokens=5, temperature=0.0)),
        ),
        ({"type": "cancel"}, Cancel()),
    ],
)
def test_client_frames_decode_in_both_encodings(codec: Codec, obj: object, frame: object) -> None:
    assert codec.decode(*payload(codec, obj), LIMIT) == frame


@pytest.mark.parametrize(
    "obj",
    [
        {"type": "teleport"},
        {"content": "no type"},
        {"type": "user"},  # content missing
        {"type": "user", "content": 5},
        {"type": "open", "colour": "red"},  # unknown field
        {"type": "user", "content": "x", "params": {"n": 2}},  # not a chat parameter
        ["type", "open"],
    ],
)
def test_invalid_frames_are_bad_frames(codec: Codec, obj: object) -> None:
    with pytest.raises(FrameError) as error:
        codec.decode(*payload(codec, obj), LIMIT)
    assert error.value.code is ErrorCode.BAD_FRAME and not error.value.fatal


def test_malformed_payloads_and_the_wrong_frame_kind_are_bad_frames() -> None:
    json, binary = Codec(binary=False), Codec(binary=True)
    for codec, text, data in [
        (json, "{not json", None),
        (json, None, b'{"type": "open"}'),  # binary frame on a JSON connection
        (binary, '{"type": "open"}', None),  # text frame on a msgpack connection
        (binary, None, b"\xc1"),  # never valid msgpack
    ]:
        with pytest.raises(FrameError) as error:
            codec.decode(text, data, LIMIT)
        assert error.value.code is ErrorCode.BAD_FRAME


def test_frames_over_the_limit_are_refused_by_their_utf8_size() -> None:
    codec = Codec(binary=False)
    fits = '{"type": "user", "content": "' + "é" * 400 + '"}'  # 400 chars, 800 bytes
    assert isinstance(codec.decode(fits, None, LIMIT), User)
    over = '{"type": "user", "content": "' + "é" * 600 + '"}'  # 600 chars, 1200 bytes
    with pytest.raises(FrameError) as error:
        codec.decode(over, None, LIMIT)
    assert error.value.code is ErrorCode.FRAME_TOO_LARGE


def test_server_frames_round_trip_and_deltas_omit_absent_logprobs(codec: Codec) -> None:
    done = Done(
        turn=3,
        finish_reason=FinishReason.STOP,
        usage=Usage(
            prompt_tokens=10,
            cached_tokens=4,
            swapped_in_tokens=2,
            recomputed_tokens=4,
            completion_tokens=5,
        ),
        timing=Timing(queue_s=0.01, ttft_s=0.1, total_s=0.5),
    )
    for frame in (
        done,
        Delta(text="hi", token_ids=[1]),
        Delta(text="", token_ids=[2], logprobs=[[(2, -0.1)]]),
    ):
        message = codec.encode(frame)
        raw = message["bytes"] if codec.binary else message["text"]
        decode = msgspec.msgpack.decode if codec.binary else msgspec.json.decode
        assert decode(raw, type=ServerFrame) == frame
    text = Codec(binary=False).encode(Delta(text="hi", token_ids=[1]))["text"]
    assert text == '{"type":"delta","text":"hi","token_ids":[1]}'
