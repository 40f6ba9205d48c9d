"""The /v1/chat WebSocket protocol's frames (docs/protocol.md), typed and validated by msgspec.

Every frame is an object tagged by its "type". JSON text frames by default; a client that
offers the `pagechat.msgpack` subprotocol gets the same objects as msgpack binary frames.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any

import msgspec

MSGPACK_SUBPROTOCOL = "pagechat.msgpack"


class ErrorCode(enum.StrEnum):
    BAD_FRAME = "bad_frame"  # not JSON/msgpack, wrong frame kind, or not a valid frame
    FRAME_TOO_LARGE = "frame_too_large"
    MESSAGE_TOO_LONG = "message_too_long"
    INVALID_PARAMS = "invalid_params"
    MAX_TOKENS_TOO_LARGE = "max_tokens_too_large"
    CONTEXT_LENGTH = "context_length"  # the prompt does not fit the model's context
    NO_SESSION = "no_session"  # a user frame before open/resume
    SESSION_ALREADY_OPEN = "session_already_open"
    UNKNOWN_SESSION = "unknown_session"  # never existed, or expired
    WRONG_SECRET = "wrong_secret"
    BUSY = "busy"  # the session is already answering
    OVERLOADED = "overloaded"  # too many answers queued; retry later
    TOO_MANY_CONNECTIONS = "too_many_connections"
    SHUTTING_DOWN = "shutting_down"
    UNAUTHORIZED = "unauthorized"  # API keys are on and no valid one came with open/resume
    TOO_MANY_ATTEMPTS = "too_many_attempts"  # failed too often lately; retry_after_s says when
    STORAGE_UNAVAILABLE = "storage_unavailable"  # Redis failed; nothing was saved
    INTERNAL = "internal"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # end of turn, a stop string or a stop token
    LENGTH = "length"  # max_tokens or the model's context
    CANCELLED = "cancelled"  # the client sent cancel
    SHUTDOWN = "shutdown"  # the server stopped before the answer finished
    DISCONNECTED = "disconnected"  # the client went away or stopped reading (stored, never sent)
    ERROR = "error"  # the server failed mid-answer (stored as far as it got; an error follows)


# ---------------------------------------------------------------------- client -> server


class JsonSchemaFormat(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """OpenAI's `response_format.json_schema`: the answer is a JSON value `schema` accepts."""

    name: str = "answer"  # OpenAI's required name; not used to answer
    description: str | None = None
    schema: dict[str, Any] | bool | None = None  # None: any JSON object
    strict: bool | None = None  # answers follow the schema whatever it says


class ResponseFormat(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """OpenAI's `response_format`: "text" (free), "json_object" (any JSON object) or
    "json_schema" (`json_schema.schema`)."""

    type: str
    json_schema: JsonSchemaFormat | None = None


def _about(text: str) -> msgspec.Meta:
    """A field's help: the command-line flags made from it say it (protocol/flags.py)."""
    return msgspec.Meta(description=text)


class UserParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How a `user` frame asks to be answered; the server turns it into the engine's
    SamplingParams within its limits. The terminal client's and the `pagechat` command's
    sampling flags are made from these fields (protocol/flags.py)."""

    max_tokens: Annotated[
        int | None,
        _about(
            "the answer's length, 1 to the server's --max-tokens; refused if the context cannot"
            " hold it after the prompt. Omitted: the server's default, or the room left if less"
        ),
    ] = None
    temperature: Annotated[float, _about("0 is greedy; 0..100")] = 0.7
    top_p: Annotated[float, _about("nucleus sampling, in (0, 1]")] = 0.95
    top_k: Annotated[int, _about("sample among the k likeliest; 0 disables top-k")] = 0
    seed: Annotated[int | None, _about("reproducible sampling (a 64-bit signed integer)")] = None
    stop: Annotated[
        list[str], _about("a stop string (not part of the answer); give it again for more")
    ] = msgspec.field(default_factory=list)
    ignore_eos: Annotated[
        bool, _about("keep generating past the end of the turn, to max_tokens (benchmarks)")
    ] = False
    logprobs: Annotated[int | None, _about("top log-probabilities per token, 0..20")] = None
    # Against loops (OpenAI's and vLLM's meanings): presence and frequency over the answer's
    # tokens, in [-2, 2]; repetition over the prompt's and the answer's, in (0, 2], 1 none.
    presence_penalty: Annotated[
        float, _about("[-2, 2]: minus this on a token's logit once it has come")
    ] = 0.0
    frequency_penalty: Annotated[
        float, _about("[-2, 2]: minus this on a token's logit per time it has come")
    ] = 0.0
    repetition_penalty: Annotated[
        float,
        _about(
            "(0, 2], 1 none: a seen token's positive logit divided by it, a negative one"
            " multiplied (1.3 stops the bundled model's loops)"
        ),
    ] = 1.0
    min_p: Annotated[
        float, _about("[0, 1]: drop tokens less likely than min_p times the likeliest")
    ] = 0.0
    min_tokens: Annotated[int, _about("no end of turn or stop string before this many tokens")] = 0
    bad_words: Annotated[
        list[str], _about("a word the answer never writes (vLLM's); give it again for more")
    ] = msgspec.field(default_factory=list)
    response_format: Annotated[
        ResponseFormat | None, _about("the answer as JSON (OpenAI's field)")
    ] = None


class _ClientFrame(msgspec.Struct, tag_field="type", kw_only=True, forbid_unknown_fields=True):
    pass


# omit_defaults: a frame without a key encodes as before keys, for servers of that time.
class Open(_ClientFrame, tag="open", omit_defaults=True):
    system: str | None = None  # None: the model's default system prompt
    api_key: str | None = None  # for browsers; others may send `Authorization: Bearer`


class Resume(_ClientFrame, tag="resume", omit_defaults=True):
    session_id: str
    secret: str
    api_key: str | None = None  # as in Open


class User(_ClientFrame, tag="user"):
    content: str
    params: UserParams = msgspec.field(default_factory=UserParams)


class Cancel(_ClientFrame, tag="cancel"):
    pass


ClientFrame = Open | Resume | User | Cancel

# ---------------------------------------------------------------------- server -> client


class ChatMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str
    content: str
    finish_reason: str | None = None


class _ServerFrame(msgspec.Struct, tag_field="type", kw_only=True):
    pass


class SessionOpened(_ServerFrame, tag="session"):
    session_id: str
    resumed: bool
    system: str | None
    messages: list[ChatMessage]  # the conversation so far (resume)
    history_tokens: int  # token ids stored for it (the next prompt's prefix)
    secret: str | None = None  # only when the session is created: keep it to resume


class Delta(_ServerFrame, tag="delta", omit_defaults=True):
    text: str
    token_ids: list[int]
    # Per token: [chosen, top 1, top 2, ...] as [token id, log-probability] pairs.
    logprobs: list[list[tuple[int, float]]] | None = None


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    cached_tokens: int  # found on the device (prefix cache)
    swapped_in_tokens: int  # brought back from the CPU pool
    loaded_tokens: int = 0  # loaded from the third tier (a restart, another replica)
    recomputed_tokens: int  # the rest of the prompt, computed for this turn
    completion_tokens: int


class Timing(msgspec.Struct, kw_only=True):
    queue_s: float | None  # message received -> first scheduled by the engine
    ttft_s: float | None  # message received -> first token
    total_s: float  # message received -> answer finished and stored


class Done(_ServerFrame, tag="done"):
    turn: int
    finish_reason: FinishReason
    usage: Usage
    timing: Timing


class Error(_ServerFrame, tag="error", omit_defaults=True):
    code: ErrorCode
    message: str
    fatal: bool  # the server closes the connection after a fatal error
    retry_after_s: float | None = None  # too_many_attempts: seconds until a retry is heard
    limit: int | None = None  # message_too_long: the most characters the message may have


ServerFrame = SessionOpened | Delta | Done | Error


class FrameError(Exception):
    """A frame the server refuses; becomes an error frame."""

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        *,
        fatal: bool = False,
        retry_after_s: float | None = None,
        limit: int | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.fatal = fatal
        self.retry_after_s = retry_after_s
        self.limit = limit

    def frame(self) -> Error:
        return Error(
            code=self.code,
            message=self.message,
            fatal=self.fatal,
            retry_after_s=self.retry_after_s,
            limit=self.limit,
        )


class Codec:
    """Frames <-> WebSocket payloads for one connection's format (JSON text or msgpack)."""

    def __init__(self, *, binary: bool) -> None:
        self.binary = binary
        self._msgpack = msgspec.msgpack.Decoder(ClientFrame)
        self._json = msgspec.json.Decoder(ClientFrame)
        self._encoder: msgspec.msgpack.Encoder | msgspec.json.Encoder = (
            msgspec.msgpack.Encoder() if binary else msgspec.json.Encoder()
        )

    def decode(self, text: str | None, data: bytes | None, max_bytes: int) -> ClientFrame:
        payload: str | bytes | None = data if self.binary else text
        if payload is None:
            want, got = ("binary", "text") if self.binary else ("text", "binary")
            raise FrameError(ErrorCode.BAD_FRAME, f"expected a {want} frame, got a {got} frame")
        size = _size(payload, max_bytes)
        if size > max_bytes:
            raise FrameError(
                ErrorCode.FRAME_TOO_LARGE, f"the frame has {size} bytes; the limit is {max_bytes}"
            )
        try:
            if isinstance(payload, bytes):
                return self._msgpack.decode(payload)
            return self._json.decode(payload)
        except msgspec.DecodeError as exc:
            raise FrameError(ErrorCode.BAD_FRAME, f"invalid frame: {exc}") from None
        except RecursionError:  # the decoder's own bound on nesting
            raise FrameError(ErrorCode.BAD_FRAME, "invalid frame: it nests too deeply") from None

    def encode(self, frame: ServerFrame) -> dict[str, str | bytes]:
        """The ASGI `websocket.send` message for `frame`."""
        payload = self._encoder.encode(frame)
        if self.binary:
            return {"type": "websocket.send", "bytes": payload}
        return {"type": "websocket.send", "text": payload.decode()}


def _size(payload: str | bytes, max_bytes: int) -> int:
    """The payload's size in bytes, exact whenever it could exceed `max_bytes`."""
    if isinstance(payload, bytes) or len(payload) * 4 <= max_bytes:
        return len(payload)  # a str this short is within the limit even at 4 bytes a char
    return len(payload.encode())
