"""The `pagechat` command: quick looks at the engine from a terminal.

pagechat generate "PROMPT"   one streamed chat answer
pagechat chat                a multi-turn chat; every turn reuses the previous turns' KV
pagechat serve               the WebSocket chat service (docs/protocol.md)
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections.abc import Sequence

import msgspec

from service.engine.config import EngineConfig
from service.engine.engine import LLMEngine
from service.engine.families import UnsupportedModelError
from service.engine.params import DEFAULT_MAX_TOKENS, SamplingParams
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


def _engine_args(parser: argparse.ArgumentParser) -> None:
    from service.server.options import add_arguments

    add_arguments(parser, ["engine"], only=CLI_ENGINE_FIELDS)
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=DEFAULT_MAX_TOKENS,
        help="an answer's length (the server's default), at most what the context has left",
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="(0, 2], 1 none: a seen token's positive logit divided by it, a negative one"
        " multiplied (1.3 stops the bundled model's loops)",
    )
    parser.add_argument(
        "--frequency-penalty", type=float, default=0.0, help="[-2, 2]: per time a token came"
    )
    parser.add_argument(
        "--presence-penalty", type=float, default=0.0, help="[-2, 2]: once a token has come"
    )
    parser.add_argument("--system", default=None, help="system prompt")


def _build(args: argparse.Namespace) -> tuple[LLMEngine, SamplingParams]:
    from service.server.options import values

    config = EngineConfig(**values(args, "engine", only=CLI_ENGINE_FIELDS))
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
            repetition_penalty=args.repetition_penalty,
            frequency_penalty=args.frequency_penalty,
            presence_penalty=args.presence_penalty,
        )
    except ValueError as exc:  # before the model loads: one line and status 2, as argparse
        sys.stderr.write(f"pagechat {args.command}: {exc}\n")
        raise SystemExit(2) from None
    return LLMEngine(config), params


def _stream_answer(
    engine: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams
) -> list[int]:
    """Print the answer as it is generated; return its token ids."""
    room = engine.max_model_len - len(prompt)  # as the server clamps an answer's length
    params = msgspec.structs.replace(params, max_tokens=min(params.max_tokens, room))
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
    engine, params = _build(args)
    prompt = ChatFormat(engine.tokenizer).first_prompt(args.system or None, args.prompt)
    _stream_answer(engine, "generate", prompt, params)
    return 0


def chat(args: argparse.Namespace) -> int:
    """As the service answers a session: every turn's prompt is the conversation's ids so far,
    exactly as the model saw them (a prefix-cache hit), plus the new user turn's."""
    engine, params = _build(args)
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
        answer = _stream_answer(engine, f"turn-{turn}", prompt, params)
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
