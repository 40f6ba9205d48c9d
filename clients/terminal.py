"""Chat with a running `pagechat serve` from a terminal; resume a session later.

    .venv/bin/python -m clients.terminal [--url http://127.0.0.1:8000] [--system TEXT]
    .venv/bin/python -m clients.terminal --session ID --secret SECRET    # continue it

Ctrl-C during an answer stops it (the server is sent `cancel`) and returns to the prompt;
Ctrl-C, Ctrl-D or an empty line at the prompt quits. The usage line after each answer says
where the prompt's tokens came from: the device cache, the CPU pool, or recomputed. A failure
(no server, a wrong URL, an unknown session) is one line on stderr and a non-zero exit.

While it waits at the prompt the client watches its connection: when the server goes away it
says so at once, reconnects by itself (waiting at most RETRY_MAX_S between tries) and resumes
the session; a line typed meanwhile is kept and sent once it is back. A connection lost
mid-answer ends that answer on its own line and reconnects the same way.

On a terminal, answers are rendered as markdown while they stream (rich: code blocks, lists,
tables, emphasis); piped or redirected, or with --markdown off, they are the plain text.
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
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import msgspec
from websockets.exceptions import (
    ConnectionClosed,
    InvalidHandshake,
    InvalidMessage,
    InvalidStatus,
    InvalidURI,
)
from websockets.protocol import State

from clients.chat_client import ChatClient, ChatServerError
from protocol.flags import add_param_flags, param_values
from protocol.frames import Delta, Done, Error

DEFAULT_URL = "ws://127.0.0.1:8000/v1/chat"
CHAT_PATH = "/v1/chat"
SCHEMES = {"ws": "ws", "wss": "wss", "http": "ws", "https": "wss"}
POLL_S = 0.2  # the longest a Ctrl-C (or a lost connection, at the prompt) waits to be noticed
RETRY_FIRST_S, RETRY_MAX_S = 0.25, 5.0  # reconnecting: the first wait, doubled up to this
CANCEL_WAIT_S = 30.0  # after Ctrl-C, how long the cancelled answer's `done` may take
EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130
T = TypeVar("T")


class Failure(Exception):
    """Ends the client with one line on stderr and a non-zero exit status."""


class Unreachable(Failure):
    """No chat WebSocket at the address now: at start-up a failure, once chatting a retry."""


class NotSent(Exception):
    """The connection closed before a message could be sent: it is sent again once back."""


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


async def connect(args: argparse.Namespace, *, quiet: bool = False) -> ChatClient:
    """Connect, and open a session or resume `args.session` (printing its history unless
    `quiet`: a reconnect's)."""
    try:
        client = await ChatClient.connect(args.url, session_id=args.session)
    except InvalidStatus as exc:
        raise Unreachable(
            f"{args.url} answered HTTP {exc.response.status_code}, not a chat WebSocket "
            "(is it a pagechat server?)"
        ) from None
    except InvalidMessage as exc:  # closed before an HTTP response: a server starting or going
        raise Unreachable(f"{args.url}: not a chat WebSocket ({exc})") from None
    except (InvalidURI, InvalidHandshake) as exc:
        raise Failure(f"{args.url}: not a chat WebSocket ({exc})") from None
    except TimeoutError:
        raise Unreachable(f"{args.url}: no answer (timed out)") from None
    except ConnectionRefusedError:
        raise Unreachable(
            f"cannot connect to {args.url}: connection refused (is `pagechat serve` running?)"
        ) from None
    except OSError as exc:  # an unknown host, an unreachable network, a TLS failure
        raise Unreachable(f"cannot connect to {args.url}: {exc.strerror or exc}") from None
    resuming = bool(args.session)
    try:
        if resuming:
            opened = await client.resume(args.session, args.secret, api_key=args.api_key)
            if not quiet:
                for m in opened.messages:
                    print(f"{m.role}> {m.content}")
        else:
            opened = await client.open(system=args.system, api_key=args.api_key)
            print(
                f"session {opened.session_id} (resume with --session {opened.session_id} "
                f"--secret {opened.secret})",
                file=sys.stderr,
            )
            # A reconnect resumes this session.
            args.session, args.secret = opened.session_id, opened.secret
    except ChatServerError as exc:
        await client.close()
        if exc.code == "unknown_session":
            raise Failure(
                f"no session {args.session} on this server (expired, or never existed)"
            ) from None
        if exc.code in ("shutting_down", "too_many_connections"):
            raise Unreachable(f"the server refused: {exc.message}") from None
        raise Failure(f"the server refused: {exc.message}") from None
    except ConnectionClosed:
        raise Unreachable(f"{args.url}: the connection closed while opening") from None
    return client


async def reconnect(args: argparse.Namespace) -> ChatClient:
    """Connect and resume the session again, retrying while the server is unreachable."""
    wait = RETRY_FIRST_S
    while True:
        try:
            return await connect(args, quiet=True)
        except Unreachable:
            await asyncio.sleep(wait)
            wait = min(2 * wait, RETRY_MAX_S)


class Connection:
    """The chat's connection, made again whenever it drops. Its owner (the main thread) asks
    `check` while it waits for a line and `ready` before it sends one."""

    def __init__(self, loop: Loop, client: ChatClient, args: argparse.Namespace) -> None:
        self.loop = loop
        self.client = client
        self.args = args
        self.reconnecting: concurrent.futures.Future[ChatClient] | None = None

    def lost(self) -> str:
        """Start reconnecting (the connection is gone); the line that says so."""
        if self.reconnecting is None:
            self.reconnecting = self.loop.submit(reconnect(self.args))
        return "[the server went away; reconnecting…]"

    def check(self) -> str | None:
        """A line to show now, if the connection's state changed since the last call."""
        if self.reconnecting is None:
            return self.lost() if self.client.websocket.state is State.CLOSED else None
        if not self.reconnecting.done():
            return None
        return self._reconnected()

    def ready(self) -> ChatClient:
        """The client, once connected: waits out a reconnect in progress."""
        if self.reconnecting is None and self.client.websocket.state is State.CLOSED:
            print(self.lost(), file=sys.stderr)
        if self.reconnecting is not None:
            if not self.reconnecting.done():
                print("[waiting for the server; your message is kept]", file=sys.stderr)
            wait_for(self.reconnecting)
            print(self._reconnected(), file=sys.stderr)
        return self.client

    def _reconnected(self) -> str:
        assert self.reconnecting is not None
        future, self.reconnecting = self.reconnecting, None
        old, self.client = self.client, future.result()  # a Failure (the session gone) ends it
        with contextlib.suppress(Exception):
            self.loop.run(old.close(), timeout=5)
        return f"[reconnected: session {self.args.session} resumed]"


async def answer(client: ChatClient, text: str, args: argparse.Namespace) -> None:
    """Send one message and print its answer as it streams, then its usage line."""
    try:
        await client.send_user(text, **msgspec.structs.asdict(param_values(args)))
    except ConnectionClosed:
        raise NotSent from None
    view = AnswerView(markdown=args.markdown == "on")
    while True:
        try:
            frame = await client.receive()
        except ConnectionClosed:
            view.end()  # what follows goes on a line of its own
            raise
        if isinstance(frame, Delta):
            view.add(frame.text)
        elif isinstance(frame, Done):
            view.end()
            u, t = frame.usage, frame.timing
            ended = "" if frame.finish_reason == "stop" else f"; {frame.finish_reason}"
            loaded = f"{u.loaded_tokens} loaded, " if u.loaded_tokens else ""
            print(
                f"[{u.completion_tokens} tokens; prompt {u.prompt_tokens}: "
                f"{u.cached_tokens} cached, {u.swapped_in_tokens} swapped in, {loaded}"
                f"{u.recomputed_tokens} computed; first token {t.ttft_s or 0:.2f}s{ended}]",
                file=sys.stderr,
            )
            return
        elif isinstance(frame, Error):
            view.end()
            if frame.fatal and frame.code == "shutting_down":
                print(f"[{frame.message}]", file=sys.stderr)
                continue  # the close follows: reconnected like any lost connection
            if frame.fatal:
                raise Failure(f"the server ended the chat: {frame.message}")
            print(f"[not answered: {frame.message}]", file=sys.stderr)
            return


class AnswerView:
    """One answer on stdout as it streams: plain text as it comes, or, with `markdown`, the
    text so far rendered as markdown (rich) and redrawn in place at most 12 times a second,
    so that code blocks, lists and tables read as they will when it is done. `end` leaves the
    cursor at the start of a line either way."""

    REDRAW_S = 1 / 12

    def __init__(self, markdown: bool, console: Any = None) -> None:
        self._markdown = markdown
        self._text = ""
        self._live: Any = None
        self._drawn_at = 0.0
        self._console = console

    def add(self, text: str) -> None:
        self._text += text
        if not self._markdown:
            print(text, end="", flush=True)
            return
        from rich.live import Live

        if self._live is None:
            self._live = Live(
                self._rendered(), console=self._console, auto_refresh=False,
                vertical_overflow="visible", redirect_stdout=False, redirect_stderr=False,
            )  # fmt: skip
            self._live.start()
        now = time.monotonic()
        if now - self._drawn_at >= self.REDRAW_S:
            self._live.update(self._rendered(), refresh=True)
            self._drawn_at = now

    def end(self) -> None:
        if self._live is not None:
            self._live.update(self._rendered(), refresh=True)
            self._live.stop()
            self._live = None
        elif self._text and not self._markdown:
            print()
        self._text = ""

    def _rendered(self) -> Any:
        from rich.markdown import Markdown

        return Markdown(self._text, code_theme="ansi_dark")


def prompt(text: str, idle: Callable[[], str | None] = lambda: None) -> str:
    """input(), but Ctrl-C always interrupts it: a SIGINT that lands between input() writing
    its prompt and blocking in read() is lost to it, so on a terminal the wait is a select()
    with a timeout, which lets Python raise KeyboardInterrupt within a fifth of a second.
    Each wait also asks `idle` for news (the connection's) to show on a line of its own; what
    was typed so far stays in the terminal's line, to be finished and sent."""
    if not sys.stdin.isatty():
        return input(text)
    print(text, end="", flush=True)
    while not select.select([sys.stdin], [], [], POLL_S)[0]:
        if (news := idle()) is not None:
            print(f"\n{news}", file=sys.stderr, flush=True)
            print(text, end="", flush=True)
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
    connection = Connection(loop, client, args)
    while True:
        try:
            text = prompt("> ", connection.check)
        except (EOFError, KeyboardInterrupt):
            print()  # end the prompt's line
            return 0
        if not text.strip():
            return 0
        while True:
            client = connection.ready()
            turn = loop.submit(answer(client, text, args))
            try:
                try:
                    wait_for(turn)
                except KeyboardInterrupt:
                    # Stop the answer, keep what was said (the server stores it), to the prompt.
                    loop.run(client.cancel())
                    wait_for(turn, CANCEL_WAIT_S)
            except NotSent:
                print(connection.lost(), file=sys.stderr)
                continue  # the same message, once the connection is back
            except ConnectionClosed:
                print(f"[the connection was lost mid-answer] {connection.lost()}", file=sys.stderr)
            break


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
    add_param_flags(p)  # a `user` frame's params (protocol/flags.py), as `pagechat chat` takes them
    p.add_argument(
        "--markdown",
        choices=["auto", "on", "off"],
        default="auto",
        help="render answers as markdown (code blocks, lists, tables); auto: when the output "
        "is a terminal that can redraw (not TERM=dumb) (default: %(default)s)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.markdown == "auto":
        # A terminal that cannot move its cursor (TERM=dumb) could only print every redraw
        # below the last: plain text there.
        drawable = os.environ.get("TERM", "dumb") not in ("dumb", "unknown", "")
        args.markdown = "on" if sys.stdout.isatty() and drawable else "off"
    if bool(args.session) != bool(args.secret):
        print("pagechat: --session and --secret go together", file=sys.stderr)
        return EXIT_USAGE
    try:
        args.url = chat_url(args.url)
    except Failure as exc:
        print(f"pagechat: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if sys.stdin.isatty():
        take_ctrl_c()
    return run(args)


def take_ctrl_c() -> None:
    """Make Ctrl-C raise KeyboardInterrupt here whatever this process inherited. A process
    started with SIGINT ignored (from a script's background job, `nohup`, a launcher that
    ignores it: the disposition survives exec) or blocked keeps it so, and Python then installs
    no handler: Ctrl-C at the prompt or mid-answer would do nothing. On a terminal the client
    is the program the user is typing to, so it takes the key back."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.default_int_handler)


if __name__ == "__main__":
    sys.exit(main())
