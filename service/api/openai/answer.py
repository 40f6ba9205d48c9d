"""One OpenAI answer, chat or text, whole or streamed: the engine's outputs as OpenAI's JSON
(choices, usage, log-probabilities) or as its server-sent events, and the answer's metrics."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from starlette.responses import Response

from service.api.observability.meter import AnswerMeter
from service.api.observability.metrics import Metrics
from service.api.openai.chat_request import ChatCompletionRequest, request_tools
from service.api.openai.completion_request import CompletionRequest
from service.api.openai.errors import OpenAIError, invalid
from service.api.openai.params import StreamOptions, structured_output
from service.api.openai.reasoning import ReasoningStream, opened_by_prompt, split, thinks
from service.api.openai.tools import CallStream, Tools, read_calls
from service.engine.params import SamplingParams
from service.engine.serving import ServingEngine
from service.engine.values import (
    CacheScope,
    EngineDeadError,
    FinishReason,
    RequestError,
    RequestOutput,
)

AnyRequest = ChatCompletionRequest | CompletionRequest

_json = msgspec.json.Encoder()


class Answer:
    """One request's answer, streamed as chunks or gathered whole."""

    def __init__(
        self,
        engine: ServingEngine,
        metrics: Metrics,
        release: Callable[[], None],  # gives its in-flight slot back
        req: AnyRequest,
        prompt: list[int],
        params: SamplingParams,
        received: float,  # time.monotonic() when the request arrived
        scope: CacheScope | None,
        model: str,
    ) -> None:
        self.engine = engine
        self._release = release
        self.scope = scope
        self.req = req
        self.prompt = prompt
        self.params = params
        self.chat = isinstance(req, ChatCompletionRequest)  # else a text completion
        # The tools an answer may call: it is read for calls (None: plain text).
        self.tools: Tools | None = None
        if isinstance(req, ChatCompletionRequest) and (tools := request_tools(req)).active:
            self.tools = tools
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.tokenizer = engine.tokenizer
        # A thinking model's chat answers: the text inside <think>...</think> apart, as
        # reasoning_content (reasoning.py); None: all of an answer is content.
        self.thinking: bool | None = None
        if self.chat and thinks(self.tokenizer):
            self.thinking = opened_by_prompt(self.tokenizer, prompt)
        # The ids that end an answer without being part of its text (eos, <|im_end|>,
        # stop_token_ids): the one that ends it gets no log-probability entry, as in OpenAI's.
        ends = () if params.ignore_eos else self.tokenizer.eos_token_ids
        self._stop_ids = frozenset((*params.stop_token_ids, *ends))
        # Filled as outputs arrive.
        self.last: RequestOutput | None = None
        self.completion_tokens = 0
        self.meter = AnswerMeter(metrics, received)
        self._reasons: list[str] = []  # finish reason of each sample that finished
        self._offsets = [0] * params.n  # each text choice's length so far (text_offset)
        self._closed = False

    def close(self) -> None:
        """Release the in-flight slot and count the answer (once, however it ended)."""
        if self._closed:
            return
        self._closed = True
        self._release()
        # Samples that did not finish: the client left, or the engine failed, first.
        unfinished = ["disconnected"] * (self.params.n - len(self._reasons))
        self.meter.end([*self._reasons, *unfinished])

    def _outputs(self) -> AsyncIterator[RequestOutput]:
        return self.engine.generate(
            self.prompt, self.params, request_id=f"http:{self.id}/0", cache_scope=self.scope
        )

    def usage(self) -> dict[str, Any]:
        last = self.last
        cached = (
            last.num_cached_tokens + last.num_swapped_in_tokens + last.num_loaded_tokens
            if last
            else 0
        )
        return {
            "prompt_tokens": len(self.prompt),
            "completion_tokens": self.completion_tokens,
            "total_tokens": len(self.prompt) + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    async def whole(self) -> Response:
        texts = [""] * self.params.n
        reasons: list[str | None] = [None] * self.params.n
        logprobs: list[list[dict[str, Any]]] = [[] for _ in range(self.params.n)]
        try:
            async with contextlib.aclosing(self._outputs()) as outputs:  # type: ignore[type-var]
                async for out in outputs:
                    self._count(out)
                    texts[out.index] += out.new_text
                    logprobs[out.index] += self._logprobs(out)
                    if out.finish_reason is FinishReason.ERROR:
                        return self._broken(out).response()  # the other samples abort
                    if out.finished:
                        reasons[out.index] = _finish(out.finish_reason)
        except (RequestError, EngineDeadError) as exc:
            return _failure(exc, self.chat).response()
        splits = [None if self.thinking is None else split(t, self.thinking) for t in texts]
        choices = [
            self._choice(
                i, text if s is None else s.content, logprobs[i], reasons[i] or "stop", whole=True
            )
            for i, (text, s) in enumerate(zip(texts, splits, strict=True))
        ]
        for choice, s in zip(choices, splits, strict=True):
            if s is not None and s.reasoning is not None:
                choice["message"]["reasoning_content"] = s.reasoning
        if self.tools is not None:
            for choice in choices:
                self._with_calls(choice, self.tools)
        body = {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(),
        }
        return Response(_json.encode(body), media_type="application/json")

    async def events(self) -> AsyncIterator[bytes]:
        """SSE events: (chat) a role delta per choice, then text deltas, finish reasons, the
        usage if asked for, [DONE]. With vLLM's continuous_usage_stats every chunk carries
        the usage so far too."""
        options = self.req.stream_options or StreamOptions()
        final_usage = bool(options.include_usage)
        every_chunk = final_usage and bool(options.continuous_usage_stats)
        for i in range(self.params.n if self.chat else 0):
            role = {"role": "assistant", "content": ""}
            choice = {"index": i, "delta": role, "logprobs": None, "finish_reason": None}
            yield self._chunk([choice], every_chunk)
        thinking = self.thinking
        streams = (
            [ReasoningStream(thinking) for _ in range(self.params.n)]
            if thinking is not None
            else []
        )
        try:
            calls = [CallStream(self.tools) for _ in range(self.params.n)] if self.tools else []
            async with contextlib.aclosing(self._outputs()) as outputs:  # type: ignore[type-var]
                async for out in outputs:
                    self._count(out)
                    reason = _finish(out.finish_reason) if out.finished else None
                    logprobs = self._logprobs(out)
                    new = out.new_text
                    if streams:
                        reasoning, new = streams[out.index].feed(new, out.finished)
                        if reasoning:
                            delta = {"reasoning_content": reasoning}
                            choice = {"index": out.index, "delta": delta, "logprobs": None,
                                      "finish_reason": None}  # fmt: skip
                            yield self._chunk([choice], every_chunk)
                    text = calls[out.index].push(new) if calls else new
                    if calls and out.finished:
                        for chunk in self._call_chunks(out.index, calls[out.index], every_chunk):
                            yield chunk
                        if reason == "stop" and calls[out.index].called:
                            reason = "tool_calls"
                    if out.finish_reason is FinishReason.ERROR:  # no calls read from it
                        choice = self._choice(out.index, "", logprobs, reason)
                        yield self._chunk([choice], every_chunk)
                        yield _event(self._broken(out).body())
                        return  # the other samples abort
                    if text or reason or logprobs:
                        choice = self._choice(out.index, text, logprobs, reason)
                        yield self._chunk([choice], every_chunk)
        except (RequestError, EngineDeadError) as exc:
            yield _event(_failure(exc, self.chat).body())
            return
        if final_usage:
            yield self._chunk([], with_usage=True)
        yield b"data: [DONE]\n\n"

    def _broken(self, out: RequestOutput) -> OpenAIError:
        """The answer's grammar broke off mid-answer (the engine's finish reason ERROR): a
        400 naming the field that asked for it, since the text does not match."""
        asked = structured_output(self.req)
        param = asked[1] if asked else "tools"  # else the grammar of a forced tool call
        return invalid(
            f"{param}: the answer broke off after {_tokens(out.num_output_tokens)}, where the "
            f"grammar engine could not follow it further: {out.error}",
            param,
        )

    def _choice(
        self,
        index: int,
        text: str,
        logprobs: list[dict[str, Any]],
        reason: str | None,
        whole: bool = False,
    ) -> dict[str, Any]:
        """A choice of a whole answer, or of a chunk (`text` new since the last one)."""
        if not self.chat:
            lp = self._text_logprobs(index, logprobs)
            return {"index": index, "text": text, "logprobs": lp, "finish_reason": reason}
        lp = None if self.params.logprobs is None else {"content": logprobs, "refusal": None}
        if whole:
            message = {"role": "assistant", "content": text, "refusal": None}
            return {"index": index, "message": message, "logprobs": lp, "finish_reason": reason}
        delta = {"content": text} if text else {}
        return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": reason}

    def _with_calls(self, choice: dict[str, Any], tools: Tools) -> None:
        """A whole answer's calls as its message's tool_calls (finish reason tool_calls)."""
        message = choice["message"]
        found = read_calls(message["content"], tools)
        message["content"] = found.content  # never a call cut short
        if found.calls:
            message["tool_calls"] = found.calls
            if choice["finish_reason"] == "stop":
                choice["finish_reason"] = "tool_calls"

    def _call_chunks(self, index: int, stream: CallStream, every_chunk: bool) -> list[bytes]:
        """At a streamed answer's end: the content held back, then each call whole (name and
        arguments in one delta, as vLLM's parsers send a call they read at the end)."""
        rest, calls = stream.finish()
        chunks = []
        if rest:
            chunks.append(self._chunk([self._choice(index, rest, [], None)], every_chunk))
        if calls:
            deltas = [{"index": k, **call} for k, call in enumerate(calls)]
            choice = {"index": index, "delta": {"tool_calls": deltas}, "logprobs": None,
                      "finish_reason": None}  # fmt: skip
            chunks.append(self._chunk([choice], every_chunk))
        return chunks

    def _text_logprobs(self, index: int, entries: list[dict[str, Any]]) -> dict[str, Any] | None:
        """The text completion's (legacy) shape: parallel lists, offsets into the answer."""
        if self.params.logprobs is None:
            return None
        offsets = []
        for entry in entries:
            offsets.append(self._offsets[index])
            self._offsets[index] += len(entry["token"])
        return {
            "tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [
                {t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries
            ],
            "text_offset": offsets,
        }

    def _logprobs(self, out: RequestOutput) -> list[dict[str, Any]]:
        """OpenAI's entry per new token of the text: the chosen token's, then the top ones'."""
        chosen = out.logprobs or []
        if chosen and out.finish_reason is FinishReason.STOP and chosen[-1][0][0] in self._stop_ids:
            chosen = chosen[:-1]  # the stop token: not part of the answer
        entries = []
        for (token_id, logprob), *top in chosen:
            entry = self._token(token_id, logprob)
            entry["top_logprobs"] = [self._token(t, lp) for t, lp in top]
            entries.append(entry)
        return entries

    def _token(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.tokenizer.decode([token_id])
        # NOTE: -inf (a token top-k or top-p ruled out) is no JSON number; vLLM says -9999.
        return {"token": text, "logprob": max(logprob, -9999.0), "bytes": list(text.encode())}

    def _count(self, out: RequestOutput) -> None:
        self.last = out
        self.completion_tokens += len(out.new_token_ids)
        if out.finished:
            self._reasons.append(_finish(out.finish_reason))
        self.meter.output(out)

    def _chunk(self, choices: list[dict[str, Any]], with_usage: bool = False) -> bytes:
        chunk: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if with_usage:
            chunk["usage"] = self.usage()
        return _event(chunk)


def _event(data: dict[str, Any]) -> bytes:
    return b"data: " + _json.encode(data) + b"\n\n"


def _failure(exc: Exception, chat: bool) -> OpenAIError:
    if isinstance(exc, RequestError):  # the engine refused the prompt (its context)
        return invalid(str(exc), "messages" if chat else "prompt", "context_length_exceeded")
    return OpenAIError(503, str(exc), "engine_unavailable")


def _tokens(count: int) -> str:
    return f"{count} token" if count == 1 else f"{count} tokens"


def _finish(reason: FinishReason | None) -> str:
    """The engine's finish reason in OpenAI's words: `length` is length, `error` error (a
    grammar broken off), `stop` stop. (The engine's `abort` never reaches here: an answer
    aborts only by leaving its stream.)"""
    if reason is FinishReason.LENGTH:
        return "length"
    return "error" if reason is FinishReason.ERROR else "stop"
