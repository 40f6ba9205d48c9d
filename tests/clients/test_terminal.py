"""The terminal client (clients/terminal.py) as a person uses it: in a real pseudo-terminal,
where Ctrl-C and Ctrl-D are keys (the terminal turns them into SIGINT and end of input),
against a real `pagechat serve` running a tiny model; and its failures, each one line.
"""

from __future__ import annotations

import asyncio
import os
import pty
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from benchmarks.peer_servers import free_port
from clients.terminal import Failure, chat_url, parser
from tests.api.server import (
    REDIS_URL,
    REPO,
    ServerProcess,
    delete_prefix,
    is_idle,
    running_server,
    start_server,
    unique_prefix,
    wait_balanced,
)
from tests.tiny_model import make_tiny_llama

pytestmark = pytest.mark.timeout(240)

CTRL_C, CTRL_D = b"\x03", b"\x04"
CLIENT = [sys.executable, "-m", "clients.terminal"]
ENV = {**os.environ, "TERM": "dumb", "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tiny = make_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")
    with running_server(
        tmp_path_factory.mktemp("server"), "--model", str(tiny), "--dtype", "float32"
    ) as server:
        yield server


class Terminal:
    """The client on a pseudo-terminal of its own (its controlling terminal, so the keys
    act as they do for a person)."""

    def __init__(self, *args: str, term: str = "dumb", sigint: str = "default") -> None:
        pid, fd = pty.fork()
        if pid == 0:  # the child: exec at once, nothing else
            os.chdir(REPO)
            if sigint == "ignored":  # as from a script's background job: survives exec
                signal.signal(signal.SIGINT, signal.SIG_IGN)
            elif sigint == "blocked":
                signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            os.execve(sys.executable, [*CLIENT, *args], {**ENV, "TERM": term})
        self.pid, self.fd = pid, fd
        self.output = b""
        self.status: int | None = None

    def read_until(self, marker: bytes, timeout: float = 60.0, start: int = 0) -> bytes:
        """Read until `marker` appears after offset `start`; the output so far."""
        deadline = time.monotonic() + timeout
        while marker not in self.output[start:]:
            left = deadline - time.monotonic()
            if left <= 0 or not self._read(left):
                raise AssertionError(f"no {marker!r} in {self.output.decode(errors='replace')}")
        return self.output

    def _read(self, timeout: float) -> bool:
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return False
        try:
            chunk = os.read(self.fd, 4096)
        except OSError:  # EIO: the child has exited and closed the terminal
            return False
        self.output += chunk
        return bool(chunk)

    def send(self, data: bytes) -> None:
        os.write(self.fd, data)

    def wait(self, timeout: float = 30.0) -> int:
        """The exit status (a signal's death is -SIGNUM)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._read(0.05)
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                while self._read(0.05):
                    pass
                self.status = os.waitstatus_to_exitcode(status)
                return self.status
        raise AssertionError(f"still running: {self.output.decode(errors='replace')}")

    def close(self) -> None:
        if self.status is None:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        os.close(self.fd)

    @property
    def text(self) -> str:
        return self.output.decode(errors="replace")


@pytest.fixture
def terminal() -> Iterator[type[Terminal]]:
    opened: list[Terminal] = []

    class Opened(Terminal):
        def __init__(self, *args: str, term: str = "dumb", sigint: str = "default") -> None:
            super().__init__(*args, term=term, sigint=sigint)
            opened.append(self)

    yield Opened
    for t in opened:
        t.close()


def run_client(*args: str, stdin: bytes = b"") -> subprocess.CompletedProcess[str]:
    """The client with piped standard streams (not a terminal): stdin ends at once."""
    return subprocess.run(
        [*CLIENT, *args], input=stdin.decode(), capture_output=True, text=True, cwd=REPO,
        env=ENV, timeout=60,
    )  # fmt: skip


def one_line(stderr: str) -> str:
    lines = stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


# ---------------------------------------------------------------------- keys, in a pty


@pytest.mark.parametrize(
    ("key", "address"), [(CTRL_C, "http"), (CTRL_D, "ws")], ids=["ctrl-c", "ctrl-d"]
)
@pytest.mark.server
async def test_ctrl_c_or_ctrl_d_at_the_prompt_exits_cleanly(
    server: ServerProcess, terminal: type[Terminal], key: bytes, address: str
) -> None:
    client = terminal("--url", getattr(server, address))
    client.read_until(b"> ")
    client.send(key)
    assert client.wait() == 0
    assert "Traceback" not in client.text and "KeyboardInterrupt" not in client.text
    await wait_balanced(server)  # its connection is closed, nothing is held


@pytest.mark.parametrize("sigint", ["ignored", "blocked"])
@pytest.mark.server
async def test_ctrl_c_reaches_the_client_whatever_sigint_it_inherited(
    server: ServerProcess, terminal: type[Terminal], sigint: str
) -> None:
    # A full suite run in a background job once failed the Ctrl-C tests: its children
    # inherited SIGINT ignored, and Python installs no handler over an ignored signal.
    client = terminal("--url", server.http, sigint=sigint)
    client.read_until(b"> ")
    client.send(CTRL_C)
    assert client.wait() == 0
    assert "Traceback" not in client.text
    await wait_balanced(server)


@pytest.mark.server
async def test_ctrl_c_mid_answer_cancels_it_and_returns_to_the_prompt(
    server: ServerProcess, terminal: type[Terminal]
) -> None:
    # ~400 tokens without stopping: seconds of answer to interrupt after its first words.
    client = terminal("--url", server.http, "--max-tokens", "400", "--ignore-eos")
    client.read_until(b"> ")
    client.send(b"Tell me a very long story.\r")
    asked = len(client.read_until(b"story.\r\n"))
    deadline = time.monotonic() + 60
    while len(client.output) < asked + 20 and client._read(deadline - time.monotonic()):
        pass  # some of the answer has streamed in
    client.send(CTRL_C)
    client.read_until(b"cancelled]", start=asked)
    usage = client.text[asked:].split("[")[-1]
    completion = int(usage.split(" tokens")[0])
    assert 0 < completion < 400, usage
    client.read_until(b"> ", start=client.output.rindex(b"cancelled]"))  # back at the prompt
    # The server stopped generating while the client stays connected: nothing runs or is held.
    deadline = time.monotonic() + 10
    while not is_idle(await server.astats()):
        assert time.monotonic() < deadline, await server.astats()
        await asyncio.sleep(0.05)
    client.send(CTRL_D)
    assert client.wait() == 0
    assert "Traceback" not in client.text
    await wait_balanced(server)


# ---------------------------------------------------------------------- addresses


@pytest.mark.parametrize(
    "form", ["http://{host}", "ws://{host}", "{host}", "ws://{host}/v1/chat", "http://{host}/"]
)
@pytest.mark.server
def test_the_server_address_is_accepted_in_every_usual_form(
    server: ServerProcess, form: str
) -> None:
    result = run_client("--url", form.format(host=f"127.0.0.1:{server.port}"))
    assert result.returncode == 0, result.stderr  # connected, opened, then end of input
    assert one_line(result.stderr).startswith("session ")


@pytest.mark.parametrize(
    ("given", "url"),
    [
        ("ws://h:1", "ws://h:1/v1/chat"),
        ("http://h:1", "ws://h:1/v1/chat"),
        ("https://h", "wss://h/v1/chat"),
        ("HTTPS://h:443/", "wss://h:443/v1/chat"),
        ("h:8000", "ws://h:8000/v1/chat"),
        ("wss://h/pagechat/v1/chat/", "wss://h/pagechat/v1/chat"),  # behind a proxy's prefix
        ("http://h:1/v1/chat?session=x", "ws://h:1/v1/chat?session=x"),
    ],
)
def test_chat_url_normalizes_to_the_websocket_endpoint(given: str, url: str) -> None:
    assert chat_url(given) == url


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("ftp://127.0.0.1:8000", "not a server URL"),
        ("http://127.0.0.1:8000/v1/chat/completions", "the chat is at /v1/chat"),
        ("http://127.0.0.1:port", "not a number"),
        ("http://:8000", "no host"),
    ],
)
@pytest.mark.server
def test_a_wrong_url_is_one_line_and_exit_2(url: str, says: str) -> None:
    with pytest.raises(Failure):
        chat_url(url)
    result = run_client("--url", url)
    assert result.returncode == 2
    assert says in one_line(result.stderr)


@pytest.mark.server
def test_no_server_is_one_line_and_exit_1() -> None:
    result = run_client("--url", f"http://127.0.0.1:{free_port()}")
    assert result.returncode == 1
    assert "connection refused" in one_line(result.stderr)


@pytest.mark.server
def test_a_path_that_is_not_the_chat_is_one_line_and_exit_1(server: ServerProcess) -> None:
    result = run_client("--url", f"{server.http}/elsewhere/v1/chat")
    assert result.returncode == 1
    assert "not a chat WebSocket" in one_line(result.stderr)  # Starlette answers 403


@pytest.mark.server
def test_an_unknown_session_is_one_line_and_exit_1(server: ServerProcess) -> None:
    result = run_client("--url", server.http, "--session", "nosuchsession", "--secret", "s")
    assert result.returncode == 1
    assert "no session nosuchsession" in one_line(result.stderr)


@pytest.mark.server
def test_session_without_secret_is_one_line_and_exit_2() -> None:
    result = run_client("--session", "abc")
    assert result.returncode == 2
    assert "go together" in one_line(result.stderr)


@pytest.mark.server
def test_help_gives_each_option_with_its_default() -> None:
    result = run_client("--help")
    assert result.returncode == 0
    options = [a for a in parser()._actions if a.dest != "help"]
    assert {a.dest for a in options} >= {"url", "system", "session", "secret", "max_tokens"}
    for action in options:
        assert action.help and "(default: " in action.help, action.dest
    assert "(default: ws://127.0.0.1:8000/v1/chat)" in " ".join(result.stdout.split())


# ---------------------------------------------------------------------- the server going away


@pytest.fixture
def restartable(tmp_path: Any) -> Iterator[Callable[[], ServerProcess]]:
    """Start the same server (port, Redis prefix, model) as often as a test asks; each earlier
    one must have been stopped or killed. Its keys are deleted at the end."""
    tiny = make_tiny_llama(tmp_path / "tiny")
    port, prefix = free_port(), unique_prefix()
    started: list[ServerProcess] = []

    def start() -> ServerProcess:
        server = start_server(
            tmp_path / f"server-{len(started)}.log",
            *("--port", str(port), "--redis-url", REDIS_URL, "--redis-prefix", prefix),
            *("--model", str(tiny), "--dtype", "float32"),
        )
        started.append(server)
        return server

    yield start
    for server in started:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait(30)
    delete_prefix(prefix)


@pytest.mark.server
def test_the_server_going_away_while_idle_is_said_at_once_and_the_client_reconnects(
    terminal: type[Terminal], restartable: Callable[[], ServerProcess]
) -> None:
    first = restartable()
    t = terminal("--url", first.http, "--temperature", "0", "--max-tokens", "4")
    t.read_until(b"> ")
    assert first.stop() == 0
    # Said on a line of its own within 2 s of the server's exit (polled every 0.2 s).
    t.read_until(b"[the server went away; reconnecting", timeout=2.0)
    t.send(b"Hello the")  # typed while it is away: kept in the line
    mark = len(t.output)
    restartable()
    t.read_until(b"[reconnected: session ", start=mark)
    t.send(b"re\r")
    t.read_until(b" tokens; prompt ", start=mark)
    assert "Traceback" not in t.text
    t.send(CTRL_D)
    assert t.wait() == 0


@pytest.mark.server
def test_a_hard_kill_mid_answer_puts_the_error_on_its_own_line(
    terminal: type[Terminal], restartable: Callable[[], ServerProcess]
) -> None:
    server = restartable()
    # No --max-tokens: the room left (an explicit one past it is refused, not shortened).
    t = terminal("--url", server.http, "--temperature", "0", "--ignore-eos")
    t.read_until(b"> ")
    t.send(b"Count.\r")
    start = len(t.output)
    while len(t.output) < start + 40:  # the answer is streaming
        t._read(5.0)
    server.proc.kill()
    server.proc.wait(30)
    t.read_until(b"[the connection was lost mid-answer]")
    at = t.output.index(b"[the connection was lost mid-answer]")
    assert t.output[at - 1 : at] in (b"\n", b"\r"), t.text[-300:]
    restartable()
    t.read_until(b"[reconnected: session ", start=at)
    t.send(CTRL_D)
    assert t.wait() == 0


MARKDOWN = (
    "Here:\n\n```python\nprint('hi')\n```\n\n- **one**\n- two\n\n| a | b |\n|---|---|\n| 1 | 2 |\n"
)


def test_on_a_terminal_an_answer_streams_as_rendered_markdown() -> None:
    """Fed in small pieces as deltas come, the answer ends drawn as markdown: no fences, no
    asterisks or pipes of the source, the code and the table's cells kept."""
    import io

    from rich.console import Console

    from clients.terminal import AnswerView

    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=60, color_system="standard")
    view = AnswerView(markdown=True, console=console)
    for i in range(0, len(MARKDOWN), 3):
        view.add(MARKDOWN[i : i + 3])
    view.end()
    shown = out.getvalue()
    final = shown[shown.rfind("Here:") :]  # the last redraw
    plain = __import__("re").sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", final)
    assert "print('hi')" in plain and "one" in plain and "1" in plain
    assert "```" not in plain and "**" not in plain and "|---" not in plain
    assert "\x1b[1m" in final  # bold, as a terminal shows it


@pytest.mark.server
async def test_on_a_color_terminal_the_answer_is_redrawn_in_place_and_ctrl_c_still_cancels(
    server: ServerProcess, terminal: type[Terminal]
) -> None:
    """TERM=xterm-256color: the answer is drawn by rich's live display (the cursor hidden
    while it redraws, moved up over the lines it replaces); Ctrl-C stops it as in plain mode,
    the usage line and the prompt follow."""
    client = terminal(
        "--url", server.http, "--max-tokens", "400", "--ignore-eos", term="xterm-256color"
    )
    client.read_until(b"> ")
    client.send(b"Tell me a very long story.\r")
    asked = len(client.read_until(b"story.\r\n"))
    deadline = time.monotonic() + 60
    while len(client.output) < asked + 400 and client._read(deadline - time.monotonic()):
        pass
    client.send(CTRL_C)
    client.read_until(b"cancelled]", start=asked)
    drawn = client.output[asked:]
    assert b"\x1b[?25l" in drawn and b"\x1b[1A" in drawn  # hidden cursor, moved up
    client.read_until(b"> ", start=client.output.rindex(b"cancelled]"))
    client.send(CTRL_D)
    assert client.wait() == 0
    assert "Traceback" not in client.text
    await wait_balanced(server)


def test_piped_an_answer_is_its_plain_text(capsys: pytest.CaptureFixture[str]) -> None:
    from clients.terminal import AnswerView

    view = AnswerView(markdown=False)
    for i in range(0, len(MARKDOWN), 5):
        view.add(MARKDOWN[i : i + 5])
    view.end()
    assert capsys.readouterr().out == MARKDOWN + "\n"
    assert parser().parse_args([]).markdown == "auto"
