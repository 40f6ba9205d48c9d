"""Chat with a running `pagechat serve` from a terminal; resume a session later.

    .venv/bin/python -m clients.terminal [--url ws://127.0.0.1:8000/v1/chat] [--system TEXT]
    .venv/bin/python -m clients.terminal --session ID --secret SECRET    # continue it

An empty line or Ctrl-D quits. The usage line after each answer says where the prompt's tokens
came from: the device cache, the CPU pool, or recomputed.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from clients.chat_client import ChatClient, ChatServerError
from service.api.frames import Delta, Done, Error


async def chat(args: argparse.Namespace) -> int:
    async with await ChatClient.connect(args.url, session_id=args.session) as client:
        if args.session:
            opened = await client.resume(args.session, args.secret)
            for m in opened.messages:
                print(f"{m.role}> {m.content}")
        else:
            opened = await client.open(system=args.system)
            print(f"session {opened.session_id} secret {opened.secret}", file=sys.stderr)
        while True:
            try:
                text = await asyncio.to_thread(input, "> ")
            except EOFError:
                return 0
            if not text.strip():
                return 0
            await client.send_user(text, max_tokens=args.max_tokens, temperature=args.temperature)
            while True:
                frame = await client.receive()
                if isinstance(frame, Delta):
                    print(frame.text, end="", flush=True)
                elif isinstance(frame, Done):
                    u, t = frame.usage, frame.timing
                    print(
                        f"\n[{u.completion_tokens} tokens; prompt {u.prompt_tokens}: "
                        f"{u.cached_tokens} cached, {u.swapped_in_tokens} swapped in, "
                        f"{u.recomputed_tokens} computed; first token {t.ttft_s or 0:.2f}s]",
                        file=sys.stderr,
                    )
                    break
                elif isinstance(frame, Error):
                    print(f"\n[error {frame.code}: {frame.message}]", file=sys.stderr)
                    if frame.fatal:
                        return 1
                    break


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m clients.terminal")
    parser.add_argument("--url", default="ws://127.0.0.1:8000/v1/chat")
    parser.add_argument("--system", default=None)
    parser.add_argument("--session", default=None)
    parser.add_argument("--secret", default=None)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.7)
    args = parser.parse_args()
    if bool(args.session) != bool(args.secret):
        parser.error("--session and --secret go together")
    try:
        return asyncio.run(chat(args))
    except ChatServerError as exc:
        print(f"error {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
