"""The `pagechat` command: quick looks at the engine from a terminal.

pagechat generate "PROMPT"   one streamed chat answer
pagechat chat                a multi-turn chat; every turn reuses the previous turns' KV
pagechat serve               the WebSocket chat service (docs/protocol.md)

`generate` and `chat` take a `user` frame's sampling flags (protocol/flags.py), the terminal
client's, with their defaults, and build the engine's parameters as the server does.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections.abc import Sequence

from protocol.flags import add_param_flags, param_values
from service.api.limits import Limits
from service.api.sampling import AskedSampling, Room, SamplingError, sampling_params, user_sampling
from service.engine.config import EngineConfig
from service.engine.engine import LLMEngine
from service.engine.families import UnsupportedModelError
from service.engine.params import DEFAULT_MAX_TOKENS
from service.sessions.prompt import ChatFormat

# The engine options `generate` and `chat` take, as `serve` does (service.server.options).
CLI_ENGINE_FIELDS = (
    "model",
    "dtype",
    "weight_dtype",
    "weights",
    "device",
    "cpu_isa",
    "matmul_inputs",
    "attention_backend",
    "num_threads",
    "cuda_graphs",
)


# The server's limits, less its cap on max_tokens: the command answers one person, so an answer
# may be as long as the context holds.
LIMITS = Limits(max_tokens=2**31 - 1)


def _engine_args(parser: argparse.ArgumentParser) -> None:
    from service.server.options import add_arguments

    add_arguments(parser, ["engine"], only=CLI_ENGINE_FIELDS)
    add_param_flags(parser)  # a `user` frame's params, as the terminal client's flags
    parser.add_argument("--system", default=None, help="system prompt")


def _build(args: argparse.Namespace) -> tuple[LLMEngine, AskedSampling]:
    from service.server.options import values

    config = EngineConfig(**values(args, "engine", only=CLI_ENGINE_FIELDS))
    try:  # all but the room checked before the model loads: one line and status 2, as argparse
        asked = user_sampling(param_values(args))
        sampling_params(asked, LIMITS, default_max_tokens=DEFAULT_MAX_TOKENS)
    except SamplingError as exc:
        sys.stderr.write(f"pagechat {args.command}: {exc}\n")
        raise SystemExit(2) from None
    return LLMEngine(config), asked


def _stream_answer(
    engine: LLMEngine, request_id: str, prompt: list[int], asked: AskedSampling
) -> list[int] | None:
    """Print the answer as it is generated; return its token ids (None: refused, for want of
    room in the context, as the server refuses it: NOTE (room) in service/api/sampling.py)."""
    try:
        params = sampling_params(
            asked,
            LIMITS,
            default_max_tokens=DEFAULT_MAX_TOKENS,
            room=Room(len(prompt), engine.max_model_len),
            tokenizer=engine.tokenizer,
        )
    except SamplingError as exc:
        sys.stderr.write(f"[not answered: {exc}]\n")
        return None
    engine.add_request(request_id, prompt, params)
    tokens: list[int] = []
    start = time.monotonic()
    first: float | None = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            first = first or time.monotonic()
            tokens += out.new_token_ids
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
    elapsed = time.monotonic() - start
    ttft = (first or start) - start
    sys.stdout.write("\n")
    sys.stderr.write(f"[{len(tokens)} tokens, first after {ttft:.2f}s, {elapsed:.2f}s total]\n")
    return tokens


def generate(args: argparse.Namespace) -> int:
    engine, asked = _build(args)
    prompt = ChatFormat(engine.tokenizer).first_prompt(args.system or None, args.prompt)
    return 0 if _stream_answer(engine, "generate", prompt, asked) is not None else 1


def chat(args: argparse.Namespace) -> int:
    """As the service answers a session: every turn's prompt is the conversation's ids so far,
    exactly as the model saw them (a prefix-cache hit), plus the new user turn's."""
    engine, asked = _build(args)
    chat_format = ChatFormat(engine.tokenizer)
    print("pagechat: type a message; an empty line or Ctrl-D quits", file=sys.stderr)
    history: list[int] = []
    for turn in itertools.count():
        try:
            text = input("> ")
        except EOFError:
            break
        if not text.strip():
            break
        if history:
            prompt = chat_format.next_prompt(history, text)
        else:
            prompt = chat_format.first_prompt(args.system or None, text)
        answer = _stream_answer(engine, f"turn-{turn}", prompt, asked)
        if answer is None:  # nothing was said: the conversation stays as it was
            continue
        history = prompt + answer + chat_format.close_turn(answer)
    return 0


def _serve_args(parser: argparse.ArgumentParser) -> None:
    from service.server.options import add_arguments

    add_arguments(parser)


def serve(args: argparse.Namespace) -> int:
    from service.server.serve import serve as run_server

    return run_server(args)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagechat")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="print a streamed chat answer")
    gen.add_argument("prompt")
    _engine_args(gen)
    gen.set_defaults(func=generate)
    ch = sub.add_parser("chat", help="chat in the terminal")
    _engine_args(ch)
    ch.set_defaults(func=chat)
    sv = sub.add_parser("serve", help="serve the WebSocket chat API (docs/protocol.md)")
    _serve_args(sv)
    sv.set_defaults(func=serve)
    args = parser.parse_args(argv)
    try:
        result: int = args.func(args)
    except (UnsupportedModelError, FileNotFoundError) as exc:  # the model: one line, no trace
        sys.stderr.write(f"pagechat {args.command}: {exc}\n")
        return 2
    return result


if __name__ == "__main__":
    sys.exit(main())
