"""Chat with a running `pagechat serve` from a terminal; resume a session later.

    .venv/bin/python -m clients.terminal [--url http://127.0.0.1:8000] [--system TEXT]
    .venv/bin/python -m clients.terminal --session ID --secret SECRET    # continue it

Ctrl-C during an answer stops it (the server is sent `cancel`) and returns to the prompt;
Ctrl-C, Ctrl-D or an empty line at the prompt quits. The usage line after each answer says
where the prompt's tokens came from: the device cache, the CPU pool, or recomputed. A failure
(no server, a wrong URL, an unknown session) is one line on stderr and a non-zero exit.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import os
import select
import signal
import sys
import threading
import time
import urllib.parse
from collections.abc import Coroutine
from typing import Any, TypeVar

from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI

from clients.chat_client import ChatClient, ChatServerError
from protocol.frames import Delta, Done, Error

DEFAULT_URL = "ws://127.0.0.1:8000/v1/chat"
CHAT_PATH = "/v1/chat"
SCHEMES = {"ws": "ws", "wss": "wss", "http": "ws", "https": "wss"}
POLL_S = 0.2  # the longest a Ctrl-C waits to be noticed
CANCEL_WAIT_S = 30.0  # after Ctrl-C, how long the cancelled answer's `done` may take
EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130
T = TypeVar("T")


class Failure(Exception):
    """Ends the client with one line on stderr and a non-zero exit status."""


def chat_url(url: str) -> str:
    """ws(s)://HOST:PORT/.../v1/chat from what a person types: ws://, wss://, http:// or
    https://, with or without the /v1/chat path (or HOST:PORT alone, as ws://)."""
    if "://" not in url:
        url = "ws://" + url
    parts = urllib.parse.urlsplit(url)
    scheme = SCHEMES.get(parts.scheme.lower())
    if scheme is None:
        raise Failure(f"{url}: not a server URL (use ws://, wss://, http:// or https://)")
    try:
        parts.port  # noqa: B018  (parsing the port is the check)
    except ValueError:
        raise Failure(f"{url}: the port is not a number") from None
    if not parts.hostname:
        raise Failure(f"{url}: no host name")
    path = parts.path.rstrip("/")
    if not path.endswith(CHAT_PATH):
        if path:
            raise Failure(f"{url}: the chat is at {CHAT_PATH} (give the server's address alone)")
        path = CHAT_PATH
    return urllib.parse.urlunsplit((scheme, parts.netloc, path, parts.query, ""))


class Loop:
    """An event loop on a thread of its own, holding the socket (and answering the server's
    pings) while the main thread waits in input(): Ctrl-C is delivered to the main thread,
    which stays free to send `cancel`."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        # NOTE: the kernel hands SIGINT to any thread that does not block it, and only the
        # main thread's blocking call (input(), a wait for the answer) is interrupted by it:
        # this thread, and the resolver threads it starts, block it.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return wait_for(self.submit(coro), timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        if not self.thread.is_alive():
            self.loop.close()


async def connect(args: argparse.Namespace) -> ChatClient:
    try:
        client = await ChatClient.connect(args.url, session_id=args.session)
    except InvalidStatus as exc:
        raise Failure(
            f"{args.url} answered HTTP {exc.response.status_code}, not a chat WebSocket "
            "(is it a pagechat server?)"
        ) from None
    except (InvalidURI, InvalidHandshake) as exc:
        raise Failure(f"{args.url}: not a chat WebSocket ({exc})") from None
    except TimeoutError:
        raise Failure(f"{args.url}: no answer (timed out)") from None
    except ConnectionRefusedError:
        raise Failure(
            f"cannot connect to {args.url}: connection refused (is `pagechat serve` running?)"
        ) from None
    except OSError as exc:  # an unknown host, an unreachable network, a TLS failure
        raise Failure(f"cannot connect to {args.url}: {exc.strerror or exc}") from None
    try:
        if args.session:
            opened = await client.resume(args.session, args.secret, api_key=args.api_key)
            for m in opened.messages:
                print(f"{m.role}> {m.content}")
        else:
            opened = await client.open(system=args.system, api_key=args.api_key)
            print(
                f"session {opened.session_id} (resume with --session {opened.session_id} "
                f"--secret {opened.secret})",
                file=sys.stderr,
            )
    except ChatServerError as exc:
        await client.close()
        if exc.code == "unknown_session":
            raise Failure(
                f"no session {args.session} on this server (expired, or never existed)"
            ) from None
        raise Failure(f"the server refused: {exc.message}") from None
    return client


async def answer(client: ChatClient, text: str, args: argparse.Namespace) -> None:
    """Send one message and print its answer as it streams, then its usage line."""
    await client.send_user(
        text, max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=args.ignore_eos
    )
    while True:
        frame = await client.receive()
        if isinstance(frame, Delta):
            print(frame.text, end="", flush=True)
        elif isinstance(frame, Done):
            u, t = frame.usage, frame.timing
            ended = "" if frame.finish_reason == "stop" else f"; {frame.finish_reason}"
            loaded = f"{u.loaded_tokens} loaded, " if u.loaded_tokens else ""
            print(
                f"\n[{u.completion_tokens} tokens; prompt {u.prompt_tokens}: "
                f"{u.cached_tokens} cached, {u.swapped_in_tokens} swapped in, {loaded}"
                f"{u.recomputed_tokens} computed; first token {t.ttft_s or 0:.2f}s{ended}]",
                file=sys.stderr,
            )
            return
        elif isinstance(frame, Error):
            if frame.fatal:
                raise Failure(f"the server ended the chat: {frame.message}")
            print(f"\n[not answered: {frame.message}]", file=sys.stderr)
            return


def prompt(text: str) -> str:
    """input(), but Ctrl-C always interrupts it: a SIGINT that lands between input() writing
    its prompt and blocking in read() is lost to it, so on a terminal the wait is a select()
    with a timeout, which lets Python raise KeyboardInterrupt within a fifth of a second."""
    if not sys.stdin.isatty():
        return input(text)
    print(text, end="", flush=True)
    while not select.select([sys.stdin], [], [], POLL_S)[0]:
        pass
    line = sys.stdin.readline()  # a whole line is there: the terminal hands over lines
    if not line:
        raise EOFError
    return line.removesuffix("\n")


def wait_for(future: concurrent.futures.Future[T], timeout: float | None = None) -> T:
    """future.result(), in short waits for the same reason as prompt()."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        try:
            return future.result(POLL_S)
        except TimeoutError:
            if deadline is not None and time.monotonic() > deadline:
                raise


def converse(loop: Loop, client: ChatClient, args: argparse.Namespace) -> int:
    while True:
        try:
            text = prompt("> ")
        except (EOFError, KeyboardInterrupt):
            print()  # end the prompt's line
            return 0
        if not text.strip():
            return 0
        turn = loop.submit(answer(client, text, args))
        try:
            wait_for(turn)
        except KeyboardInterrupt:
            # Stop the answer, keep what was said (the server stores it), back to the prompt.
            loop.run(client.cancel())
            wait_for(turn, CANCEL_WAIT_S)


def run(args: argparse.Namespace) -> int:
    loop = Loop()
    client: ChatClient | None = None
    try:
        client = loop.run(connect(args))
        return converse(loop, client, args)
    except Failure as exc:
        print(f"pagechat: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except ConnectionClosed as exc:
        why = f": {exc.rcvd.reason}" if exc.rcvd and exc.rcvd.reason else ""
        print(f"pagechat: the server closed the connection{why}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:  # while connecting, or a second Ctrl-C while cancelling
        print(file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        if client is not None:
            with contextlib.suppress(Exception):  # a socket the server closed is not news
                loop.run(client.close(), timeout=5)
        loop.close()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m clients.terminal",
        description="Chat with a pagechat server. Ctrl-C stops an answer; Ctrl-C, Ctrl-D or an "
        "empty line at the prompt quits.",
    )
    p.add_argument(
        "--url",
        default=DEFAULT_URL,
        help="the server: ws://HOST:PORT, http://HOST:PORT, https://HOST or the full "
        "/v1/chat URL (default: %(default)s)",
    )
    p.add_argument(
        "--system",
        default=None,
        help="the new chat's system prompt (default: none, the model's own default)",
    )
    p.add_argument(
        "--session", default=None, help="resume this session id (default: open a new session)"
    )
    p.add_argument("--secret", default=None, help="the resumed session's secret (default: none)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("PAGECHAT_API_KEY"),
        help="for a server with API keys (default: $PAGECHAT_API_KEY, or none)",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=256,
        help="the most tokens in one answer (default: %(default)s)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.7,
        help="sampling temperature, 0 is greedy (default: %(default)s)",
    )
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="keep answering past the end of the turn, up to --max-tokens (default: off)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if bool(args.session) != bool(args.secret):
        print("pagechat: --session and --secret go together", file=sys.stderr)
        return EXIT_USAGE
    try:
        args.url = chat_url(args.url)
    except Failure as exc:
        print(f"pagechat: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
